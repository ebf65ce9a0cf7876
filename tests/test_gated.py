"""tritonmm.gated_linear and fuse/unfuse: values and gradients against float64, modes, errors, module surgery."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritonmm
from tritonmm.core import activations
from tritonmm.core.reference import EPS, randn
from tritonmm.dispatch import gated
from tritonmm.kernels.gated_launchers import gated_launcher
from tritonmm.ops import gated as gated_op
from tritonmm.ops import gated_mlp

pytestmark = pytest.mark.interpreter

ACTS = list(gated_op.GATED_ACTIVATIONS)


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


@pytest.mark.parametrize("M", [13, 40], ids=["gemm_kernel", "cublas_product"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ACTS)
def test_gradients_match_float64(act, bias, M, monkeypatch):
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)  # the product path at these sizes too
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", 0)
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)
    x, wg, wu, bg, bu = operands(M, 40, 56, bias=bias)
    x = x.view(M, 1, 56)
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
        assert len(gated_op._fast) == 1
        for other in (randn(9, 48), randn(3, 3, 48), randn(9, 96)[:, ::2], randn(9, 48, dtype=torch.float16),
                      randn(9, 96)[:, :48], randn(3, 3, 96)[..., 48:]):  # (row-strided views: read in place)
            w = (wg, wu, bg, bu) if other.dtype == x.dtype else (wg.half(), wu.half(), bg.half(), bu.half())
            for _ in range(2):  # the second call replays
                assert_close_to_ref(tritonmm.gated_linear(other, *w), other, *w)
        assert len(gated_op._fast) == 6  # the strided input is copied, so it keys on its own geometry but replays too
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # torch's own message
        tritonmm.gated_linear(randn(9, 40), wg, wu, bg, bu)


def test_more_than_gated_max_m_rows_take_cublas_projections_and_one_product_pass(monkeypatch):
    """Above GATED_MAX_M rows no gated GEMM kernel is built: cuBLAS projections, then one product pass."""
    import tritonmm.kernels.gated_launchers as gl
    from tritonmm.dispatch import gated_cublas

    launchers, products = [], []
    real_launcher, real_product = gl.gated_launcher, gated_cublas.product
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)  # the product path at these sizes too
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", 0)
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)
    monkeypatch.setattr(gl, "gated_launcher", lambda *a, **k: launchers.append(a[1]) or real_launcher(*a, **k))
    monkeypatch.setattr(gated_cublas, "product", lambda *a: products.append(a[0].shape) or real_product(*a))
    tritonmm.clear_cache()
    x, wg, wu, bg, bu = operands(gated.GATED_MAX_M, 24, 32, bias=True)
    tritonmm.gated_linear(x, wg, wu, bg, bu)
    assert launchers == [gated.GATED_MAX_M] and products == []
    big = randn(3, gated.GATED_MAX_M, 32)[:, ::2]  # 24 rows, strided
    with torch.no_grad():
        for _ in range(2):  # the second call replays the bound geometry
            assert_close_to_ref(tritonmm.gated_linear(big, wg, wu, bg, bu), big, wg, wu, bg, bu)
    assert launchers == [gated.GATED_MAX_M] and products == [(3, 8, 24)] * 2


def test_calls_below_product_min_flops_run_the_torch_expression(monkeypatch):
    """Above GATED_MAX_M rows the product path serves calls with autograd from PRODUCT_MIN_FLOPS per projection and
    calls without from PRODUCT_MIN_FLOPS_NO_GRAD (the no-grad replay too); below them the torch expression, and a
    fused MLP its own forward, its weights packed or not."""
    from tritonmm.dispatch import gated_cublas
    from tritonmm.kernels import gated_product

    products = []  # product passes: through product(), or the replay's bound launch
    real = gated_cublas.product
    monkeypatch.setattr(gated_cublas, "product", lambda *a: products.append(1) or real(*a))
    halves = gated_product.halves_launcher
    monkeypatch.setattr(gated_product, "halves_launcher",
                        lambda *a: (lambda launch: lambda args: products.append(1) or launch(args))(halves(*a)))
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)
    x, wg, wu, _, _ = operands(40, 24, 32)
    mlp = tritonmm.fuse(MLP(hidden=32, inter=24), pack=False)
    packed = tritonmm.fuse(MLP(hidden=32, inter=24))
    assert gated_cublas.packed(packed.gate_proj.weight, packed.up_proj.weight) is not None
    flops = 2 * 40 * 24 * 32
    # (grad threshold, no-grad threshold) -> product passes of the 2 forwards with autograd and the 3 without
    for grad_min, no_grad_min, with_grad, without in ((flops + 1, flops + 1, 0, 0), (flops, flops, 2, 3),
                                                      (flops, flops + 1, 2, 0), (flops + 1, flops, 0, 3)):
        monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", grad_min)
        monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", no_grad_min)
        tritonmm.clear_cache()
        products.clear()
        xg = x.clone().requires_grad_()
        out = tritonmm.gated_linear(xg, wg, wu)
        out.sum().backward()
        assert_close_to_ref(out.detach(), x, wg, wu)
        mlp(xg)
        assert len(products) == with_grad, (grad_min, no_grad_min)
        products.clear()
        with torch.no_grad():
            for _ in range(2):  # the second call: the bound replay
                assert_close_to_ref(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
            mlp(x)
        assert len(products) == without, (grad_min, no_grad_min)
        products.clear()
        packed(xg)
        assert len(products) == with_grad // 2, (grad_min, no_grad_min)
        products.clear()
        with torch.no_grad():
            packed(x)
        assert len(products) == without // 3, (grad_min, no_grad_min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_product_kernels_against_float64(dtype, act):
    """The one-pass product and its backward write every element, within one rounding of float64."""
    from tritonmm.kernels import gated_product

    n = 3 * gated_product.BLOCK + 77  # a partial last block
    g, u, dh = (randn(n, dtype=dtype) * 3 for _ in range(3))
    g[:4] = torch.tensor([0.0, -30.0, 30.0, -1e-3])  # zero, saturated and tiny gates
    h, dg, du = (torch.full((n,), float("nan"), dtype=dtype) for _ in range(3))
    gated_product.gated_product(g, u, h, act)
    gated_product.gated_product_backward(dh, g, u, dg, du, act)
    def expression(g, u, dh):  # torch's: the activation, the product and autograd's backward
        g = g.detach().requires_grad_()
        h = activations.apply(g, act) * u
        return h.detach(), torch.autograd.grad(h, g, dh)[0], dh * activations.apply(g.detach(), act)

    wants = expression(g.double(), u.double(), dh.double())
    torch_errs = [(t.double() - w).abs().max().item() for t, w in zip(expression(g, u, dh), wants)]
    for out, want, torch_err in zip((h, dg, du), wants, torch_errs):  # at most twice torch's error, plus a rounding
        assert not out.isnan().any()
        assert (out.double() - want).abs().max().item() <= 2 * torch_err + EPS[dtype] * want.abs().max().item()


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
    """Calls of the gated linear's forward, or of the fused MLP's training Function's product."""
    calls = []
    real = gated_op.forward
    monkeypatch.setattr(gated_op, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_product = gated_mlp._product
    monkeypatch.setattr(gated_mlp, "_product", lambda *a: calls.append(2) or real_product(*a))
    return calls


@pytest.mark.parametrize("rows", [7, 30], ids=["gemm_kernel", "cublas_product"])
@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU()], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_matches_module_values_and_grads(act, bias, rows, monkeypatch):
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)  # the product path at these sizes too
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", 0)
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)
    torch.manual_seed(0)
    mlp = MLP(act=act, bias=bias)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    assert type(fused).__name__ == "TritonFusedMLP" and isinstance(fused, MLP)
    calls = _count_gated(monkeypatch)
    x = randn(2, rows, 48)
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    out = fused(x1)
    ref = copy.deepcopy(mlp).double()
    expected = ref(x2)
    assert calls, "the gated linear did not run"
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


