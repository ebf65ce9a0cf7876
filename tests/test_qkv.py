"""Fused attention projections (tritonmm.qkv): fuse packs q, k and v into one allocation, and in inference
the attention runs them as one GEMM whose slices the projections serve; values against the unfused module
in float64, what stays unfused (autograd, autocast, another input, a changed input), hooks, copies, moves."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritonmm
from tritonmm.core.reference import randn
from tritonmm.modules import fusion, packing, qkv

pytestmark = pytest.mark.interpreter  # (CPU weights are packed under Triton's interpreter only)


class Attention(nn.Module):
    """The shape of transformers' attention: q, k and v read the hidden states, then an output projection."""

    def __init__(self, hidden=32, kv=16, bias=False, dtype=torch.float64):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)

    def forward(self, hidden_states, scale=1.0):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        return self.o_proj(query * torch.cat([key, value], -1).sigmoid() * scale)


class InPlace(Attention):
    """Changes the hidden states in place between the projections: k and v must see the new values."""

    def forward(self, hidden_states):
        query = self.q_proj(hidden_states)
        hidden_states.mul_(2)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        return self.o_proj(query * torch.cat([key, value], -1))


class OtherInput(Attention):
    """Projects something else than its first argument."""

    def forward(self, hidden_states):
        h = hidden_states * 3
        return self.o_proj(self.q_proj(h) * torch.cat([self.k_proj(h), self.v_proj(h)], -1))


def fused_copy(cls, **kwargs):
    """``cls(**kwargs)``, built after seeding 0, and a fused deep copy of it."""
    torch.manual_seed(0)
    ref = cls(**kwargs)
    return ref, tritonmm.fuse(copy.deepcopy(ref))


def is_packed(attn) -> bool:
    return packing.stacked((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)) is not None


@pytest.fixture(autouse=True)
def serve_eager(monkeypatch):
    """Serve eager calls, as CUDA-graph capture is served (the CPU has no CUDA graphs)."""
    monkeypatch.setattr(qkv, "SERVE_EAGER", True)


def test_capture_check_asks_the_driver_only_off_the_default_stream(monkeypatch):
    """The default stream (raw stream 0) cannot capture: no driver query for it; any other stream is asked, as
    every stream is where torch has no raw-stream binding."""
    class CudaLike:
        is_cuda = True

        def get_device(self):
            return 0

    asked = []
    monkeypatch.setattr(qkv, "_capturing", lambda: asked.append(1) or True)
    monkeypatch.setattr(qkv, "_raw_stream", lambda index: 0)
    assert not qkv._captured(CudaLike()) and not asked
    monkeypatch.setattr(qkv, "_raw_stream", lambda index: 0x7F00)
    assert qkv._captured(CudaLike()) and asked == [1]
    monkeypatch.setattr(qkv, "_raw_stream", None)
    assert qkv._captured(CudaLike()) and asked == [1, 1]


def test_by_default_only_calls_under_cuda_graph_capture_are_served(linear_calls, monkeypatch):
    ref, attn = fused_copy(Attention)
    x = randn(2, 5, 32, dtype=torch.float64)
    monkeypatch.setattr(qkv, "SERVE_EAGER", False)
    assert not qkv._captured(x)  # a CPU tensor
    with torch.no_grad():
        want = ref(x)
        linear_calls.clear()
        got = attn(x)
        assert ("packed", torch.Size([64, 32])) not in linear_calls and len(linear_calls) == 4
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        monkeypatch.setattr(qkv, "_captured", lambda x: True)  # as while a CUDA graph is captured
        linear_calls.clear()
        got = attn(x)
    assert linear_calls == [("packed", torch.Size([64, 32])), attn.o_proj.weight]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.fixture
def linear_calls(monkeypatch):
    """Weights F.linear is called with: nn.Linear's forward (the unfused projections) and the fused GEMM."""
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: calls.append(w) or real(x, w, b))
    monkeypatch.setattr(qkv, "_F_linear", lambda x, w, b=None: calls.append(("packed", w.shape)) or real(x, w, b))
    return calls


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fused_attention_runs_one_gemm_in_inference_with_the_same_values(bias, linear_calls):
    ref, attn = fused_copy(Attention, bias=bias)
    assert type(attn).__name__ == "TritonFusedAttention" and is_packed(attn)
    if bias:
        assert packing.stacked((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)) is not None
    x = randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        want = ref(x)
        linear_calls.clear()
        got = attn(x)
    assert linear_calls == [("packed", torch.Size([64, 32])), attn.o_proj.weight]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert "forward" not in attn.q_proj.__dict__ and "forward" not in attn.v_proj.__dict__  # served once, removed
    assert not any(p.grad is not None for p in attn.parameters())


