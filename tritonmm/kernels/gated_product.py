"""The gated product ``act(g) * u`` of two projections as one elementwise pass, and its backward.

Where cuBLAS runs the gate and up GEMMs (calls of more rows than the gated GEMM kernel serves), a
Llama-family MLP still needs the activation and the product: eager PyTorch runs them as two kernels
(read g, write act(g); read act(g) and u, write h), this as one (read g and u, write h). The backward
reads the upstream gradient, g and u once and writes both gradients, where eager autograd runs three
kernels. Values are computed in fp32; act(g) and the product's gradient are rounded to the output dtype
where eager rounds them, so infinities and NaNs come out as eager's.

The operands are contiguous, or the rows of 2-D tensors with unit column strides (g and u may be the two
halves of one (M, 2N) GEMM output). Launchers are bound per (rows, size, row strides, dtype, device,
activation, alignment) and launch the compiled kernel directly after the first call
(:class:`.launch.DirectLaunch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.env import interpreting
from .common import _activation, _to_output
from .launch import LAUNCH_FAILURES, DirectLaunch  # noqa: F401 (LAUNCH_FAILURES: for the callers)

BLOCK = 1024
NUM_WARPS = 4
_LAUNCHERS_MAX = 1024
_launchers: dict = {}


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr):
    """d act(x) / dx on fp32 values for "gelu", "gelu_tanh" and "silu" (the derivatives torch's backward
    formulas use; ReLU's backward is a select, in the kernel)."""
    if ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        d = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)  # as in _activation: tanh is +-1 in fp32 there
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    else:  # silu
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    return d


