"""tritonmm.linear: F.linear semantics with a fused bias + activation epilogue, autograd and autocast."""

import pytest
import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.core.reference import assert_matches_reference, randn

pytestmark = pytest.mark.interpreter

ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu"]


def act_ref(y, activation):
    return {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation](y)


def torch_linear(x, w, b, activation):
    return act_ref(F.linear(x, w, b), activation)


X_CASES = {
    "1d": lambda K: randn(K),
    "2d": lambda K: randn(7, K),
    "3d": lambda K: randn(2, 5, K),
    "4d": lambda K: randn(2, 3, 4, K),
    "transposed-3d": lambda K: randn(5, 2, K).transpose(0, 1),  # cannot be viewed as 2-D
    "sliced": lambda K: randn(9, 2 * K)[::2, ::2],
    "empty": lambda K: randn(0, K),
}


@pytest.mark.parametrize("kernel", ["tma", "pointer", "splitk"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("xcase", list(X_CASES))
def test_leading_shapes(xcase, bias, kernel):
    K, N = 40, 24
    x = X_CASES[xcase](K)
    w = randn(N, K)
    b = randn(N) if bias else None
    with tritonmm.force_backend("triton", kernel):
        out = tritonmm.linear(x, w, b)
    ref = F.linear(x, w, b)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("kernel", ["tma", "pointer", "splitk"])
def test_fused_activation_values(activation, dtype, kernel):
    x, w, b = randn(37, 48, dtype=dtype), randn(29, 48, dtype=dtype), randn(29, dtype=dtype)
    with tritonmm.force_backend("triton", kernel):
        out = tritonmm.linear(x, w, b, activation)
    assert out.dtype == dtype
    assert_matches_reference(
        out, x, w,
        ref_fn=lambda x_, w_: act_ref(F.linear(x_, w_, b.double()), activation),
        torch_fn=lambda x_, w_: torch_linear(x_, w_, b, activation), contract=F.linear,
        what=f"linear+{activation}",
    )


@pytest.mark.parametrize("kernel", ["tma", "pointer", "splitk"])
def test_gelu_tanh_epilogue_on_large_values_warns_of_nothing(kernel):
    # |x| ~ 30 puts tanh's argument far past fp32's exp range; the epilogue must neither overflow (under
    # the interpreter NumPy warns, and with warnings as errors the kernel failed and fell back) nor
    # lose saturation, and NaN still propagates
    import warnings

    x, w, b = randn(37, 29) * 30, randn(23, 29), randn(23)
    x[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (triton 3.6's interpreter raises DeprecationWarnings)
        with tritonmm.force_backend("triton", kernel):
            out = tritonmm.linear(x, w, b, "gelu_tanh")
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()
    ref = F.gelu(F.linear(x[1:].double(), w.double(), b.double()), approximate="tanh")
    torch.testing.assert_close(out[1:].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_epilogue_is_fused(monkeypatch):
    """One kernel launch; no separate bias or activation pass over the output."""
    from tritonmm.core import activations
    from tritonmm.kernels import launch, launchers

    launches = []

    class Counting:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            launches.append(grid)
            return self.fn[grid]

    for module in (launch, launchers):
        monkeypatch.setattr(module, "_matmul_tma_kernel", Counting(module._matmul_tma_kernel))
        monkeypatch.setattr(module, "_matmul_kernel", Counting(module._matmul_kernel))

    def no_torch_activation(*args, **kwargs):
        raise AssertionError("activation ran outside the kernel")

    monkeypatch.setattr(activations, "apply_", no_torch_activation)
    monkeypatch.setattr(torch.nn.functional, "gelu", no_torch_activation)
    tritonmm.clear_cache()
    x, w, b = randn(32, 48), randn(16, 48), randn(16)
    for kernel in ("tma", "pointer"):
        launches.clear()
        with tritonmm.force_backend("triton", kernel):
            out = tritonmm.linear(x, w, b, "gelu")
        assert len(launches) == 1, kernel
        ref = torch.erf(F.linear(x, w, b) / 2**0.5).add(1).mul(F.linear(x, w, b)).mul(0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_weight_views_read_in_place():
    K, N = 48, 20
    x = randn(11, K)
    w_big = randn(2 * N, K + 8)
    w = w_big[::2, 8:]  # non-contiguous (N, K) view
    b = randn(2 * N)[::2]  # strided bias
    w_t = randn(K, N).t()  # a transposed weight
    with tritonmm.force_backend("triton", "pointer"):
        torch.testing.assert_close(tritonmm.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tritonmm.linear(x, w_t), F.linear(x, w_t), rtol=1e-5, atol=1e-5)


def test_scalar_bias_broadcasts():
    x, w = randn(5, 8), randn(6, 8)
    for b in (torch.tensor(0.5), torch.tensor([0.25])):
        with tritonmm.force_backend("triton"):
            torch.testing.assert_close(tritonmm.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("xshape", [(6, 40), (2, 3, 40), (40,)], ids=str)
def test_grads_match_f_linear(activation, bias, xshape):
    x = randn(*xshape).requires_grad_()
    w = randn(24, 40).requires_grad_()
    b = randn(24).requires_grad_() if bias else None
    g = randn(*xshape[:-1], 24)
    with tritonmm.force_backend("triton"):
        (tritonmm.linear(x, w, b, activation) * g).sum().backward()
    got = [t.grad.clone() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    (torch_linear(x, w, b, activation) * g).sum().backward()
    want = [t.grad for t in (x, w, b) if t is not None]
    for gt, wt in zip(got, want):
        torch.testing.assert_close(gt, wt, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_casts_like_f_linear(dtype):
    x = randn(9, 32).requires_grad_()
    w = randn(16, 32).requires_grad_()  # fp32 master weights
    b = randn(16).requires_grad_()
    with torch.autocast("cpu", dtype=dtype), tritonmm.force_backend("triton"):
        out = tritonmm.linear(x, w, b, "relu")
        ref = F.relu(F.linear(x, w, b))
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_autocast_matmul_and_float64_untouched():
    a, b = randn(8, 16), randn(16, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16), tritonmm.force_backend("triton"):
        assert tritonmm.matmul(a, b).dtype == torch.matmul(a, b).dtype == torch.bfloat16
        a64, b64 = a.double(), b.double()
        assert tritonmm.matmul(a64, b64).dtype == torch.float64


def test_mixed_dtypes_outside_autocast_raise_like_f_linear():
    x, w = randn(4, 8), randn(6, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        F.linear(x, w)
    with pytest.raises(RuntimeError, match="dtype"):
        tritonmm.linear(x, w)


def _poison_splitk_partials():
    """NaN-fill the workspace the split-K partials will live in: a split that reduced before the others
    had stored would read NaN, not the same values left there by an earlier test."""
    from tritonmm.core import workspace

    workspace.buffers(torch.device("cpu"), [((1 << 16,), torch.float32)], slot="splitk")[0].fill_(float("nan"))


def _check_gelu_linear(out, again, x, w, b):
    """``out`` is gelu(F.linear(x, w, b)) to 1e-5 of float64, and the repeat ``again`` is bitwise equal."""
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, out)


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("n,b_trans", [(45, True), (48, False)])
def test_tma_splitk_applies_epilogue_once(split, n, b_trans):
    """The persistent TMA kernel with SPLIT_K > 1: each (tile, split) work unit stores an fp32 partial
    and the tile's last split sums them, then adds a strided bias and the activation, rounding once.
    K = 40 is 3 BLOCK_K steps: with 5 splits two slices are empty. N = 45 stores C through pointers
    (rows not 16-byte aligned), N = 48 through TMA; counters end at zero; a repeat is bitwise equal."""
    from tritonmm.core import workspace

    tritonmm.clear_cache()
    workspace.release()
    _poison_splitk_partials()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_stages": 1, "num_warps": 4,
           "EPILOGUE_SUBTILE": 0, "SPLIT_K": split}
    x, b = randn(37, 40), randn(2 * n)[::2]
    w = randn(n, 40) if b_trans else randn(40, n).t()
    with tritonmm.force_backend("triton", "tma", cfg):
        d = tritonmm.explain(x, w.t())
        assert (d.kernel, d.config) == ("tma", cfg)
        out = tritonmm.linear(x, w, b, "gelu")
        again = tritonmm.linear(x, w, b, "gelu")
    _check_gelu_linear(out, again, x, w, b)
    counters = getattr(workspace._local, "counters", {})
    assert len(counters) == 1 and all(int(t.abs().sum()) == 0 for t in counters.values())
    tritonmm.clear_cache()


@pytest.mark.parametrize("split", [2, 4])
def test_splitk_reduction_applies_epilogue_once(split):
    """The split-K reduction (in the GEMM kernel, by each tile's last split) adds every K slice's
    partial exactly once, then a strided bias and the activation, rounding once (K = 200 leaves a
    short last slice); the arrival counters are back at zero afterwards."""
    from tritonmm.core import workspace

    tritonmm.clear_cache()
    workspace.release()
    _poison_splitk_partials()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_stages": 1, "num_warps": 4,
           "SPLIT_K": split}
    x, w, b = randn(19, 200), randn(45, 200), randn(90)[::2]
    with tritonmm.force_backend("triton", "splitk", cfg):
        assert tritonmm.explain(x, w.t()).kernel == "splitk"
        out = tritonmm.linear(x, w, b, "gelu")
        again = tritonmm.linear(x, w, b, "gelu")
    _check_gelu_linear(out, again, x, w, b)
    counters = getattr(workspace._local, "counters", {})
    assert len(counters) == 1 and all(int(t.abs().sum()) == 0 for t in counters.values())
    tritonmm.clear_cache()


# F.linear broadcasts a bias of more than one dimension over its output ((M, N), (M, 1), (B, M, N), ...) and
# raises for those it cannot; tritonmm hands such calls to F.linear, with its own gradients
BROADCAST_BIASES = [((6, 40), (6, 24)), ((6, 40), (6, 1)), ((6, 40), (1, 24)), ((2, 3, 40), (3, 24)),
                    ((2, 3, 40), (2, 1, 24)), ((2, 3, 40), (2, 3, 1)), ((40,), (1, 24))]
BAD_BIASES = [((6, 40), (2, 6, 24)), ((6, 40), (24, 1)), ((2, 3, 40), (3, 1)), ((40,), (6, 24))]


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("xshape,bshape", BROADCAST_BIASES, ids=str)
def test_broadcast_biases_match_f_linear(xshape, bshape, activation, backend):
    x, w, b = randn(*xshape).requires_grad_(), randn(24, 40).requires_grad_(), randn(*bshape).requires_grad_()
    saved = [t.detach().clone() for t in (x, w, b)]
    g = randn(*xshape[:-1], 24)
    want = torch_linear(x, w, b, activation)
    want_grads = torch.autograd.grad(want, (x, w, b), g)
    with tritonmm.force_backend(backend):
        with torch.no_grad():
            torch.testing.assert_close(tritonmm.linear(x, w, b, activation), want)
        got = tritonmm.linear(x, w, b, activation)
        op = torch.ops.tritonmm.linear(x, w, b, activation)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(op, want)
    for out in (got, op):
        for gt, wt, t in zip(torch.autograd.grad(out, (x, w, b), g), want_grads, (x, w, b)):
            assert gt.shape == t.shape
            torch.testing.assert_close(gt, wt, rtol=1e-4, atol=1e-4)
    for t, s in zip((x, w, b), saved):
        assert torch.equal(t, s)


@pytest.mark.parametrize("xshape,bshape", BAD_BIASES, ids=str)
def test_biases_f_linear_cannot_broadcast_raise_its_error(xshape, bshape):
    x, w, b = randn(*xshape), randn(24, 40), randn(*bshape)
    with pytest.raises(RuntimeError):
        F.linear(x, w, b)
    for backend in ("auto", "triton"):
        with tritonmm.force_backend(backend):
            with pytest.raises(RuntimeError):
                tritonmm.linear(x, w, b)
            with pytest.raises(RuntimeError):
                torch.ops.tritonmm.linear(x, w, b)


def test_broadcast_bias_under_compile_opcheck_and_autocast():
    x, w, b = randn(2, 3, 40).requires_grad_(), randn(24, 40).requires_grad_(), randn(3, 24).requires_grad_()
    torch.library.opcheck(torch.ops.tritonmm.linear.default, (x, w, b, "silu"))
    want = F.silu(F.linear(x, w, b))
    for fn in (tritonmm.linear, torch.ops.tritonmm.linear):
        compiled = torch.compile(lambda x, w, b, fn=fn: fn(x, w, b, "silu"), fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x, w, b), want)
    with torch.autocast("cpu", dtype=torch.bfloat16), tritonmm.force_backend("triton"):
        out, ref = tritonmm.linear(x, w, b), F.linear(x, w, b)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


def test_the_op_with_a_broadcast_bias_checks_and_differentiates_as_f_linear():
    """F.linear alone checks a call with a bias of more than one dimension: one of another dtype (taken by its
    matmul + add_ path on a 4-D input) or a 1-D weight pass there, in eager mode, the fake and the backward."""
    for x, w, b in ((randn(2, 2, 4, 5), randn(3, 5), randn(4, 3).double()), (randn(2, 4, 5), randn(5), randn(2, 4))):
        x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
        want = F.linear(x, w, b)
        want_grads = torch.autograd.grad(want.sum(), (x, w, b))
        torch.library.opcheck(torch.ops.tritonmm.linear.default, (x, w, b, "none"))
        for fn in (tritonmm.linear, torch.ops.tritonmm.linear):
            for _ in range(2):  # the second call takes the geometry's cached route
                got = fn(x, w, b)
                assert got.dtype == want.dtype
                torch.testing.assert_close(got, want)
                for g, wg in zip(torch.autograd.grad(got.sum(), (x, w, b)), want_grads):
                    torch.testing.assert_close(g, wg)
            if b.dtype == x.dtype:  # (compiled F.linear itself promotes a bias of another dtype)
                compiled = torch.compile(lambda x, w, b, fn=fn: fn(x, w, b), fullgraph=True, backend="aot_eager")
                torch.testing.assert_close(compiled(x, w, b), want)


@pytest.mark.parametrize("x_shape", [(3, 6), (2, 3, 6), (6,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_a_1d_weight_is_served_as_f_linear_serves_it(x_shape, activation):
    """F.linear takes a 1-D weight without a bias (x @ w: the output loses its last dimension); tritonmm.linear and
    the op give its values, shape and gradients, in eager mode (twice: the second call takes the cached route),
    the fake and under torch.compile."""
    torch._dynamo.reset()  # (one lambda's code object across the parameters: a recompile each)
    x, w = randn(*x_shape).double().requires_grad_(), randn(6).double().requires_grad_()
    want = F.linear(x, w)
    want = F.silu(want) if activation == "silu" else want
    want_grads = torch.autograd.grad(want.sum(), (x, w))
    torch.library.opcheck(torch.ops.tritonmm.linear.default, (x, w, None, activation))
    for fn in (tritonmm.linear, torch.ops.tritonmm.linear):
        for _ in range(2):
            got = fn(x, w, None, activation)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)
            for g, wg in zip(torch.autograd.grad(got.sum(), (x, w)), want_grads):
                torch.testing.assert_close(g, wg)
        compiled = torch.compile(lambda x, w, fn=fn: fn(x, w, None, activation), fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x, w), want)
    with torch.no_grad():
        torch.testing.assert_close(tritonmm.linear(x, w, None, activation), want)


def test_a_1d_weight_with_a_1d_bias_raises_as_f_linear():
    x, w, b = randn(3, 6), randn(6), randn(3)
    with pytest.raises(RuntimeError):
        F.linear(x, w, b)
    for fn in (tritonmm.linear, torch.ops.tritonmm.linear):
        with pytest.raises(RuntimeError):
            fn(x, w, b)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except RuntimeError as e:
        return e


@pytest.mark.parametrize("layout", ["contiguous-3d", "transposed-3d", "1d"])
@pytest.mark.parametrize("bias_shape", [(), (4,)], ids=["0d", "1d"])
def test_a_bias_of_another_dtype_is_served_as_f_linear_serves_it(layout, bias_shape):
    """F.linear adds a bias of another dtype in place after its matmul where x's layout takes that path (the
    result in x's dtype) and raises where it does not; tritonmm.linear, the op and a swapped module do the same,
    on the first call and on later ones (a weight plan or a cached route must not change the answer)."""
    x = {"contiguous-3d": randn(2, 3, 6), "transposed-3d": randn(3, 2, 6).transpose(0, 1), "1d": randn(6)}[layout]
    w, b = randn(4, 6), randn(*bias_shape).double()
    x.requires_grad_(), b.requires_grad_()
    want = _outcome(F.linear, x, w, b)
    module = tritonmm.swap_linear(torch.nn.Sequential(torch.nn.Linear(6, 4)))[0]
    module.weight.data, module.bias.data = w.clone(), b.clone()
    calls = [tritonmm.linear, torch.ops.tritonmm.linear, lambda x, w, b: module(x)]
    for fn in calls:
        for _ in range(3):
            got = _outcome(fn, x, w, b)
            if isinstance(want, Exception):
                assert isinstance(got, RuntimeError), got
                continue
            assert not isinstance(got, Exception), got
            assert got.dtype == want.dtype == x.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want)
            inputs = (x,) if fn is calls[2] else (x, b)  # (the module's bias is its own parameter)
            for g, wg in zip(torch.autograd.grad(got.sum(), inputs),
                             torch.autograd.grad(want.sum(), inputs, retain_graph=True)):
                assert g.dtype == wg.dtype
                torch.testing.assert_close(g, wg)
    for fn in calls[:2]:  # after ordinary calls with the same weight (its plan in place)
        fn(x, w, b.detach().float() if b.dim() else None)
        got = _outcome(fn, x, w, b)
        assert type(got) is type(want) or isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)


def test_the_ops_raise_type_error_for_none_tensors():
    x = randn(3, 4)
    for call in (lambda: torch.ops.tritonmm.linear(x, None), lambda: torch.ops.tritonmm.linear(None, x),
                 lambda: torch.ops.tritonmm.matmul(x, None), lambda: torch.ops.tritonmm.matmul(None, x)):
        with pytest.raises(TypeError, match="must be Tensor"):
            call()


def test_double_backward_through_the_op_with_a_broadcast_bias():
    x, w, b = randn(3, 6).requires_grad_(), randn(4, 6).requires_grad_(), randn(3, 4).requires_grad_()
    grads = []
    for fn in (torch.ops.tritonmm.linear, lambda x, w, b, a: F.silu(F.linear(x, w, b))):
        gx, = torch.autograd.grad(fn(x, w, b, "silu").square().sum(), x, create_graph=True)
        grads.append(torch.autograd.grad(gx.sum(), (w, b)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)
