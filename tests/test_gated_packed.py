"""The gated GEMM on packed [Wg; Wu] weights (kernels.gated_packed) through the interpreter: forward and backward
values against float64, every element written, tails of M and N, and where the dispatcher sends packed calls."""

import pytest
import torch
import torch.nn.functional as F
from test_gated import ACTS, assert_close_to_ref

import tritonmm
from tritonmm.core import activations
from tritonmm.core.reference import randn
from tritonmm.dispatch import gated_cublas
from tritonmm.kernels.packed_launchers import packed_backward_launcher, packed_launcher
from tritonmm.ops import gated as gated_op

pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _packed(N, K, dtype):
    w = randn(2 * N, K, dtype=dtype) / K**0.5
    return w, w[:N], w[N:]


def _nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,N,K", [(1, 8, 32), (45, 40, 72), (70, 16, 104), (33, 56, 24)])
def test_forward_values_and_saved_halves(dtype, act, M, N, K):
    """H against float64 (partial tiles in M, N and K), [G | U] as F.linear's outputs, no element unwritten."""
    x = randn(M, K, dtype=dtype)
    w, wg, wu = _packed(N, K, dtype)
    h, gu = _nan(M, N, dtype=dtype), _nan(M, 2 * N, dtype=dtype)
    packed_launcher(M, N, K, K, K, dtype, x.device, save=True, activation=act)(x, w, h, gu)
    assert not h.isnan().any() and not gu.isnan().any()
    assert_close_to_ref(h, x, wg, wu, act=act)
    tol = _tol(dtype)
    torch.testing.assert_close(gu[:, :N], F.linear(x, wg), rtol=tol, atol=tol)
    torch.testing.assert_close(gu[:, N:], F.linear(x, wu), rtol=tol, atol=tol)
    h2 = _nan(M, N, dtype=dtype)
    packed_launcher(M, N, K, K, K, dtype, x.device, activation=act)(x, w, h2, None)  # without saving: same H
    torch.testing.assert_close(h2, h, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,N,K", [(45, 40, 72), (16, 24, 48)])
def test_backward_values(dtype, act, M, N, K):
    """[dG | dU] from dY @ Wd and the saved projections, against float64 autograd of act(g) * u."""
    gu = randn(M, 2 * N, dtype=dtype)
    dy, wd = randn(M, K, dtype=dtype), randn(K, N, dtype=dtype) / N**0.5
    dgu = _nan(M, 2 * N, dtype=dtype)
    packed_backward_launcher(M, N, K, K, N, dtype, dy.device, activation=act)(dy, wd, gu, dgu)
    assert not dgu.isnan().any()
    g = gu[:, :N].double().requires_grad_()
    u = gu[:, N:].double().requires_grad_()
    dg, du = torch.autograd.grad(activations.apply(g, act) * u, (g, u), dy.double() @ wd.double())
    scale = max(dg.abs().max().item(), du.abs().max().item(), 1.0)
    tol = 4 * _tol(dtype) * scale
    torch.testing.assert_close(dgu[:, :N].double(), dg, rtol=0, atol=tol)
    torch.testing.assert_close(dgu[:, N:].double(), du, rtol=0, atol=tol)


def _packed_kernel_everywhere(monkeypatch):
    monkeypatch.setattr(gated_cublas, "PACKED_KERNEL_MIN_FLOPS", 1)  # (the CPU tests' sizes)
    gated_op.clear_cache()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_weights_take_the_kernel(dtype, monkeypatch):
    """A call without autograd on packed weights runs the packed kernel (its launcher is built), the first call
    and its replay; unpacked weights take cuBLAS; values match float64 either way."""
    _packed_kernel_everywhere(monkeypatch)
    x = randn(2, 20, 64, dtype=dtype)
    w, wg, wu = _packed(24, 64, dtype)
    for _ in range(2):  # the call, then its bound replay
        with torch.no_grad():
            h = tritonmm.gated_linear(x, wg, wu)
        assert_close_to_ref(h, x, wg, wu)
        assert len(gated_cublas._packed_launchers) == 1
    gated_op.clear_cache()
    with torch.no_grad():
        h = tritonmm.gated_linear(x, wg.clone(), wu.clone())
    assert_close_to_ref(h, x, wg, wu)
    assert not gated_cublas._packed_launchers


def test_a_replay_launches_the_packed_kernel_without_the_dispatch(monkeypatch):
    """A later call of a geometry the packed kernel served launches it from the bound replay (the dispatch's
    forward not called) into a fresh output; weights of that geometry that no longer lie packed go back through the
    dispatch (cuBLAS). Values match float64 every time."""
    _packed_kernel_everywhere(monkeypatch)
    monkeypatch.setattr(gated_cublas, "_empty", lambda shape, **kw: torch.full(shape, float("nan"), **kw))
    x = randn(2, 20, 64, dtype=torch.float16)
    w, wg, wu = _packed(24, 64, torch.float16)
    with torch.no_grad():
        first = tritonmm.gated_linear(x, wg, wu)
    calls = []
    dispatch = gated_cublas.forward
    monkeypatch.setattr(gated_cublas, "forward", lambda *a, **k: calls.append(a) or dispatch(*a, **k))
    x2 = randn(2, 20, 64, dtype=torch.float16)
    with torch.no_grad():
        h = tritonmm.gated_linear(x2, wg, wu)
    assert not calls and h.data_ptr() != first.data_ptr()
    assert_close_to_ref(h, x2, wg, wu)
    with torch.no_grad():
        h = tritonmm.gated_linear(x2, wg.clone(), wu.clone())
    assert len(calls) == 1
    assert_close_to_ref(h, x2, wg, wu)


def test_packed_kernel_limits(monkeypatch):
    """Below PACKED_KERNEL_MIN_FLOPS, N not a multiple of 8, float32, a misaligned operand, or a call keeping the
    projections for the backward: the packed kernel does not serve."""
    _packed_kernel_everywhere(monkeypatch)
    x = randn(20, 64, dtype=torch.float16)
    for N, dtype in ((36, torch.float16), (24, torch.float32)):
        w, wg, wu = _packed(N, 64, dtype)
        assert not gated_cublas.packed_kernel_serves(x.to(dtype), w, False)
    w, wg, wu = _packed(24, 64, torch.float16)
    assert gated_cublas.packed_kernel_serves(x, w, False)
    assert not gated_cublas.packed_kernel_serves(x, w, True)  # (PACKED_KERNEL_SAVE is False)
    assert not gated_cublas.packed_kernel_serves(x[:, 1:33], w[:, :32], False)  # a misaligned base
    assert gated_cublas.packed_takes(x, wg, wu, False) and not gated_cublas.packed_takes(x, wg, wu.clone(), False)
    monkeypatch.setattr(gated_cublas, "PACKED_KERNEL_MIN_FLOPS", 2 * 20 * 24 * 64 + 1)
    assert not gated_cublas.packed_kernel_serves(x, w, False) and not gated_cublas.packed_takes(x, wg, wu, False)


def test_is_packed_agrees_with_packed():
    """The per-call check (no view built) answers as packed() does: adjacent halves of one storage, in order, one
    shape and dtype, contiguous; not two allocations, swapped halves, strided or transposed views, other shapes."""
    w = randn(48, 64, dtype=torch.float16)
    other = randn(48, 64, dtype=torch.float16)
    cases = [(w[:24], w[24:]), (w[24:], w[:24]), (w[:24], other[24:]), (w[:16], w[16:]), (w[:24], w[24:].half()),
             (w[:24, :32], w[24:, :32]), (w[:24], w[24:].t().contiguous().t()), (w[:8], w[8:16]), (w[:8], w[16:24]),
             (w.view(2, 24, 64)[0], w.view(2, 24, 64)[1]), (w[:0], w[:0])]
    for wg, wu in cases:
        assert gated_cublas.is_packed(wg, wu) == (gated_cublas.packed(wg, wu) is not None)
    assert gated_cublas.is_packed(w[:24], w[24:]) and gated_cublas.is_packed(w[:8], w[8:16])
    assert not gated_cublas.is_packed(w[24:], w[:24]) and not gated_cublas.is_packed(w[:24], other[24:])


def test_fused_mlp_forward_takes_the_packed_kernel(monkeypatch):
    """fuse packs the MLP's gate and up weights; an inference forward then runs the packed kernel (not the module's
    own forward, which the FLOP thresholds would pick at this size) and matches it computed in float64."""
    _packed_kernel_everywhere(monkeypatch)
    torch.manual_seed(0)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(48, 40, bias=False)
            self.up_proj = torch.nn.Linear(48, 40, bias=False)
            self.down_proj = torch.nn.Linear(40, 48, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    mlp = MLP().half()
    ref = MLP().double()
    ref.load_state_dict(mlp.state_dict())
    tritonmm.fuse(mlp)
    assert gated_cublas.packed(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
    x = randn(3, 30, 48, dtype=torch.float16)
    with torch.no_grad():
        out = mlp(x)
    assert gated_cublas._packed_launchers
    torch.testing.assert_close(out.double(), ref(x.double()), rtol=2e-2, atol=2e-2)
