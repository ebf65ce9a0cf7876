"""tritonmm.gated_linear and fuse/unfuse: values and gradients against float64, modes, errors, module surgery."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritonmm
from tritonmm import gated
from tritonmm.kernels.gated_launchers import gated_launcher
from tritonmm.testing import EPS, randn

pytestmark = pytest.mark.interpreter

ACTS = list(gated.GATED_ACTIVATIONS)


def ref64(x, wg, wu, bg=None, bu=None, act="silu"):
    d = lambda t: None if t is None else t.double()  # noqa: E731
    return gated.reference(d(x), d(wg), d(wu), d(bg), d(bu), act)


def assert_close_to_ref(out, x, wg, wu, bg=None, bu=None, act="silu"):
    """At most twice the error of the torch expression in the same dtype, plus one output rounding and
    fp32 accumulation in another order (as :mod:`tritonmm.testing` allows for a GEMM), carried
    through the activation and the product."""
    ref = ref64(x, wg, wu, bg, bu, act)
    torch_err = (gated.reference(x, wg, wu, bg, bu, act).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    x64, g64, u64 = x.double().abs(), F.linear(x.double(), wg.double()), F.linear(x.double(), wu.double())
    acc = 4 * 2.0**-24 * x.shape[-1] ** 0.5 * max(F.linear(x64, wg.double().abs()).max().item(),
                                                  F.linear(x64, wu.double().abs()).max().item())
    carried = acc * (1.2 * u64.abs().max().item() + g64.abs().max().item() + acc)
    bound = 2 * torch_err + EPS[x.dtype] * ref.abs().max().item() + carried + 1e-12
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert err <= bound, f"error {err:.3e} > bound {bound:.3e} (torch's {torch_err:.3e})"


def operands(M, N, K, dtype=torch.float32, bias=False):
    x = randn(M, K, dtype=dtype)
    wg, wu = randn(N, K, dtype=dtype) / K**0.5, randn(N, K, dtype=dtype) / K**0.5
    bg, bu = (randn(N, dtype=dtype), randn(N, dtype=dtype)) if bias else (None, None)
    return x, wg, wu, bg, bu


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,N,K,bias", [(1, 48, 40, False), (37, 80, 96, True), (70, 33, 64, False),
                                        (20, 16, 100, True)])
def test_kernel_values_and_saved_projections(kernel, dtype, act, M, N, K, bias):
    x, wg, wu, bg, bu = operands(M, N, K, dtype, bias)
    h, g, u = gated.forward(x, wg, wu, bg, bu, act, True, kernel=kernel)
    assert_close_to_ref(h, x, wg, wu, bg, bu, act)
    torch.testing.assert_close(g, F.linear(x, wg, bg), rtol=max(EPS[dtype] * 4, 1e-5), atol=max(EPS[dtype] * 4, 1e-5))
    torch.testing.assert_close(u, F.linear(x, wu, bu), rtol=max(EPS[dtype] * 4, 1e-5), atol=max(EPS[dtype] * 4, 1e-5))


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_every_output_element_is_written(kernel):
    M, N, K = 45, 50, 72
    x, wg, wu, _, _ = operands(M, N, K)
    h, g, u = (torch.full((M, N), float("nan")) for _ in range(3))
    launch = gated_launcher(kernel, M, N, K, K, K, K, torch.float32, x.device, None, True, "silu")
    launch(x, wg, wu, None, None, h, g, u)
    assert not (h.isnan().any() or g.isnan().any() or u.isnan().any())
    assert_close_to_ref(h, x, wg, wu)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ACTS)
def test_gradients_match_float64(act, bias):
    x, wg, wu, bg, bu = operands(13, 40, 56, bias=bias)
    x = x.view(13, 1, 56)
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu) + ((bg, bu) if bias else ())]
    out = tritonmm.gated_linear(*leaves[:3], *(leaves[3:] or (None, None)), activation=act)
    grad_out = randn(*out.shape)
    out.backward(grad_out)
    refs = [t.detach().double().requires_grad_() for t in leaves]
    ref = gated.reference(*refs[:3], *(refs[3:] or (None, None)), act)
    ref.backward(grad_out.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for t, r in zip(leaves, refs):
        torch.testing.assert_close(t.grad.double(), r.grad, rtol=1e-4, atol=1e-4)


def test_leading_dims_strides_and_inputs_unchanged():
    x = randn(3, 9, 2 * 48)[:, ::2, ::2]  # (3, 5, 48), non-contiguous
    wg, wu = randn(40, 96)[:, ::2], randn(40, 48)
    before = [t.clone() for t in (x, wg, wu)]
    out = tritonmm.gated_linear(x, wg, wu)
    assert out.shape == (3, 5, 40) and out.is_contiguous()
    assert_close_to_ref(out, x, wg, wu)
    for t, b in zip((x, wg, wu), before):
        assert torch.equal(t, b)


def test_fallbacks_float64_empty_and_vmap():
    x, wg, wu, _, _ = operands(6, 24, 32, torch.float64)
    torch.testing.assert_close(tritonmm.gated_linear(x, wg, wu), gated.reference(x, wg, wu))
    assert tritonmm.gated_linear(randn(0, 32), wg.float(), wu.float()).shape == (0, 24)
    xs = randn(4, 6, 32)
    out = torch.vmap(lambda t: tritonmm.gated_linear(t, wg.float(), wu.float()))(xs)
    torch.testing.assert_close(out, gated.reference(xs, wg.float(), wu.float()), rtol=1e-5, atol=1e-5)


def test_no_grad_calls_replay_a_bound_launch_per_geometry():
    tritonmm.clear_cache()
    x, wg, wu, bg, bu = operands(9, 40, 48, bias=True)
    with torch.no_grad():
        tritonmm.gated_linear(x, wg, wu, bg, bu)
        assert len(gated._fast) == 1
        for other in (randn(9, 48), randn(3, 3, 48), randn(9, 96)[:, ::2], randn(9, 48, dtype=torch.float16)):
            w = (wg, wu, bg, bu) if other.dtype == x.dtype else (wg.half(), wu.half(), bg.half(), bu.half())
            for _ in range(2):  # the second call replays
                assert_close_to_ref(tritonmm.gated_linear(other, *w), other, *w)
        assert len(gated._fast) == 4  # the strided input is copied, so it keys on its own geometry but replays too
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # torch's own message
        tritonmm.gated_linear(randn(9, 40), wg, wu, bg, bu)


def test_more_than_gated_max_m_rows_go_to_torch(monkeypatch):
    calls = _count_gated(monkeypatch)
    x, wg, wu, _, _ = operands(gated.GATED_MAX_M, 24, 32)
    tritonmm.gated_linear(x, wg, wu)
    assert len(calls) == 1
    big = randn(gated.GATED_MAX_M + 1, 32)
    torch.testing.assert_close(tritonmm.gated_linear(big, wg, wu), gated.reference(big, wg, wu))
    assert len(calls) == 1


def test_errors_match_torch_types():
    x, wg, wu, bg, bu = operands(4, 16, 32, bias=True)
    with pytest.raises(TypeError):
        tritonmm.gated_linear(x.numpy(), wg, wu)
    for bad in ("tanh", ["silu"]):
        with pytest.raises(ValueError, match="activation"):
            tritonmm.gated_linear(x, wg, wu, activation=bad)
    for args in ((randn(4, 31), wg, wu, None, None), (x, wg, wu[:8], None, None),
                 (x, wg.half(), wu.half(), None, None), (x, wg, wu, bg[:3], bu[:3])):
        with pytest.raises(RuntimeError) as from_torch:
            gated.reference(*args)
        with pytest.raises(type(from_torch.value)):
            tritonmm.gated_linear(*args)


def test_forms_the_kernel_does_not_take_are_served_as_torch_serves_them():
    x, wg, wu, bg, bu = operands(4, 16, 32, bias=True)
    for args in ((x, wg, wu, bg, None), (x, wg, wu, None, bu), (x, wg, wu, bg[:1], bu[:1]),
                 (x, wg, wu, torch.tensor(0.5), torch.tensor(2.0)), (x, wg[0], wu[0], None, None),
                 (x.to_sparse(), wg, wu, None, None)):
        torch.testing.assert_close(tritonmm.gated_linear(*args), gated.reference(*args), rtol=1e-5, atol=1e-5)


def test_fast_path_keys_each_bias_on_its_own():
    tritonmm.clear_cache()
    x, wg, wu, _, bu = operands(4, 16, 32, bias=True)
    with torch.no_grad():
        for _ in range(2):
            tritonmm.gated_linear(x, wg, wu)
        torch.testing.assert_close(tritonmm.gated_linear(x, wg, wu, None, bu), gated.reference(x, wg, wu, None, bu))


def test_double_backward_and_gradient_penalty_match_float64():
    x, wg, wu, _, _ = operands(3, 8, 12)
    hess = torch.autograd.functional.hessian(lambda t: tritonmm.gated_linear(t, wg, wu).sum(), x)
    want = torch.autograd.functional.hessian(lambda t: gated.reference(t, wg.double(), wu.double()).sum(), x.double())
    assert want.abs().max() > 0
    torch.testing.assert_close(hess.double(), want, rtol=1e-4, atol=1e-4)
    w1, w2 = wg.clone().requires_grad_(), wg.double().requires_grad_()
    for w, xx, f in ((w1, x.clone().requires_grad_(), tritonmm.gated_linear), (w2, x.double().requires_grad_(),
                                                                                gated.reference)):
        (g,) = torch.autograd.grad(f(xx, w, wu.to(w.dtype)).sum(), xx, create_graph=True)
        g.square().sum().backward()
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-4, atol=1e-4)


def test_in_place_use_of_the_output_under_autograd():
    x, wg, wu, _, _ = operands(3, 8, 12)
    x.requires_grad_()
    out = tritonmm.gated_linear(x, wg, wu)
    out.mul_(2).sum().backward()
    x2 = x.detach().double().requires_grad_()
    (2 * gated.reference(x2, wg.double(), wu.double())).sum().backward()
    torch.testing.assert_close(x.grad.double(), x2.grad, rtol=1e-4, atol=1e-4)


def test_autocast_casts_as_f_linear():
    x, wg, wu, _, _ = operands(8, 32, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tritonmm.gated_linear(x, wg, wu)
        ref = gated.reference(x, wg, wu)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close_to_ref(out, x.bfloat16(), wg.bfloat16(), wu.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed input dtypes: autocast casts them all
        mixed = tritonmm.gated_linear(x.bfloat16(), wg, wu.half())
        want = gated.reference(x.bfloat16(), wg, wu.half())
    torch.testing.assert_close(mixed, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_values_and_grads(dynamic):
    x, wg, wu, _, _ = operands(10, 32, 48)
    wg.requires_grad_()
    f = torch.compile(lambda t, a, b: tritonmm.gated_linear(t, a, b), fullgraph=True, dynamic=dynamic,
                      backend="aot_eager")
    out = f(x, wg, wu)
    out.sum().backward()
    wg2 = wg.detach().double().requires_grad_()
    gated.reference(x.double(), wg2, wu.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref64(x, wg, wu), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wg.grad.double(), wg2.grad, rtol=1e-4, atol=1e-4)


def test_compile_dynamic_rows_across_the_limit_and_export():
    x, wg, wu, _, _ = operands(20, 16, 32)
    f = torch.compile(lambda t: tritonmm.gated_linear(t, wg, wu), fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 20, 1, 17):
        torch.testing.assert_close(f(x[:rows]), gated.reference(x[:rows], wg, wu), rtol=1e-5, atol=1e-5)

    class Gated(nn.Module):
        def forward(self, t):
            return tritonmm.gated_linear(t, wg, wu)

    ep = torch.export.export(Gated(), (x,), dynamic_shapes=({0: torch.export.Dim("M", min=2, max=64)},))
    torch.testing.assert_close(ep.module()(x[:5]), gated.reference(x[:5], wg, wu), rtol=1e-5, atol=1e-5)


def test_opcheck():
    x, wg, wu, bg, bu = operands(6, 16, 32, bias=True)
    for save in (False, True):
        torch.library.opcheck(torch.ops.tritonmm.gated_linear, (x, wg, wu, bg, bu, "silu", save),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# ----------------------------------------------------------------------------- fuse / unfuse


class MLP(nn.Module):
    """Written as transformers' LlamaMLP."""

    def __init__(self, hidden=48, inter=80, act=None, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class OtherMLP(MLP):
    def forward(self, x):  # not the gated form: never fused
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


DOWN_CALLS = []


def _down_hook(module, args, output):  # module level: fused models with it must pickle
    DOWN_CALLS.append(output.shape)


def _count_gated(monkeypatch):
    calls = []
    real = gated.forward
    monkeypatch.setattr(gated, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU()], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_matches_module_values_and_grads(act, bias, monkeypatch):
    torch.manual_seed(0)
    mlp = MLP(act=act, bias=bias)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    assert type(fused).__name__ == "TritonFusedMLP" and isinstance(fused, MLP)
    calls = _count_gated(monkeypatch)
    x = randn(2, 7, 48)
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    out = fused(x1)
    ref = copy.deepcopy(mlp).double()
    expected = ref(x2)
    assert calls, "the gated kernel did not run"
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x1.grad.double(), x2.grad, rtol=1e-4, atol=1e-4)
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_transformers_llama_and_gemma_mlps_are_fused(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    for cls, act in ((LlamaMLP, "silu"), (GemmaMLP, "gelu_pytorch_tanh")):
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act=act, hidden_activation=act)
        mlp = cls(cfg)
        fused = tritonmm.fuse(copy.deepcopy(mlp))
        assert "_tritonmm_fused_base" in type(fused).__dict__, cls
        calls = _count_gated(monkeypatch)
        x = randn(3, 32)
        torch.testing.assert_close(fused(x), mlp(x), rtol=1e-5, atol=1e-5)
        assert calls


