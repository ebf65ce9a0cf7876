"""torch.library registration: ``tritonmm::matmul`` and ``tritonmm::linear``.

Each op has a real implementation (dispatch -> Triton kernel or torch), a fake (meta)
implementation for FakeTensor / torch.compile / torch.export, an autograd formula whose
GEMMs run through ``tritonmm.matmul`` again, and autocast rules (CUDA and CPU) that cast
floating inputs to the autocast dtype as torch.matmul / F.linear do. In eager mode the Python
API runs the same implementation and formulas as ``torch.autograd.Function`` subclasses
(``tritonmm/api.py``), skipping the dispatcher's Python layers.
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
    need_a, need_b = ctx.needs_input_grad[:2]
    # save only what the gradients read (dA needs B, dB needs A), as torch.matmul does; shapes always
    ctx.save_for_backward(a if need_b else None, b if need_a else None)
    ctx.shapes = (a.shape, b.shape)
    ctx.forced = dispatch._forced.get()  # backward runs on autograd's threads: carry force_backend over


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """A gradient GEMM through ``tritonmm.matmul``: the op itself under compile, tracing and tensor
    subclasses, the implementation directly in eager backward passes (no dispatcher layers)."""
    from .api import matmul

    return matmul(a, b)


def _rows(t: Tensor) -> int:
    """Number of rows of ``t`` seen as (prod(shape[:-1]), shape[-1]) (valid with zero-size dims too)."""
    n = 1
    for d in t.shape[:-1]:
        n *= d
    return n


def matmul_grads(grad: Tensor, a, b, need_a: bool, need_b: bool, shapes=None):
    """(dA, dB) of C = A @ B under torch.matmul's broadcasting: dA = dC @ B^H, dB = A^H @ dC.

    ``a`` may be None when only dA is needed and ``b`` None when only dB is (pass their
    ``shapes``). Broadcast batch dims are summed out; 1-D operands lose their unit dim again.
    The GEMMs run through ``tritonmm.matmul`` (the ``tritonmm::matmul`` op, or its implementation
    directly in eager mode), so stride-0 or non-contiguous ``grad``
    (from ``y.sum()``, ``torch.cat``) is read in place; complex operands are conjugated
    (``.mH``) as torch.matmul's gradients are.
    """
    mm = _mm
    a_shape, b_shape = shapes if shapes is not None else (a.shape, b.shape)
    a_dim, b_dim = len(a_shape), len(b_shape)
    if a_dim == 1 and b_dim == 1:  # dot product: grad is 0-d
        return (grad * b.conj() if need_a else None), (grad * a.conj() if need_b else None)
    a2_shape = (1, *a_shape) if a_dim == 1 else tuple(a_shape)
    b2 = None if b is None else (b.unsqueeze(-1) if b_dim == 1 else b)
    a2 = None if a is None else (a.unsqueeze(0) if a_dim == 1 else a)
    b2_shape = (*b_shape, 1) if b_dim == 1 else tuple(b_shape)
    g2 = grad.unsqueeze(-2) if a_dim == 1 else grad
    g2 = g2.unsqueeze(-1) if b_dim == 1 else g2
    da = db = None
    if need_a:
        da = mm(g2, b2.mH).sum_to_size(a2_shape)
        da = da.squeeze(0) if a_dim == 1 else da
    if need_b:
        if len(b2_shape) == 2 and g2.dim() > 2:  # fold the batch into one (K, B*M) @ (B*M, N) GEMM
            K, N = b2_shape
            ae = a2.expand(*g2.shape[:-2], *a2.shape[-2:])
            af = ae.reshape(_rows(ae), K)
            db = mm(af.mH, g2.reshape(_rows(g2), N))
        else:
            db = mm(a2.mH, g2).sum_to_size(b2_shape)
        db = db.squeeze(-1) if b_dim == 1 else db
    return da, db


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    with dispatch.forcing_as(ctx.forced):
        return matmul_grads(grad, a, b, ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.shapes)


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
    need_x, need_w = ctx.needs_input_grad[:2]
    recompute = activation in ("gelu", "gelu_tanh", "silu")  # z = x W^T + b is recomputed, not stored
    ctx.activation = activation
    ctx.forced = dispatch._forced.get()
    ctx.shapes = (x.shape, weight.shape, None if bias is None else bias.shape)
    ctx.save_for_backward(x if (need_w or recompute) else None, weight if (need_x or recompute) else None,
                          bias if recompute else None, output if activation == "relu" else None)


def _activation_backward(grad: Tensor, x, weight, bias, out, activation: str) -> Tensor:
    """dL/dz for y = act(z), z = x @ W^T + b; z is recomputed (one GEMM) for gelu and silu.

    Under ``create_graph`` (double backward) the formulas are built from differentiable ops.
    """
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, out, 0)
    from .api import linear

    z = linear(x, weight, bias, "none")
    if activation == "silu":
        if torch.is_grad_enabled():  # aten::silu_backward has no derivative of its own
            s = torch.sigmoid(z)
            return grad * s * (1 + z * (1 - s))
        return torch.ops.aten.silu_backward(grad, z)
    return torch.ops.aten.gelu_backward(grad, z, approximate="tanh" if activation == "gelu_tanh" else "none")


def _linear_backward(ctx, grad):
    with dispatch.forcing_as(ctx.forced):
        return _linear_grads(ctx, grad)


def _linear_grads(ctx, grad):
    x, weight, bias, out = ctx.saved_tensors
    x_shape, w_shape, bias_shape = ctx.shapes
    needs = tuple(ctx.needs_input_grad) + (False, False, False)  # may omit a None bias (AOT dispatch)
    need_x, need_w, need_b = needs[0], needs[1], bias_shape is not None and needs[2]
    gz = _activation_backward(grad, x, weight, bias, out, ctx.activation)
    N, K = w_shape
    dx = dw = db = None
    if need_x:
        dx = _mm(gz, weight.conj())
    if need_w or need_b:
        gz2 = gz.reshape(_rows(gz), N)
        if need_w:
            dw = _mm(gz2.mT, x.reshape(_rows(x), K).conj())
        if need_b:
            db = gz2.sum(0) if tuple(bias_shape) == (N,) else gz2.sum().reshape(bias_shape)
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