def test_autograd_autocast_and_pack_false_run_the_projections_as_they_are(linear_calls):
    ref, attn = fused_copy(Attention, dtype=torch.float32)
    x = randn(3, 32, dtype=torch.float32).requires_grad_()
    linear_calls.clear()
    attn(x).sum().backward()
    assert ("packed", torch.Size([64, 32])) not in linear_calls and len(linear_calls) == 4
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, q in zip(attn.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    linear_calls.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        attn(x)
    assert len(linear_calls) == 4
    assert type(tritonmm.fuse(Attention(), pack=False)) is Attention  # nothing to fuse without packing


def test_forwards_that_read_the_input_between_projections_or_project_another_input_are_not_fused():
    for cls in (InPlace, OtherInput):
        assert not fusion.fusable(cls()) and type(tritonmm.fuse(cls())) is cls


def test_an_input_changed_in_place_by_a_hook_is_projected_again():
    ref, attn = fused_copy(Attention)
    for m in (ref, attn):
        m.q_proj.register_forward_hook(lambda m, args, out: args[0].mul_(2))
    x = randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x.clone()), ref(x.clone()), rtol=1e-12, atol=1e-12)
    attn = tritonmm.fuse(copy.deepcopy(ref))
    with torch.inference_mode():  # (inference tensors have no version counter: hooked projections run unfused)
        torch.testing.assert_close(attn(x.clone()), ref(x.clone()), rtol=1e-12, atol=1e-12)


def test_a_projection_called_on_another_input_computes_its_own_and_the_attention_is_not_fused_again(linear_calls):
    ref, attn = fused_copy(Attention)
    for m in (ref, attn):
        m.k_proj.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    x = randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), ref(x), rtol=1e-12, atol=1e-12)
        assert qkv._UNSERVED in attn.__dict__
        linear_calls.clear()
        torch.testing.assert_close(attn(x), ref(x), rtol=1e-12, atol=1e-12)
    assert not any(isinstance(c, tuple) for c in linear_calls)  # not fused again: no wasted GEMM
    tritonmm.unfuse(attn)
    assert type(attn) is Attention and qkv._UNSERVED not in attn.__dict__


def test_hooks_on_the_projections_still_run(linear_calls):
    torch.manual_seed(0)
    ref, attn = Attention(), None
    attn = tritonmm.fuse(copy.deepcopy(ref))
    seen = []
    attn.k_proj.register_forward_hook(lambda m, args, out: seen.append(out.clone()))
    x = randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        got, want = attn(x), ref(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(seen[0], ref.k_proj(x), rtol=1e-12, atol=1e-12)
    assert qkv._UNSERVED not in attn.__dict__  # served
    new_k = randn(16, 32, dtype=torch.float64)  # a hook replacing the weight's data: k computes its own
    for a in (ref, attn):
        a.k_proj.register_forward_pre_hook(lambda m, args: setattr(m.weight, "data", new_k.clone()))
    with torch.no_grad():
        linear_calls.clear()
        got, want = attn(x), ref(x)
    assert linear_calls[0] == ("packed", torch.Size([64, 32])) and new_k.shape in [getattr(c, "shape", None)
                                                                                  for c in linear_calls]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_copies_pickles_moves_and_unfuse():
    ref, attn = fused_copy(Attention)
    x = randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        want = ref(x)
        attn(x)
    assert qkv._CACHE in attn.__dict__
    copies = {"deepcopy": copy.deepcopy(attn), "pickle": pickle.loads(pickle.dumps(attn)),
              "torch.save": torch.load(_saved(attn), weights_only=False)}
    for how, other in copies.items():  # (deepcopy and plain pickle give each parameter a storage of its own)
        assert type(other) is type(attn) and qkv._CACHE not in other.__dict__
        assert is_packed(other) == (how == "torch.save")
        with torch.no_grad():
            torch.testing.assert_close(other(x), want, rtol=1e-12, atol=1e-12)
    attn.float()  # moved: the packed views go, the weights have their own storages
    assert qkv._CACHE not in attn.__dict__ and not is_packed(attn)
    with torch.no_grad():
        torch.testing.assert_close(attn(x.float()), want.float(), rtol=1e-5, atol=1e-5)
    tritonmm.fuse(attn)  # packs again
    assert is_packed(attn)
    sd = {k: v.clone() for k, v in attn.state_dict().items()}
    tritonmm.unfuse(attn)
    assert type(attn) is Attention and not is_packed(attn)
    assert all(torch.equal(attn.state_dict()[k], v) for k, v in sd.items())


def _saved(module):
    import io

    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return buf


def test_fusable_and_the_filter():
    class NoProjections(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            return x

    assert fusion.fusable(Attention()) and not fusion.fusable(NoProjections())
    mixed = Attention()
    mixed.k_proj = nn.Linear(16, 16, dtype=torch.float64)  # another in_features
    assert not fusion.fusable(mixed)
    model = nn.ModuleDict({"a": Attention(), "b": Attention()})
    asked = []
    tritonmm.fuse(model, filter_fn=lambda m, name: asked.append(name) or name == "a")
    assert asked == ["a", "b"] and type(model["a"]) is not Attention and type(model["b"]) is Attention


def test_compiled_fused_attention_matches_fullgraph():
    ref, attn = fused_copy(Attention, dtype=torch.float32)
    x = randn(4, 32)
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x))