def test_fuse_unfuse_round_trip_state_dict_hooks_ties_pickle(monkeypatch):
    model = nn.Sequential(MLP(), MLP(), OtherMLP())
    model[1].up_proj.weight = model[0].up_proj.weight  # tied across modules
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    DOWN_CALLS.clear()
    model[0].down_proj.register_forward_hook(_down_hook)
    tritonmm.fuse(model, filter_fn=lambda m, name: name != "")
    assert [type(m).__name__ for m in model] == ["TritonFusedMLP", "TritonFusedMLP", "OtherMLP"]
    assert {n: p for n, p in model.named_parameters(remove_duplicate=False)} == params
    assert model[1].up_proj.weight is model[0].up_proj.weight
    assert model.state_dict().keys() == sd.keys() and all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    x = randn(4, 48)
    calls = _count_gated(monkeypatch)
    out = model(x)
    assert DOWN_CALLS == [torch.Size([4, 48])] and len(calls) == 2
    clone = pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (clone, copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert type(other[0]).__name__ == "TritonFusedMLP"
        torch.testing.assert_close(other(x), out)
    tritonmm.unfuse(model)
    assert [type(m) for m in model] == [MLP, MLP, OtherMLP]
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-5)


def test_hook_on_gate_runs_the_original_forward(monkeypatch):
    mlp = tritonmm.fuse(MLP())
    seen = []
    mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    calls = _count_gated(monkeypatch)
    mlp(randn(3, 48))
    assert seen == [torch.Size([3, 80])] and not calls