@triton.jit
def _rows_cols(N, BLOCK: tl.constexpr):
    """This program's row and its block of columns (a row of N elements is split into cdiv(N, BLOCK) blocks)."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK)
    row = (pid // col_blocks).to(tl.int64)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < N


@triton.jit
def _store_product(g, u, h_ptr, row, cols, mask, stride_out, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr):
    dtype = h_ptr.dtype.element_ty
    a = _to_output(_activation(g, ACTIVATION), dtype, UPCAST).to(tl.float32)  # rounded as eager rounds act(g)
    tl.store(h_ptr + row * stride_out + cols, _to_output(a * u, dtype, UPCAST), mask=mask)


@triton.jit
def _gated_product_kernel(g_ptr, u_ptr, h_ptr, N, stride_in, stride_out, ACTIVATION: tl.constexpr,
                          UPCAST: tl.constexpr, BLOCK: tl.constexpr):
    row, cols, mask = _rows_cols(N, BLOCK)
    g = tl.load(g_ptr + row * stride_in + cols, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + row * stride_in + cols, mask=mask).to(tl.float32)
    _store_product(g, u, h_ptr, row, cols, mask, stride_out, ACTIVATION, UPCAST)


@triton.jit
def _gated_product_halves_kernel(gu_ptr, h_ptr, N, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr,
                                 BLOCK: tl.constexpr):
    """The product of the two halves of one contiguous (M, 2N) tensor, into a contiguous (M, N) one."""
    row, cols, mask = _rows_cols(N, BLOCK)
    g = tl.load(gu_ptr + row * 2 * N + cols, mask=mask).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * N + N + cols, mask=mask).to(tl.float32)
    _store_product(g, u, h_ptr, row, cols, mask, N, ACTIVATION, UPCAST)


@triton.jit
def _gated_product_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, stride_dh, stride_in, stride_out,
                                   ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, BLOCK: tl.constexpr,
                                   H_OVER_DH: tl.constexpr = False):
    """dg and du from dh, g and u; with ``H_OVER_DH`` also the product act(g) * u, as the forward rounds it, written
    over dh (each element read before it is written)."""
    row, cols, mask = _rows_cols(N, BLOCK)
    dh = tl.load(dh_ptr + row * stride_dh + cols, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + row * stride_in + cols, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + row * stride_in + cols, mask=mask).to(tl.float32)
    dtype = dg_ptr.dtype.element_ty
    a = _to_output(_activation(g, ACTIVATION), dtype, UPCAST).to(tl.float32)
    out = row * stride_out + cols
    tl.store(du_ptr + out, _to_output(dh * a, dtype, UPCAST), mask=mask)
    d_act = _to_output(dh * u, dtype, UPCAST).to(tl.float32)  # the product's gradient, rounded as eager's
    if ACTIVATION == "relu":  # as torch's threshold_backward: a select, so NaN gates pass and others give 0
        dg = tl.where(g <= 0.0, 0.0, d_act)
    else:
        dg = d_act * _activation_grad(g, ACTIVATION)
    tl.store(dg_ptr + out, _to_output(dg, dtype, UPCAST), mask=mask)
    if H_OVER_DH:
        tl.store(dh_ptr + row * stride_dh + cols, _to_output(a * u, dtype, UPCAST), mask=mask)


def _geometry(tensors, strided) -> tuple:
    """(rows, N, the row strides of ``strided``): one row of all elements where every tensor is contiguous,
    else the rows of 2-D tensors with unit column strides."""
    if all(t.is_contiguous() for t in tensors):
        return (1, tensors[0].numel()) + (0,) * len(strided)
    return (*tensors[0].shape, *(t.stride(0) for t in strided))


def _launcher(fn, tensors, geometry, activation: str, **extra) -> DirectLaunch:
    t = tensors[0]
    key = (fn, geometry, t.dtype, t.device, activation, tuple(x.data_ptr() % 16 == 0 for x in tensors),
           *extra.items())
    return _bound(key, fn, *geometry[:2], t.dtype, activation, **extra)


def _bound(key, fn, rows: int, N: int, dtype: torch.dtype, activation: str, **extra) -> DirectLaunch:
    """The launcher kept under ``key``: ``fn`` over rows of N elements, made on first use (``extra``: other
    constexpr arguments)."""
    launch = _launchers.get(key)
    if launch is None:
        if len(_launchers) >= _LAUNCHERS_MAX:
            _launchers.clear()
        upcast = interpreting() and dtype == torch.bfloat16
        launch = _launchers[key] = DirectLaunch(fn, (rows * triton.cdiv(N, BLOCK),), dict(
            ACTIVATION=activation, UPCAST=upcast, BLOCK=BLOCK, num_warps=NUM_WARPS, **extra))
    return launch


def gated_product(g: torch.Tensor, u: torch.Tensor, h: torch.Tensor, activation: str) -> None:
    """``h = act(g) * u`` for tensors of one size, dtype and device: all contiguous (``h`` may be ``g``), or
    2-D with unit column strides, ``g`` and ``u`` at one row stride (the halves of one (M, 2N) GEMM output)."""
    geometry = _geometry((g, u, h), (g, h))
    _launcher(_gated_product_kernel, (g, u, h), geometry, activation)((g, u, h, *geometry[1:]))


def halves_launcher(rows: int, N: int, dtype: torch.dtype, device: torch.device, activation: str):
    """A bound launch of ``h = act(gu[:, :N]) * gu[:, N:]`` for a contiguous (rows, 2N) ``gu`` and a contiguous
    (rows, N) ``h``, both 16-byte aligned (fresh allocations): call it as ``launch((gu, h, N))``."""
    fn = _gated_product_halves_kernel
    return _bound((fn, rows, N, dtype, device, activation), fn, rows, N, dtype, activation)


def gated_product_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, dg: torch.Tensor, du: torch.Tensor,
                           activation: str, h_over_dh: bool = False) -> None:
    """``dg = dh * u * act'(g)`` and ``du = dh * act(g)`` for tensors of one size, dtype and device: all
    contiguous, or 2-D with unit column strides, ``g`` and ``u`` at one row stride, ``dg`` and ``du`` at one
    (``dg`` may be ``g`` and ``du`` ``u``); with ``h_over_dh`` the product ``act(g) * u`` is written over ``dh``."""
    geometry = _geometry((dh, g, u, dg, du), (dh, g, dg))
    extra = {"H_OVER_DH": True} if h_over_dh else {}
    _launcher(_gated_product_backward_kernel, (dh, g, u, dg, du), geometry, activation, **extra)(
        (dh, g, u, dg, du, *geometry[1:]))


def clear_cache() -> None:
    _launchers.clear()