def tiny_llama():
    """A two-layer transformers Llama in float64 (vocabulary 64), built after seeding 0, and a fused deep copy."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).double().eval()
    return ref, tritonmm.fuse(copy.deepcopy(ref))


def test_transformers_llama_decode_matches_unfused(linear_calls):
    ref, model = tiny_llama()
    assert all(is_packed(layer.self_attn) for layer in model.model.layers)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        linear_calls.clear()
        got = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        want = ref.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert sum(isinstance(c, tuple) for c in linear_calls) == 2 * 4  # one q/k/v GEMM per layer and forward
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


class InCall(Attention):
    """Changes the input inside a projection's argument: not the pattern fuse serves."""

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states.mul_(2))
        return self.o_proj(q * torch.cat([k, self.v_proj(hidden_states)], -1))


class Before(Attention):
    """Changes the input in place before the first projection: the GEMM reads it as it is then."""

    def forward(self, hidden_states):
        hidden_states.mul_(2)
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        return self.o_proj(query * torch.cat([key, value], -1))


class ScaledQuery(Attention):
    """Scales the query in place by a trainable parameter."""

    def __init__(self):
        super().__init__(dtype=torch.float32)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, hidden_states):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        query *= self.scale
        return self.o_proj(query * torch.cat([key, value], -1))


class Triple(Attention):
    """Returns the three projections."""

    def forward(self, hidden_states):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        return query, key, value


