"""A fused attention under torch.compile (tritonmm.modules.qkv_traced): inference traces q, k and v as one
``tritonmm::stacked_linear`` whose slices the projections return; values against the unfused module in float64,
what traces the projections as they are (autograd, hooks, SERVE_COMPILED off), weights moved after compiling, and
the op itself against torch."""

import pytest
import torch
import torch.nn.functional as F

from tritonmm.core.reference import randn
from tritonmm.modules import qkv_traced
from tritonmm.ops.stacked import stacked_linear

from test_qkv import Attention, fused_copy, tiny_llama

pytestmark = pytest.mark.interpreter  # (CPU weights are packed under Triton's interpreter only)


@pytest.fixture(autouse=True)
def serve_compiled(monkeypatch):
    monkeypatch.setattr(qkv_traced, "SERVE_COMPILED", True)


def compiled(module):
    """``torch.compile(module, fullgraph=True)`` and the names of the call targets in each graph Dynamo makes."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    return torch.compile(module, fullgraph=True, backend=backend), graphs


def _linears(targets) -> tuple:
    return sum("stacked_linear" in t for t in targets), sum(t == "<built-in function linear>" for t in targets)


@pytest.mark.parametrize("bias", [False, True])
def test_inference_traces_one_stacked_gemm_with_the_same_values(bias):
    ref, attn = fused_copy(Attention, bias=bias)
    x = randn(2, 3, 32, dtype=torch.float64)
    fn, graphs = compiled(attn)
    with torch.no_grad():
        out = fn(x)
        torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-12)
    assert _linears(graphs[-1]) == (1, 1)  # q/k/v stacked; o_proj on its own
    assert not any("forward" in m.__dict__ for m in (attn.q_proj, attn.k_proj, attn.v_proj))


def test_autograd_hooks_and_serve_compiled_off_trace_the_projections(monkeypatch):
    ref, attn = fused_copy(Attention)
    x = randn(4, 32, dtype=torch.float64)
    fn, graphs = compiled(attn)
    out = fn(x)  # gradients recorded
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    assert _linears(graphs[-1]) == (0, 4) and attn.q_proj.weight.grad is not None
    seen = []
    handle = attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    fn, graphs = compiled(attn)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), ref(x))
    handle.remove()
    assert _linears(graphs[-1]) == (0, 4) and seen == [torch.Size([4, 16])]
    monkeypatch.setattr(qkv_traced, "SERVE_COMPILED", False)
    fn, graphs = compiled(attn)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), ref(x))
    assert _linears(graphs[-1]) == (0, 4)


def test_weights_moved_or_replaced_after_compiling_are_read_where_they_are_now():
    ref, attn = fused_copy(Attention, bias=True)
    x = randn(3, 32, dtype=torch.float64)
    fn, _ = compiled(attn)
    with torch.no_grad():
        fn(x)
        for r, m in ((ref.k_proj, attn.k_proj), (ref.v_proj, attn.v_proj)):
            w = randn(*m.weight.shape, dtype=torch.float64)
            r.weight.data, m.weight.data = w.clone(), w.clone()  # (k's own storage now: not stacked)
        attn.q_proj.bias.data.add_(1.0)
        ref.q_proj.bias.data.add_(1.0)
        torch.testing.assert_close(fn(x), ref(x), rtol=1e-12, atol=1e-12)


def test_calls_above_max_flops_trace_three_gemms(monkeypatch):
    ref, attn = fused_copy(Attention)
    x = randn(8, 32, dtype=torch.float64)
    monkeypatch.setattr("tritonmm.modules.qkv.MAX_FLOPS", 2 * 8 * 32 * 64 - 1)  # (64 stacked rows)
    fn, graphs = compiled(attn)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), ref(x))
    assert _linears(graphs[-1]) == (0, 4)


@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_linear_against_float64(adjacent, bias):
    rows = (24, 8, 8)
    base = randn(sum(rows), 40, dtype=torch.float32)
    ws = list(base.split(rows)) if adjacent else [randn(r, 40, dtype=torch.float32) for r in rows]
    bs = list(randn(sum(rows), dtype=torch.float32).split(rows)) if bias else []
    x = randn(2, 5, 40, dtype=torch.float32)
    before = [t.clone() for t in (x, *ws, *bs)]
    expected = torch.cat([F.linear(x.double(), w.double(), b.double() if bias else None)
                          for w, b in zip(ws, bs or [None] * 3)], -1)
    torch.testing.assert_close(stacked_linear(x, ws, bs).double(), expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, *ws, *bs)))  # inputs untouched


def test_stacked_linear_errors_as_f_linear():
    ws = list(randn(12, 8).split((8, 4)))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        stacked_linear(randn(3, 7), ws, [])
    with pytest.raises(ValueError, match="2 weights but 1 biases"):
        stacked_linear(randn(3, 8), ws, [randn(8)])
    with pytest.raises(RuntimeError):
        stacked_linear(randn(3, 8, dtype=torch.float64), ws, [])


def test_stacked_linear_records_gradients_where_asked():
    base = randn(12, 8, dtype=torch.float64).requires_grad_()
    ws = list(base.split((8, 4)))
    x = randn(3, 8, dtype=torch.float64)
    stacked_linear(x, ws, []).sum().backward()
    torch.testing.assert_close(base.grad, x.sum(0).expand(12, 8))


def test_transformers_llama_compiled_fullgraph_traces_one_stacked_gemm_per_layer():
    ref, model = tiny_llama()
    ids = torch.randint(0, 64, (2, 7))
    fn, graphs = compiled(model)
    with torch.no_grad():
        got, want = fn(ids).logits, ref(ids).logits
    assert len(graphs) == 1 and sum("stacked_linear" in t for t in graphs[0]) == 2  # one per layer, no graph break
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class WritesFirst(Attention):
    """Writes its input in place before the projections: they read the new values."""

    def forward(self, hidden_states):
        hidden_states.mul_(2)
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        return self.o_proj(q * torch.cat([k, v], -1))


class WritesAlias(Attention):
    """Writes its input through another name between the projections: k and v read the new values."""

    def forward(self, hidden_states):
        h = hidden_states
        q = self.q_proj(hidden_states)
        h.mul_(2)
        k, v = self.k_proj(hidden_states), self.v_proj(hidden_states)
        return self.o_proj(q * torch.cat([k, v], -1))


class ProjectsTwice(Attention):
    """Calls q_proj twice and writes the first output in place: the second is its own tensor."""

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        q.mul_(2)
        q2 = self.q_proj(hidden_states)
        k, v = self.k_proj(hidden_states), self.v_proj(hidden_states)
        return self.o_proj((q + q2) * torch.cat([k, v], -1))


@pytest.mark.parametrize("cls", [WritesFirst, WritesAlias, ProjectsTwice])
def test_inputs_written_in_place_and_a_projection_called_twice_get_the_unfused_values(cls):
    ref, attn = fused_copy(cls)
    x = randn(3, 32, dtype=torch.float64)
    fn, graphs = compiled(attn)
    with torch.no_grad():
        torch.testing.assert_close(fn(x.clone()), ref(x.clone()), rtol=1e-12, atol=1e-12)
    assert _linears(graphs[-1])[0] == 1


def test_swapped_projections_are_traced_as_they_are():
    import tritonmm

    ref, attn = fused_copy(Attention)
    tritonmm.swap_linear(attn)
    x = randn(3, 32, dtype=torch.float64)
    fn, graphs = compiled(attn)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), ref(x), rtol=1e-12, atol=1e-12)
    assert _linears(graphs[-1])[0] == 0  # (their forward calls tritonmm.linear: no GEMM run twice)


def test_stacked_linear_0_dim_input_and_no_weights():
    with pytest.raises(RuntimeError, match="at least 1D"):
        stacked_linear(randn(()), list(randn(12, 8).split((8, 4))), [])
    with pytest.raises(ValueError, match="at least one weight"):
        stacked_linear(randn(3, 8), [], [])