def test_down_proj_runs_as_its_module_would(monkeypatch):
    """A plain down_proj is called as F.linear, skipping Module.__call__; a hooked, patched or swapped one
    (whose forward is tritonmm's) as a module, so its hooks and routes apply."""
    from tritonmm.modules import fusion

    torch.manual_seed(0)
    mlp = MLP(bias=True)
    ref = copy.deepcopy(mlp)
    fused = tritonmm.fuse(mlp)
    x = randn(3, 48)
    direct = []
    monkeypatch.setattr(fusion, "_F_linear", lambda *a: direct.append(a[1]) or F.linear(*a))
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)
    assert len(direct) == 1 and direct[0] is fused.down_proj.weight
    handle = fused.down_proj.register_forward_hook(lambda m, i, o: o * 2)
    torch.testing.assert_close(fused(x), 2 * ref(x), rtol=1e-5, atol=1e-5)
    handle.remove()
    with tritonmm.patch_linear():
        torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)
    tritonmm.swap_linear(fused)
    with tritonmm.force_backend("triton"):  # the swapped down_proj's own route
        torch.testing.assert_close(fused(x), ref(x), rtol=1e-4, atol=1e-4)
    assert len(direct) == 1


def test_projections_settled_under_patch_linear_still_fuse(monkeypatch):
    """patch_linear settles layers whose weights go to cuBLAS into a subclass of their class: a fused MLP
    still recognises such projections, and calls such a down_proj as F.linear."""
    from tritonmm.dispatch import decide
    from tritonmm.modules import fusion

    monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: True)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device: True)
    tritonmm.clear_cache()  # decisions cached by earlier tests
    torch.manual_seed(0)
    mlp = MLP()
    ref = copy.deepcopy(mlp)
    x = randn(3, 48)
    with tritonmm.patch_linear():
        mlp(x), mlp(x)
        assert all("_tritonmm_patched" in type(m).__dict__ for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        fused = tritonmm.fuse(mlp)
        calls = _count_gated(monkeypatch)
        direct = []
        monkeypatch.setattr(fusion, "_F_linear", lambda *a: direct.append(a[1]) or F.linear(*a))
        torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)
        assert calls and len(direct) == 1 and direct[0] is fused.down_proj.weight
    assert type(fused.gate_proj) is nn.Linear and type(fused.down_proj) is nn.Linear
    tritonmm.clear_cache()  # (plans made under the patched dispatcher)


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


