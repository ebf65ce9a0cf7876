"""Gradients of tritonmm.matmul against torch.matmul's, broadcasting and awkward incoming gradients included."""

import pytest
import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.core.reference import randn

pytestmark = pytest.mark.interpreter

CASES = [
    ((13,), (13,)),
    ((13,), (13, 7)),
    ((9, 13), (13,)),
    ((9, 13), (13, 7)),
    ((4, 9, 13), (13, 7)),
    ((9, 13), (4, 13, 7)),
    ((2, 1, 9, 13), (3, 13, 7)),
    ((4, 9, 13), (13,)),
    ((13,), (4, 13, 7)),
]


def _grads(fn, a, b, grad_fn):
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()
    out = fn(a, b)
    grad_fn(out).backward()
    return out, a.grad, b.grad


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
@pytest.mark.parametrize("shapes", CASES, ids=str)
@pytest.mark.parametrize("incoming", ["randn", "sum", "cat"])
def test_grads_match_torch(shapes, kernel, incoming):
    a, b = randn(*shapes[0]), randn(*shapes[1])
    g = None

    def grad_fn(out):
        nonlocal g
        if incoming == "sum":  # stride-0 incoming gradient
            return out.sum()
        if incoming == "cat":  # a slice of a larger gradient
            return torch.cat([out.reshape(-1), out.reshape(-1)]).mul(torch.arange(2 * out.numel()) % 3).sum()
        if g is None:
            g = randn(*out.shape)
        return (out * g).sum()

    with tritonmm.force_backend("triton", kernel):
        out, ga, gb = _grads(tritonmm.matmul, a, b, grad_fn)
    ref, ra, rb = _grads(torch.matmul, a, b, grad_fn)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ga.shape == a.shape and gb.shape == b.shape
    torch.testing.assert_close(ga, ra, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, rb, rtol=1e-5, atol=1e-5)


def test_grad_only_where_needed():
    a = randn(8, 5).requires_grad_()
    b = randn(5, 3)
    with tritonmm.force_backend("triton"):
        tritonmm.matmul(a, b).sum().backward()
    assert a.grad is not None and b.grad is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_grads(dtype):
    a, b = randn(33, 47, dtype=dtype), randn(47, 29, dtype=dtype)
    g = randn(33, 29, dtype=dtype)
    with tritonmm.force_backend("triton"):
        _, ga, gb = _grads(tritonmm.matmul, a, b, lambda o: (o * g).sum())
    _, ra, rb = _grads(lambda x, y: torch.matmul(x.double(), y.double()), a, b, lambda o: (o * g.double()).sum())
    assert ga.dtype == dtype and gb.dtype == dtype
    ra, rb = ra.double(), rb.double()  # float64 products, rounded once to the input dtype
    torch.testing.assert_close(ga.double(), ra, rtol=2e-2, atol=2e-2 * ra.abs().max().item())
    torch.testing.assert_close(gb.double(), rb, rtol=2e-2, atol=2e-2 * rb.abs().max().item())


def test_backward_follows_the_forwards_forcing(monkeypatch):
    """force_backend around the forward also governs the backward GEMMs, on whichever thread autograd runs them."""
    import threading

    from tritonmm.dispatch import runners

    seen = []
    lookup = runners.lookup

    def spy(*args):
        prepared = lookup(*args)
        seen.append((threading.current_thread().name, prepared.decision.backend, args[-1]))
        return prepared

    monkeypatch.setattr(runners, "lookup", spy)
    x = randn(33, 40).requires_grad_()
    w = randn(24, 40).requires_grad_()
    with tritonmm.force_backend("triton", "pointer"):
        y = tritonmm.linear(x, w, None, "gelu")
        z = tritonmm.matmul(y, randn(24, 5))
    backward = threading.Thread(target=lambda: z.sum().backward())  # a thread with no forcing of its own
    backward.start()
    backward.join()
    assert x.grad is not None and w.grad is not None
    assert len(seen) >= 5 and all(backend == "triton" for _, backend, _ in seen), seen
    assert any(name != threading.current_thread().name for name, _, _ in seen)  # backward ran elsewhere


# ----------------------------------------------------------------- eager Function path vs the custom op


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: the Triton kernels (interpreter)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
def test_eager_function_path_matches_the_op(activation, dtype):
    """Eager autograd calls of tritonmm.linear/matmul run torch.autograd.Function subclasses (no
    dispatcher layers); they must give the op's values, gradients and double-backward gradients."""
    def run(use_op):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 7, 12, generator=g, dtype=dtype).requires_grad_()
        w = torch.randn(9, 12, generator=g, dtype=dtype).requires_grad_()
        b = torch.randn(9, generator=g, dtype=dtype).requires_grad_()
        y = (torch.ops.tritonmm.linear(x, w, b, activation) if use_op else tritonmm.linear(x, w, b, activation))
        if not use_op and dtype == torch.float32:  # float64 is torch's: F.linear's own autograd
            assert type(y.grad_fn).__name__ == "_LinearFunctionBackward"
        z = tritonmm.matmul(y, w) if not use_op else torch.ops.tritonmm.matmul(y, w)
        gx, gw, gb = torch.autograd.grad(z.square().sum(), (x, w, b), create_graph=True)
        ggx = torch.autograd.grad((gx.sin().sum() + gw.cos().sum() + gb.sum()), (x, w))
        return y, z, gx, gw, gb, *ggx

    tol = 1e-10 if dtype == torch.float64 else 1e-4  # same kernels and formulas: equal up to rounding
    for got, want in zip(run(False), run(True)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_eager_function_path_under_autocast_casts_like_the_op():
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)  # mixed: autocast makes them agree
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tritonmm.linear(x, w)
        ref = F.linear(x, w)
        y_op = torch.ops.tritonmm.linear(x, w, None, "none")
    assert y.dtype == ref.dtype == y_op.dtype == torch.bfloat16
    assert torch.equal(y, y_op)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.bfloat16  # grads in the leaves' dtypes
    with pytest.raises(RuntimeError, match="dtype"):  # outside autocast the mismatch is torch's error
        tritonmm.linear(x, w)


@pytest.mark.parametrize("op", ["linear", "matmul", "op-linear"])
def test_batched_gradients_like_torch(op):
    """autograd.grad(is_grads_batched=True) and jacobian/hessian(vectorize=True) run the backward
    under torch's older vmap, whose batched tensors have no storage: they go to torch."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64)
    f = {"linear": lambda t: tritonmm.linear(t, w, None, "gelu"),
         "matmul": lambda t: tritonmm.matmul(t, w.t()),
         "op-linear": lambda t: torch.ops.tritonmm.linear(t, w, None, "gelu")}[op]
    ref = (lambda t: F.gelu(F.linear(t, w))) if op != "matmul" else (lambda t: t @ w.t())
    v = torch.randn(7, 3, 5, dtype=torch.float64)
    (got,) = torch.autograd.grad(f(x), x, v, is_grads_batched=True)
    (want,) = torch.autograd.grad(ref(x), x, v, is_grads_batched=True)
    torch.testing.assert_close(got, want)
    jac = torch.autograd.functional.jacobian(f, x, vectorize=True)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(ref, x, vectorize=True))
    hes = torch.autograd.functional.hessian(lambda t: f(t).sum(), x, vectorize=True)
    torch.testing.assert_close(hes, torch.autograd.functional.hessian(lambda t: ref(t).sum(), x, vectorize=True))
