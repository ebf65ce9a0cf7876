"""Gradients of tritonmm.matmul against torch.matmul's, broadcasting and awkward incoming gradients included."""

import pytest
import torch

import tritonmm
from tritonmm.testing import randn

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

    from tritonmm import engine

    seen = []
    lookup = engine.lookup

    def spy(*args):
        prepared = lookup(*args)
        seen.append((threading.current_thread().name, prepared.decision.backend, args[-1]))
        return prepared

    monkeypatch.setattr(engine, "lookup", spy)
    x = randn(33, 40).requires_grad_()
    w = randn(24, 40).requires_grad_()
    with tritonmm.force_backend("torch"):
        y = tritonmm.linear(x, w, None, "gelu")
        z = tritonmm.matmul(y, randn(24, 5))
    backward = threading.Thread(target=lambda: z.sum().backward())  # a thread with no forcing of its own
    backward.start()
    backward.join()
    assert x.grad is not None and w.grad is not None
    assert len(seen) >= 5 and all(backend == "torch" for _, backend, _ in seen), seen