def test_inputs_no_gated_kernel_takes_run_the_recognised_forward(monkeypatch):
    """Where no gated kernel takes x (a CPU tensor outside Triton's interpreter, float64), the fused MLP runs its
    recognised forward, as the unfused module does, without entering gated_linear; under the interpreter a CPU
    float32 x of up to GATED_MAX_M rows enters it."""
    from tritonmm.modules import fusion

    torch.manual_seed(0)
    mlp = MLP()
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    entered = []
    monkeypatch.setattr(fusion, "gated_linear", lambda *a: entered.append(1) or gated_op.gated_linear(*a))
    x = randn(3, 48)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.testing.assert_close(fused(x), mlp(x), rtol=1e-5, atol=1e-5)
    assert not entered
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.testing.assert_close(fused.double()(x.double()), mlp.double()(x.double()))
    assert not entered
    fused.float(), mlp.float()
    torch.testing.assert_close(fused(x), mlp(x), rtol=1e-5, atol=1e-5)
    assert entered == [1]


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


@pytest.mark.parametrize("packed", [False, True])
def test_compiled_fused_mlp_fullgraph_under_autocast(packed):
    """Packed weights are cast as one tensor in eager calls only: tracing cannot read where they lie."""
    mlp = MLP()
    ref = copy.deepcopy(mlp)
    tritonmm.fuse(mlp, pack=packed)
    if packed:  # (CPU weights pack under the interpreter only)
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    f = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    g = torch.compile(lambda t: tritonmm.gated_linear(t, mlp.gate_proj.weight, mlp.up_proj.weight), fullgraph=True,
                      backend="eager")
    x = randn(3, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = f(x), ref(x)
        h = g(x)
        h_want = F.silu(ref.gate_proj(x)) * ref.up_proj(x)
    assert out.dtype == want.dtype == h.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h, h_want, rtol=2e-2, atol=2e-2)


