"""Gradient formulas of ``tritonmm::matmul`` and ``tritonmm::linear``; their GEMMs run through tritonmm.

Used by the ops' registered autograd (:mod:`tritonmm.ops.library`) and by the eager
``torch.autograd.Function`` classes of :mod:`tritonmm.ops.eager`: one set of formulas for both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core import activations, modes, shapes
from ..dispatch import decide, runners


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """A gradient GEMM: the runner directly for plain eager tensors without autograd (a usual backward
    pass), else the ``tritonmm::matmul`` op (double backward, compile, tensor subclasses, modes), or
    torch.matmul itself for the calls only torch serves (:func:`modes.torch_only`)."""
    if modes.torch_only(a, b):
        return torch.matmul(a, b)
    if not torch.is_grad_enabled() and modes.plain(a, b) and modes.eager():
        return runners.matmul(a, b)
    return torch.ops.tritonmm.matmul(a, b)


def _linear(x: Tensor, weight: Tensor, bias) -> Tensor:
    """F.linear through tritonmm (the recomputation of z = x W^T + b), as :func:`_mm` chooses."""
    if modes.torch_only(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    if not torch.is_grad_enabled() and modes.plain(x, weight, bias) and modes.eager():
        return runners.linear(x, weight, bias, "none")
    return torch.ops.tritonmm.linear(x, weight, bias, "none")


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
    Stride-0 or non-contiguous ``grad`` (from ``y.sum()``, ``torch.cat``) is read in place;
    complex operands are conjugated (``.mH``) as torch.matmul's gradients are.
    """
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
        da = _mm(g2, b2.mH).sum_to_size(a2_shape)
        da = da.squeeze(0) if a_dim == 1 else da
    if need_b:
        if len(b2_shape) == 2 and g2.dim() > 2:  # fold the batch into one (K, B*M) @ (B*M, N) GEMM
            K, N = b2_shape
            ae = a2.expand(*g2.shape[:-2], *a2.shape[-2:])
            af = ae.reshape(_rows(ae), K)
            db = _mm(af.mH, g2.reshape(_rows(g2), N))
        else:
            db = _mm(a2.mH, g2).sum_to_size(b2_shape)
        db = db.squeeze(-1) if b_dim == 1 else db
    return da, db


def matmul_setup_context(ctx, inputs, output):
    a, b = inputs
    need_a, need_b = ctx.needs_input_grad[:2]
    # save only what the gradients read (dA needs B, dB needs A), as torch.matmul does; shapes always
    ctx.save_for_backward(a if need_b else None, b if need_a else None)
    ctx.shapes = (a.shape, b.shape)
    ctx.forced = decide._forced.get()  # backward runs on autograd's threads: carry force_backend over


def matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    with decide.forcing_as(ctx.forced):
        return matmul_grads(grad, a, b, ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.shapes)


RECOMPUTE = ("gelu", "gelu_tanh", "silu")
"""Activations whose backward recomputes z = x W^T + b (one GEMM) instead of saving it."""


def linear_setup_context(ctx, inputs, output):
    x, weight, bias, activation = inputs
    need_x, need_w = ctx.needs_input_grad[:2]
    recompute = activation in RECOMPUTE
    ctx.activation = activation
    ctx.forced = decide._forced.get()
    ctx.shapes = (x.shape, weight.shape, None if bias is None else bias.shape)
    if bias is not None and bias.dim() > 1:  # a broadcast bias: F.linear served it; its backward differentiates it
        ctx.save_for_backward(x, weight, bias, None)
        return
    ctx.save_for_backward(x if (need_w or recompute) else None, weight if (need_x or recompute) else None,
                          bias if recompute else None, output if activation == "relu" else None)


def activation_backward(grad: Tensor, x, weight, bias, out, activation: str) -> Tensor:
    """dL/dz for y = act(z), z = x @ W^T + b; z is recomputed (one GEMM) for gelu and silu.

    Under ``create_graph`` (double backward) the formulas are built from differentiable ops.
    """
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, out, 0)
    z = _linear(x, weight, bias)
    if activation == "silu":
        if torch.is_grad_enabled():  # aten::silu_backward has no derivative of its own
            s = torch.sigmoid(z)
            return grad * s * (1 + z * (1 - s))
        return torch.ops.aten.silu_backward(grad, z)
    return torch.ops.aten.gelu_backward(grad, z, approximate="tanh" if activation == "gelu_tanh" else "none")


def _torch_form_grads(x, weight, bias, grad, activation: str, needs) -> tuple:
    """The gradients of a call that F.linear served (:func:`shapes.torch_form`): its expression differentiated
    by torch (a graph of its own under ``create_graph``)."""
    create = torch.is_grad_enabled()  # create_graph: differentiate through the saved inputs themselves
    inputs = [t if create or t is None else t.detach().requires_grad_(n) for t, n in zip((x, weight, bias), needs)]
    wanted = [t for t, n in zip(inputs, needs) if n]
    with torch.enable_grad():
        out = activations.apply(torch.nn.functional.linear(*inputs), activation)
    got = iter(torch.autograd.grad(out, wanted, grad, create_graph=create) if wanted else ())
    return (*(next(got) if n else None for n in needs), None)


def op_linear_setup_context(ctx, inputs, output):
    """:func:`linear_setup_context` for the op, which also meets the other forms F.linear serves
    (:func:`shapes.torch_form`; the eager autograd Function meets broadcast biases only)."""
    x, weight, bias, activation = inputs
    ctx.torch_form = shapes.torch_form(x, weight, bias)
    if ctx.torch_form:
        ctx.activation = activation
        ctx.save_for_backward(x, weight, bias, None)
        return
    linear_setup_context(ctx, inputs, output)


def op_linear_backward(ctx, grad):
    if ctx.torch_form:
        x, weight, bias, _ = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad) + (False, False, False)  # may omit a None bias (AOT dispatch)
        return _torch_form_grads(x, weight, bias, grad, ctx.activation, needs[:3])
    return linear_backward(ctx, grad)


def linear_backward(ctx, grad):
    with decide.forcing_as(ctx.forced):
        return _linear_grads(ctx, grad)


def _linear_grads(ctx, grad):
    x, weight, bias, out = ctx.saved_tensors
    x_shape, w_shape, bias_shape = ctx.shapes
    needs = tuple(ctx.needs_input_grad) + (False, False, False)  # may omit a None bias (AOT dispatch)
    if bias_shape is not None and len(bias_shape) > 1:
        return _torch_form_grads(x, weight, bias, grad, ctx.activation, needs[:3])
    need_x, need_w, need_b = needs[0], needs[1], bias_shape is not None and needs[2]
    gz = activation_backward(grad, x, weight, bias, out, ctx.activation)
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