def test_instance_forward_and_backward_hooks_run_the_original_forward(monkeypatch):
    mlp = tritonmm.fuse(MLP())
    calls = _count_gated(monkeypatch)
    mlp.gate_proj.forward = lambda x: torch.zeros(*x.shape[:-1], 80)
    assert torch.equal(mlp(randn(3, 48)), mlp.down_proj(torch.zeros(3, 80)))
    del mlp.gate_proj.forward
    seen = []
    mlp.up_proj.register_full_backward_hook(lambda m, gi, go: seen.append(1))
    mlp(randn(3, 48).requires_grad_()).sum().backward()
    assert seen == [1] and not calls


def test_unknown_activation_and_other_forms_are_left_alone():
    assert not tritonmm.gated.__name__.endswith("fusion")
    mlp = MLP(act=nn.Tanh())
    assert type(tritonmm.fuse(mlp)) is MLP
    assert type(tritonmm.fuse(OtherMLP())) is OtherMLP


def test_fused_and_swapped_compose():
    mlp = MLP()
    ref = copy.deepcopy(mlp)
    tritonmm.swap_linear(tritonmm.fuse(mlp))
    x = randn(5, 48)
    torch.testing.assert_close(mlp(x), ref(x), rtol=1e-5, atol=1e-5)


def test_compiled_fused_mlp_fullgraph():
    mlp = MLP()
    ref = copy.deepcopy(mlp)
    tritonmm.fuse(mlp)
    f = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    x = randn(3, 48)
    torch.testing.assert_close(f(x), ref(x), rtol=1e-5, atol=1e-5)
