"""The gated linear's arguments: their checks, the form the gated kernels take, and their casts under autocast
(packed weights cast as one tensor: :class:`PackedCast`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.layout import stacked
from ..dispatch import gated_cublas
from . import eager

GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
_is_compiling = torch.compiler.is_compiling


def check(x, w_gate, w_up, b_gate, b_up, activation) -> None:
    """Argument types and the activation (TypeError / ValueError); shapes, dtypes and devices are
    checked by :func:`kernel_shaped`, and where it says no, by F.linear itself."""
    for name, t in (("input", x), ("w_gate", w_gate), ("w_up", w_up)):
        eager.require_tensor(name, t, "gated_linear")
    for name, t in (("b_gate", b_gate), ("b_up", b_up)):
        if t is not None:
            eager.require_tensor(name, t, "gated_linear")
    if not isinstance(activation, str) or activation not in GATED_ACTIVATIONS:
        raise ValueError(f"tritonmm.gated_linear: unknown activation {activation!r}; expected one of {GATED_ACTIVATIONS}")


def kernel_shaped(x, w_gate, w_up, b_gate, b_up) -> bool:
    """Whether the call has the form the kernel takes: 2-D weights of one shape, K matching, both biases
    (N,) or neither, one dtype and one device, plain strided tensors. Other calls (valid ones such as
    1-D weights or broadcast biases, and invalid ones, which raise there) go to the torch expression."""
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or x.dim() == 0 or x.shape[-1] != w_gate.shape[1]:
        return False
    if (b_gate is None) != (b_up is None):
        return False
    tensors = (x, w_gate, w_up) if b_gate is None else (x, w_gate, w_up, b_gate, b_up)
    if b_gate is not None and (b_gate.dim() != 1 or b_gate.shape[0] != w_gate.shape[0] or b_up.shape != b_gate.shape):
        return False
    dtype, device = x.dtype, x.device
    if not all(t.dtype == dtype and t.device == device and t.layout is torch.strided for t in tensors):
        return False
    return _is_compiling() or not any(t.is_neg() or t._is_zerotensor() for t in tensors)  # (untraceable checks)


def autocast(x: Tensor, w_gate, w_up, b_gate, b_up):
    """The operands as F.linear casts them under ``torch.autocast``, cast on each call
    (:func:`tritonmm.ops.eager.cast`: torch's autocast reuses a leaf's cast within a region); packed weights cast as
    one tensor, whose halves stay packed, in eager calls (tracing cannot read where they lie)."""
    dtype = eager.autocast_dtype(x)
    if dtype is None:
        return x, w_gate, w_up, b_gate, b_up
    cast = eager.cast
    if b_gate is None and b_up is None and w_gate.is_floating_point() and w_gate.dtype not in (dtype, torch.float64) \
            and not _is_compiling() and gated_cublas.packed(w_gate, w_up) is not None:  # one cast, halves packed
        return (cast(x, dtype), *PackedCast.apply(w_gate, w_up, dtype), None, None)
    return cast(x, dtype), cast(w_gate, dtype), cast(w_up, dtype), cast(b_gate, dtype), cast(b_up, dtype)


class PackedCast(torch.autograd.Function):
    """Packed weights (:func:`stacked`) cast as one tensor, returned as its two halves (so that
    they stay packed: one GEMM); the gradients cast back, as autocast's casts are differentiated."""

    @staticmethod
    def forward(ctx, w_gate, w_up, dtype):
        ctx.dtype = w_gate.dtype  # (packed weights have one dtype)
        w = stacked((w_gate, w_up)).to(dtype)
        N = w_gate.shape[0]
        return w[:N], w[N:]

    @staticmethod
    def backward(ctx, d_gate, d_up):
        dtype = ctx.dtype
        d = stacked((d_gate, d_up)) if d_gate is not None and d_up is not None else None
        if d is not None:
            d = d.to(dtype)  # one cast
            N = d_gate.shape[0]
            return d[:N], d[N:], None
        return (None if d_gate is None else d_gate.to(dtype), None if d_up is None else d_up.to(dtype), None)