def test_parameters_replaced_or_changed_after_a_call_are_read_as_they_are_now(linear_calls):
    ref, attn = fused_copy(Triple, bias=True)
    x = randn(4, 32, dtype=torch.float64)

    def same(fused_gemm: bool):
        linear_calls.clear()
        for got, want in zip(attn(x), ref(x)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert any(isinstance(c, tuple) for c in linear_calls) == fused_gemm

    with torch.no_grad():
        same(True)
        hooks = [m.k_proj.register_forward_pre_hook(lambda m, args: (m.weight.clamp_(-0.01, 0.01), None)[1])
                 for m in (ref, attn)]  # changes the k weight in place after the GEMM read it (weight clipping)
        same(True)
        for h in hooks:
            h.remove()
        for m in (ref, attn):  # a narrower v weight and bias at the same addresses
            m.v_proj.weight.data = m.v_proj.weight.data[:8]
            m.v_proj.bias.data = m.v_proj.bias.data[:8]
        same(True)
        for m in (ref, attn):  # a new k bias through .data: no longer packed
            m.k_proj.bias.data = torch.full((16,), 100.0, dtype=torch.float64)
        same(False)


def test_inputs_changed_in_place_before_or_inside_the_projection_calls():
    torch.manual_seed(0)
    assert not fusion.fusable(InCall())
    ref = Before()
    attn = tritonmm.fuse(copy.deepcopy(ref))
    assert type(attn) is not Before
    x = randn(4, 32, dtype=torch.float64)
    with torch.inference_mode():  # (no version counter: the GEMM runs at the first projection call)
        torch.testing.assert_close(attn(x.clone()), ref(x.clone()), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(attn(x.clone()), ref(x.clone()), rtol=1e-12, atol=1e-12)
    assert qkv._UNSERVED not in attn.__dict__


def test_grad_mode_with_frozen_projections_trains_as_unfused():
    ref, attn = fused_copy(ScaledQuery)
    for m in (ref, attn):
        for proj in (m.q_proj, m.k_proj, m.v_proj):
            proj.requires_grad_(False)
    x = randn(4, 32)
    attn(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(attn.scale.grad, ref.scale.grad)


def test_an_exception_or_a_class_patch_does_not_stop_or_stale_the_fusion(linear_calls, monkeypatch):
    torch.manual_seed(0)
    attn = tritonmm.fuse(Attention())
    x = randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        with pytest.raises(TypeError):
            attn(x, scale=None)  # raises inside the forward, after the projections
        assert qkv._UNSERVED not in attn.__dict__ and "forward" not in attn.k_proj.__dict__
        linear_calls.clear()
        attn(x)
        assert ("packed", torch.Size([64, 32])) in linear_calls
        monkeypatch.setattr(Attention, "forward", lambda self, hidden_states: hidden_states * 42)
        torch.testing.assert_close(attn(x), x * 42)


def test_calls_that_run_unfused_drop_the_packed_views():
    attn = tritonmm.fuse(Attention())
    x = randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        attn(x)
    assert qkv._CACHE in attn.__dict__
    attn(x)  # grad mode: unfused
    assert qkv._CACHE not in attn.__dict__


def test_calls_above_max_flops_run_three_gemms(linear_calls, monkeypatch):
    attn = tritonmm.fuse(Attention())
    x = randn(4, 32, dtype=torch.float64)
    monkeypatch.setattr(qkv, "MAX_FLOPS", 2 * x.numel() * 64 - 1)
    with torch.no_grad():
        attn(x)
        assert len(linear_calls) == 4 and not any(isinstance(c, tuple) for c in linear_calls)
        monkeypatch.setattr(qkv, "MAX_FLOPS", 2 * x.numel() * 64)
        linear_calls.clear()
        attn(x)
    assert linear_calls[0] == ("packed", torch.Size([64, 32])) and len(linear_calls) == 2


class Rebinds(Triple):
    """Replaces the v weight with a new Parameter inside its forward, before the projections."""

    def forward(self, hidden_states):
        self._swap_v()
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        return query, key, value

    def _swap_v(self):
        self.v_proj.weight = nn.Parameter(self.v_proj.weight.detach() * 3)


class GradInside(Attention):
    """Turns gradients on inside its forward."""

    @torch.enable_grad()
    def forward(self, hidden_states):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        return self.o_proj(query * torch.cat([key, value], -1))


def test_parameters_replaced_during_the_forward_and_grad_turned_on_inside_it():
    torch.manual_seed(0)
    x = randn(4, 32, dtype=torch.float64)
    ref = Triple()
    attn = tritonmm.fuse(copy.deepcopy(ref))
    for m in (ref, attn):  # a pre-hook that binds a new k weight
        m.k_proj.register_forward_pre_hook(
            lambda m, args: setattr(m, "weight", nn.Parameter(m.weight.detach() + 1)))
    with torch.no_grad():
        for got, want in zip(attn(x), ref(x)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ref = Rebinds()
    attn = tritonmm.fuse(copy.deepcopy(ref))
    assert type(attn) is not Rebinds
    with torch.no_grad():
        for got, want in zip(attn(x), ref(x)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ref = GradInside()
    attn = tritonmm.fuse(copy.deepcopy(ref))
    with torch.no_grad():
        out = attn(x)
    assert out.requires_grad
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(attn.q_proj.weight.grad, ref.q_proj.weight.grad)


def test_inference_tensors_run_unfused_and_a_transposed_weight_is_read_as_it_is(linear_calls):
    ref, attn = fused_copy(Triple)
    x = randn(4, 32, dtype=torch.float64)
    with torch.inference_mode():
        linear_calls.clear()
        attn(x.clone())
        assert len(linear_calls) == 3 and not any(isinstance(c, tuple) for c in linear_calls)
    with torch.no_grad():
        attn(x)
        for m in (ref, attn):  # the same address and shape, other strides
            m.q_proj.weight.data = m.q_proj.weight.data.t()
        for got, want in zip(attn(x), ref(x)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_threads_sharing_one_input():
    import threading

    ref, attn = fused_copy(Triple)
    x = randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        want = ref(x)
    errors = []

    def work():
        try:
            with torch.no_grad():
                for _ in range(150):
                    for got, w in zip(attn(x), want):
                        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not any("forward" in m.__dict__ for m in (attn.q_proj, attn.k_proj, attn.v_proj))