def _graphs(module, shapes):
    """How many graphs torch.compile (automatic dynamic shapes) makes of ``module`` over calls on inputs of these
    shapes, each with and without autograd."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(module, backend=backend, fullgraph=True)
    for shape in shapes:
        x = randn(*shape)
        f(x.requires_grad_()).sum().backward()
        with torch.no_grad():
            f(x)
    return len(graphs)


def test_compiled_fused_mlp_adds_no_size_guards():
    """Dynamo reads a symbolic size as an int; the trace-time decision must not guard on the row count (a fused
    MLP recompiles no more often than the module it replaces)."""
    shapes = [(2, 1, 48), (2, 3, 48), (2, 20, 48), (2, 5, 48)]
    assert _graphs(tritonmm.fuse(MLP()), shapes) == _graphs(MLP(), shapes)


# ----------------------------------------------------------------------------- found by adversarial inputs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,N,K", [(3, 0, 8), (3, 5, 0), (0, 5, 8)])
def test_empty_problem_backward(bias, M, N, K):
    """Zero-size dims: the gradients the torch expression gives (zeros or empty), values included."""
    x, wg, wu, bg, bu = operands(M, N, K, bias=bias)
    x = x.view(1, M, K)  # with a batch dim: the backward's reshapes must not guess a -1
    ours = [t.clone().requires_grad_() for t in (x, wg, wu) + ((bg, bu) if bias else ())]
    theirs = [t.detach().double().requires_grad_() for t in ours]
    out, want = tritonmm.gated_linear(*ours), gated.reference(*theirs)
    assert out.shape == want.shape == (1, M, N)
    (out.sum() + ours[0].sum()).backward()
    (want.sum() + theirs[0].sum()).backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.double(), b.grad)


@pytest.fixture
def product_path(monkeypatch):
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)  # the product path at CPU test sizes
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", 0)
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)


@pytest.mark.parametrize("rows", [4, 17], ids=["gemm_kernel", "cublas_product"])
def test_relu_gradient_is_a_select_as_torchs(rows, product_path):
    """A NaN gate passes the gradient, a gate <= 0 gives exactly 0 even where the upstream product is inf."""
    x, wg, wu = torch.zeros(rows, 4), randn(3, 4), randn(3, 4)
    bu = torch.tensor([1.0, float("inf"), 1.0])
    grads = []
    for f in (tritonmm.gated_linear, gated.reference):
        bg = torch.tensor([float("nan"), -1.0, 2.0], requires_grad=True)
        f(x, wg, wu, bg, bu, "relu").sum().backward()
        grads.append(bg.grad)
    torch.testing.assert_close(grads[0], grads[1], equal_nan=True)


def test_half_underflow_and_infinity_as_eager(product_path):
    """act(g) is rounded to the output dtype before the product, as eager and the gated GEMM kernel do."""
    w = torch.zeros(2, 8, dtype=torch.half)
    bg, bu = torch.tensor([-25.0, -25.0], dtype=torch.half), torch.tensor([float("inf"), 30000.0], dtype=torch.half)
    for rows in (4, 17):
        x = torch.zeros(rows, 8, dtype=torch.half)
        torch.testing.assert_close(tritonmm.gated_linear(x, w, w, bg, bu), gated.reference(x, w, w, bg, bu),
                                   equal_nan=True)


@pytest.mark.parametrize("rows", [4, 17], ids=["gemm_kernel", "cublas_product"])
def test_saves_what_torch_saves(rows, product_path):
    """Inputs torch's expression does not save may change in place before the backward (x with frozen weights,
    biases); inference-mode biases work; a create_graph backward that needs a changed input raises."""
    wg, wu = randn(4, 8), randn(4, 8)
    a = randn(rows, 8).requires_grad_()
    x = a * 1
    out = tritonmm.gated_linear(x, wg, wu)
    want = torch.autograd.grad(gated.reference(a * 1, wg, wu).sum(), a)[0]
    x.add_(1)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), a)[0], want, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        bg, bu = randn(4), randn(4)
    xg = randn(rows, 8).requires_grad_()
    tritonmm.gated_linear(xg, wg, wu, bg, bu).sum().backward()
    assert xg.grad is not None
    w = wg.clone().requires_grad_()
    x = randn(rows, 8).requires_grad_()
    out = tritonmm.gated_linear(x * 1, w, wu, randn(4), randn(4))
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # recomputed from the live inputs
    gx.sum().backward()
    assert w.grad is not None
    b = randn(4)
    out = tritonmm.gated_linear(x, w, wu, b, randn(4))
    b.add_(1)
    with pytest.raises(RuntimeError, match="inplace"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_batched_gradients_and_vectorized_jacobian(product_path):
    x, wg, wu, _, _ = operands(17, 4, 8)
    xg = x.clone().requires_grad_()
    out = tritonmm.gated_linear(xg, wg, wu)
    v = randn(2, 17, 4)
    (got,) = torch.autograd.grad(out, xg, v, is_grads_batched=True)
    x64 = x.double().requires_grad_()
    (want,) = torch.autograd.grad(gated.reference(x64, wg.double(), wu.double()), x64, v.double(),
                                  is_grads_batched=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    jac = torch.autograd.functional.jacobian(lambda w: tritonmm.gated_linear(x[:5], w, wu), wg, vectorize=True)
    want = torch.autograd.functional.jacobian(lambda w: gated.reference(x[:5].double(), w, wu.double()), wg.double())
    torch.testing.assert_close(jac.double(), want, rtol=1e-4, atol=1e-4)


def test_zero_output_features_with_saved_projections(product_path):
    for rows in (4, 17):
        h, g, u = torch.ops.tritonmm.gated_linear(randn(rows, 8), randn(0, 8), randn(0, 8), None, None, "silu", True)
        assert h.shape == (rows, 0) and g.shape == u.shape == (rows, 0)


@pytest.mark.parametrize("rows,hidden,inter,grad,product", [
    (512, 4096, 14336, True, True),     # Llama-3-8B's MLP at 512 tokens: 6e10 FLOP per projection, GPU-bound on the H200
    (4096, 2048, 5632, True, True),     # TinyLlama's at 4096 tokens
    (512, 2048, 5632, True, False),     # TinyLlama's at 512 tokens: 1.2e10 FLOP, host-bound (0.74x with the
    #                                     product path); without autograd the gated kernel's (test below)
    (4096, 1024, 2816, True, False),    # the model benchmark's small config at 4096 tokens: 2.4e10 FLOP (0.95x)
    (512, 4096, 14336, False, False),   # the 8B-sized model's 1 x 512 prefill: host-paced (0.971-0.977x with the path)
    (4096, 2048, 5632, False, False),   # TinyLlama's at 4096 tokens without autograd: 9.5e10 FLOP
    (4096, 4096, 14336, False, True),   # the 8B-sized model's 4 x 1024 prefill: 4.8e11 FLOP (1.013-1.021x)
    (4096, 1024, 2816, False, False),
])
def test_product_thresholds_separate_the_measured_gpu_bound_and_host_bound_mlps(rows, hidden, inter, grad, product):
    """PRODUCT_MIN_FLOPS (calls with autograd) and PRODUCT_MIN_FLOPS_NO_GRAD (without) sit between the MLP sizes
    measured slower with the product path (host-paced) and those measured faster (gated.py's docstrings;
    benchmarks/h200_mlp.json, h200_model.json)."""
    x = torch.empty(rows, hidden, device="meta")
    w = torch.empty(inter, hidden, device="meta", requires_grad=grad)
    assert gated.torch_serves(x, w) is not product
    with torch.no_grad():  # no autograd whatever the tensors need
        flops = rows * hidden * inter * 2
        assert gated.torch_serves(x, w) is (gated.KERNEL_MAX_FLOPS_NO_GRAD < flops < gated.PRODUCT_MIN_FLOPS_NO_GRAD)


@pytest.mark.parametrize("rows,hidden,inter,kernel", [
    (32, 1024, 2816, True),     # the small model's MLP: 1.84x of the torch expression in GPU time on the H200
    (2048, 1024, 2816, True),   # 1.2e10 FLOP per projection: 1.03x
    (512, 2048, 5632, True),    # TinyLlama's: 1.02x
    (128, 4096, 14336, True),   # Llama-3-8B's: 1.5e10 FLOP, 1.06x
    (1024, 2048, 5632, False),  # 2.4e10 FLOP: 0.91x
    (256, 4096, 14336, False),  # 3.0e10 FLOP: 0.86x
])
def test_kernel_band_holds_the_mlps_measured_faster_with_the_gated_kernel(rows, hidden, inter, kernel):
    """KERNEL_MAX_FLOPS_NO_GRAD takes, without autograd, the MLP sizes above GATED_MAX_M rows at which the gated
    kernel was measured faster than the torch expression (first-sight tuning's measurement, bf16;
    benchmarks/diagnostics/h200_gated_band.json) and leaves out those measured slower; calls with autograd never."""
    assert gated.kernel_rows(rows, inter, hidden, False) is kernel
    assert not gated.kernel_rows(rows, inter, hidden, True)
    x = torch.empty(rows, hidden, device="meta")
    w = torch.empty(inter, hidden, device="meta", requires_grad=True)
    with torch.no_grad():
        assert not (kernel and gated.torch_serves(x, w))  # a fused MLP calls the gated linear there


def test_calls_without_autograd_in_the_kernel_band_run_the_gated_kernel_and_replay_it(monkeypatch):
    """Above GATED_MAX_M rows, up to KERNEL_MAX_FLOPS_NO_GRAD per projection, a call without autograd runs the gated
    GEMM kernel (one launcher of its rows; replayed from the second call), values as float64's; with autograd,
    or above the band, the same geometry builds no gated launcher; a fused MLP's no-grad forward runs it too."""
    import tritonmm.kernels.gated_launchers as gl

    launchers = []
    real_launcher = gl.gated_launcher
    monkeypatch.setattr(gl, "gated_launcher", lambda *a, **k: launchers.append(a[1]) or real_launcher(*a, **k))
    tritonmm.clear_cache()
    M, N, K = 40, 24, 32
    assert gated.GATED_MAX_M < M and 2 * M * N * K <= gated.KERNEL_MAX_FLOPS_NO_GRAD
    x, wg, wu, bg, bu = operands(M, N, K, bias=True)
    with torch.no_grad():
        outs = [tritonmm.gated_linear(x, wg, wu, bg, bu) for _ in range(3)]
    assert launchers == [M] and len(gated_op._fast) == 1
    for out in outs:
        assert_close_to_ref(out, x, wg, wu, bg, bu)
    xg = x.clone().requires_grad_()
    out = tritonmm.gated_linear(xg, wg, wu, bg, bu)
    out.sum().backward()
    assert launchers == [M]
    assert_close_to_ref(out.detach(), x, wg, wu, bg, bu)
    mlp = tritonmm.fuse(MLP(hidden=K, inter=N), pack=False)
    xm = randn(2, M // 2, K)
    with torch.no_grad():
        out = mlp(xm)
    want = F.linear(ref64(xm, mlp.gate_proj.weight, mlp.up_proj.weight), mlp.down_proj.weight.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    assert launchers == [M, M]
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 2 * M * N * K - 1)
    tritonmm.clear_cache()
    with torch.no_grad():
        assert_close_to_ref(tritonmm.gated_linear(x, wg, wu, bg, bu), x, wg, wu, bg, bu)
    assert launchers == [M, M]


def test_float32_calls_key_on_the_matmul_precision_setting(monkeypatch):
    """A float32 gated launcher fixes TF32 or not when it is built (torch.get_float32_matmul_precision(), as
    torch.matmul reads it at each call): after the setting changes a call builds and replays its own launcher."""
    import tritonmm.kernels.gated_launchers as gl

    launchers = []
    real_launcher = gl.gated_launcher
    monkeypatch.setattr(gl, "gated_launcher", lambda *a, **k: launchers.append(a[1]) or real_launcher(*a, **k))
    tritonmm.clear_cache()
    x, wg, wu, _, _ = operands(8, 24, 32)
    old = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high", "highest"):
            torch.set_float32_matmul_precision(precision)
            with torch.no_grad():
                for _ in range(2):  # the second call replays
                    assert_close_to_ref(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
    finally:
        torch.set_float32_matmul_precision(old)
    assert launchers == [8, 8] and len(gated_op._fast) == 2  # (the third setting is the first's again)


def test_replay_is_not_taken_by_neg_views_zero_tensors_or_a_bias_of_another_alignment():
    """The bound replay keys on geometry: an operand of the same geometry with a pending negation
    (``x.conj().imag``), a storage-less zero tensor or a bias at another 16-byte alignment (Triton
    specializes pointers on it) takes the checked path, and the result is right."""
    tritonmm.clear_cache()
    x, wg, wu, bg, bu = operands(4, 8, 1, bias=True)  # K = 1: a neg view keeps a unit last stride
    with torch.no_grad():
        real = torch.view_as_real(torch.complex(randn(4, 1), x))[..., 1]  # x's values, strides (2, 2)
        neg = torch.complex(randn(4, 1), -x).conj().imag  # x's values through a pending negation
        assert neg.is_neg() and neg.stride() == real.stride() and torch.equal(neg, x)
        for t in (real, real, neg, neg):  # the second call of each replays, where allowed
            assert_close_to_ref(tritonmm.gated_linear(t, wg, wu, bg, bu), x, wg, wu, bg, bu)
        for _ in range(2):
            assert_close_to_ref(tritonmm.gated_linear(x, wg, wu, bg, bu), x, wg, wu, bg, bu)
        neg_w = torch._neg_view(-wg)  # wg, read through a pending negation
        neg_b = torch._neg_view(-bg)
        assert_close_to_ref(tritonmm.gated_linear(x, neg_w, wu, neg_b, bu), x, wg, wu, bg, bu)
        zero = torch._efficientzerotensor(x.shape)
        ref = gated.reference(torch.zeros_like(x), wg, wu, bg, bu)
        torch.testing.assert_close(tritonmm.gated_linear(zero, wg, wu, bg, bu), ref)
        launchers = len(gated._launchers)
        shifted = randn(2 * 8 + 1)[1:9]  # the same bias values at another alignment
        shifted.copy_(bg)
        assert shifted.data_ptr() % 16 != bg.data_ptr() % 16
        for _ in range(2):
            assert_close_to_ref(tritonmm.gated_linear(x, wg, wu, shifted, bu), x, wg, wu, bg, bu)
        assert len(gated._launchers) == launchers + 1  # its own launcher, not the aligned bias's


def test_jit_trace_of_a_fused_mlp_runs_with_and_without_autograd(monkeypatch):
    """torch.jit.trace records one path for every run of the trace: a fused MLP's trace is the torch expression's,
    which runs with or without autograd (the op's grad-mode flag would be a constant of the trace)."""
    torch.manual_seed(0)
    ref = MLP(hidden=32, inter=24)
    fused = tritonmm.fuse(copy.deepcopy(ref))
    x = randn(3, 32)
    traced = torch.jit.trace(fused, (x,))
    with torch.no_grad():
        traced_no_grad = torch.jit.trace(fused, (x,))
    for t in (traced, traced_no_grad):
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        t(xg).sum().backward()
        ref(xr).sum().backward()
        torch.testing.assert_close(xg.grad, xr.grad)
        with torch.no_grad():
            torch.testing.assert_close(t(x), ref(x))
