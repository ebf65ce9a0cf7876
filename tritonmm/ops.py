"""torch.library registration: ``tritonmm::matmul`` and ``tritonmm::linear``.

Each op has a real implementation (dispatch -> Triton kernel or torch), a fake (meta)
implementation for FakeTensor / torch.compile / torch.export, an autograd formula whose
GEMMs run through ``tritonmm::matmul`` again, and autocast rules (CUDA and CPU) that cast
floating inputs to the autocast dtype as torch.matmul / F.linear do.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch, engine, shapes
from .activations import ACTIVATIONS



# --------------------------------------------------------------------------- matmul


@torch.library.custom_op("tritonmm::matmul", mutates_args=())
def _matmul_op(a: Tensor, b: Tensor) -> Tensor:
    return engine.matmul(a, b)


@_matmul_op.register_fake
def _matmul_fake(a: Tensor, b: Tensor) -> Tensor:
    shapes.check_inputs(a, b)
    return a.new_empty(shapes.output_shape(a, b))


def _matmul_setup_context(ctx, inputs, output):
    a, b = inputs
    ctx.save_for_backward(a, b)
    ctx.forced = dispatch._forced.get()  # backward runs on autograd's threads: carry force_backend over


def matmul_grads(grad: Tensor, a: Tensor, b: Tensor, need_a: bool, need_b: bool):
    """(dA, dB) of C = A @ B under torch.matmul's broadcasting: dA = dC @ B^T, dB = A^T @ dC.

    Broadcast batch dims are summed out; 1-D operands lose their unit dim again. The
    GEMMs run through ``tritonmm::matmul``, so stride-0 or non-contiguous ``grad``
    (from ``y.sum()``, ``torch.cat``) is read in place.
    """
    mm = torch.ops.tritonmm.matmul
    if a.dim() == 1 and b.dim() == 1:  # dot product: grad is 0-d
        return (grad * b if need_a else None), (grad * a if need_b else None)
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    g2 = grad.unsqueeze(-2) if a.dim() == 1 else grad
    g2 = g2.unsqueeze(-1) if b.dim() == 1 else g2
    da = db = None
    if need_a:
        da = mm(g2, b2.mT).sum_to_size(a2.shape)
        da = da.squeeze(0) if a.dim() == 1 else da
    if need_b:
        if b2.dim() == 2 and g2.dim() > 2:  # fold the batch into one (K, B*M) @ (B*M, N) GEMM
            K, N = b2.shape
            af = a2.expand(*g2.shape[:-2], *a2.shape[-2:]).reshape(-1, K)
            db = mm(af.mT, g2.reshape(-1, N))
        else:
            db = mm(a2.mT, g2).sum_to_size(b2.shape)
        db = db.squeeze(-1) if b.dim() == 1 else db
    return da, db


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    with dispatch.forcing_as(ctx.forced):
        return matmul_grads(grad, a, b, ctx.needs_input_grad[0], ctx.needs_input_grad[1])


_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


# --------------------------------------------------------------------------- linear


def check_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> None:
    """Raise as F.linear does (plus an unknown activation).

    Raises:
        TypeError: x or weight is not a Tensor.
        ValueError: ``activation`` is not one of :data:`ACTIVATIONS`.
        RuntimeError: devices or dtypes differ, x is 0-D, weight is not 2-D, or sizes mismatch.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"tritonmm.linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"tritonmm.linear: argument 'weight' must be Tensor, not {type(weight).__name__}")
    if weight.dim() != 2:
        raise RuntimeError(f"tritonmm.linear: weight must be 2-D (out_features, in_features), got {tuple(weight.shape)}")
    shapes.check_inputs(x, weight.t(), op="linear")
    if bias is not None:
        if bias.device != x.device or bias.dtype != x.dtype:
            raise RuntimeError(
                f"tritonmm.linear: bias ({bias.dtype}, {bias.device}) must match input ({x.dtype}, {x.device})"
            )
        if tuple(bias.shape) not in ((), (1,), (weight.shape[0],)):
            raise RuntimeError(
                f"tritonmm.linear: bias of shape {tuple(bias.shape)} does not match out_features {weight.shape[0]}"
            )


@torch.library.custom_op("tritonmm::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    return engine.linear(x, weight, bias, activation)


@_linear_op.register_fake
def _linear_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    check_linear(x, weight, bias, activation)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, activation = inputs
    ctx.activation = activation
    ctx.forced = dispatch._forced.get()
    ctx.save_for_backward(x, weight, bias, output if activation == "relu" else None)


def _activation_backward(grad: Tensor, x, weight, bias, out, activation: str) -> Tensor:
    """dL/dz for y = act(z), z = x @ W^T + b; z is recomputed (one GEMM) for gelu and silu."""
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, out, 0)
    z = torch.ops.tritonmm.linear(x, weight, bias, "none")
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, z)
    return torch.ops.aten.gelu_backward(grad, z, approximate="tanh" if activation == "gelu_tanh" else "none")


def _linear_backward(ctx, grad):
    with dispatch.forcing_as(ctx.forced):
        return _linear_grads(ctx, grad)


def _linear_grads(ctx, grad):
    x, weight, bias, out = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad) + (False, False, False)  # may omit a None bias (AOT dispatch)
    need_x, need_w, need_b = needs[0], needs[1], bias is not None and needs[2]
    gz = _activation_backward(grad, x, weight, bias, out, ctx.activation)
    N, K = weight.shape
    dx = dw = db = None
    if need_x:
        dx = torch.ops.tritonmm.matmul(gz, weight)
    if need_w or need_b:
        gz2 = gz.reshape(-1, N)
        if need_w:
            dw = torch.ops.tritonmm.matmul(gz2.mT, x.reshape(-1, K))
        if need_b:
            db = gz2.sum(0).reshape(bias.shape)
    return dx, dw, db, None


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# --------------------------------------------------------------------------- autocast

_autocast_lib = torch.library.Library("tritonmm", "IMPL")


def _autocast_cast(x, dtype):
    if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(dtype)
    return x


def _register_autocast(name: str) -> None:
    """Cast floating inputs (not float64) to the current autocast dtype, as torch does for matmul/linear."""
    op = getattr(torch.ops.tritonmm, name).default
    for device_type, key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
        dispatch_key = getattr(torch._C.DispatchKey, key)

        def kernel(keyset, *args, _device_type=device_type, _key=dispatch_key):
            dtype = torch.get_autocast_dtype(_device_type)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*(_autocast_cast(x, dtype) for x in args))

        _autocast_lib.impl(name, kernel, key, with_keyset=True)


_register_autocast("matmul")
_register_autocast("linear")
