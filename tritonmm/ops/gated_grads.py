"""The gated linear's backward (:mod:`tritonmm.ops.gated`): what its autograd saves, and the gradients.

The forward saves what torch saves for its expression, plus the two projections; the backward computes
both projections' gradients in one pass (:func:`tritonmm.dispatch.gated_cublas.grads`) and runs its GEMMs on
cuBLAS (where the forward ran packed weights as one GEMM, both weights' gradients as one GEMM too: they are
then the two halves of one tensor). A backward with ``create_graph=True`` recomputes the torch expression
and differentiates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import activations
from ..dispatch import gated_cublas


def _expression(x, w_gate, w_up, b_gate, b_up, activation):
    return activations.apply(F.linear(x, w_gate, b_gate), activation) * F.linear(x, w_up, b_up)


def backward(grad_h: Tensor, x_shape, x, w_gate, w_up, g: Tensor, u: Tensor, activation: str, needs: tuple):
    """Gradients for (x, w_gate, w_up, b_gate, b_up) from the saved projections ``g``, ``u`` (M, N);
    None where ``needs`` (five bools) says none is wanted. ``x`` is needed only for the weights'
    gradients, the weights only for the input's (None otherwise), as torch saves them."""
    N, K = g.shape[-1], x_shape[-1]
    d_gate, d_up, both = gated_cublas.grads(grad_h.reshape(g.shape), g, u, activation, needs)  # (-1: N may be 0)
    dx = dwg = dwu = dbg = dbu = None
    if needs[0]:  # (as one GEMM on [Wg; Wu] its K is 2N: slower than these two)
        dx = (d_gate @ w_gate).addmm_(d_up, w_up).view(x_shape)  # in place: addmm would copy its first operand
    if needs[1] or needs[2]:
        x2 = x.reshape(g.shape[0], K)
        if both is not None and needs[1] and needs[2]:  # [d_gate, d_up]^T @ x: one GEMM, the gradients its halves
            dw = both.t() @ x2
            dwg, dwu = dw[:N], dw[N:]
        else:
            dwg = d_gate.t() @ x2 if needs[1] else None
            dwu = d_up.t() @ x2 if needs[2] else None
    if needs[3]:
        dbg = d_gate.sum(0)
    if needs[4]:
        dbu = d_up.sum(0)
    return dx, dwg, dwu, dbg, dbu


def differentiate(expression, inputs: tuple, grad, needs, create_graph: bool = True) -> tuple:
    """The gradients of ``expression(*inputs)`` against ``grad`` for the inputs ``needs`` marks (None for the others),
    the expression recomputed with autograd on: torch's own backward, for what the kernels' backward does not serve."""
    wanted = [t for t, n in zip(inputs, needs) if n]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(expression(*inputs), wanted, grad, create_graph=create_graph,
                                         allow_unused=True))
    return tuple(next(grads) if n else None for n in needs)


def graph_backward(grad_h, x, w_gate, w_up, b_gate, b_up, activation, needs):
    """The gradients as a differentiable graph (backward with ``create_graph=True``: double backward,
    gradient penalties): the torch expression recomputed and differentiated."""
    return differentiate(lambda *t: _expression(*t, activation), (x, w_gate, w_up, b_gate, b_up), grad_h, needs)


def save(ctx, x, w_gate, w_up, b_gate, b_up, g, u) -> None:
    """Save what the backward needs, as torch would for its expression (x for the weights' gradients, the
    weights for the input's, the projections; never the biases), so inputs it does not need may change in
    place before the backward, as with torch's. The other inputs are kept with their versions for a backward
    with ``create_graph=True``, which recomputes the expression (x is the only one that is not a parameter in
    a model: kept where the weights are frozen, it is smaller than the activation eager saves in its place)."""
    needs = ctx.needs_input_grad
    keep = (needs[1] or needs[2], needs[0], needs[0], False, False)
    inputs = (x, w_gate, w_up, b_gate, b_up)
    ctx.save_for_backward(*(t if k else None for t, k in zip(inputs, keep)), g, u)
    ctx.x_shape = x.shape
    ctx.others = tuple(None if k else kept(t) for t, k in zip(inputs, keep))


def recompute_inputs(ctx, saved) -> tuple:
    """The five inputs for :func:`graph_backward`: the saved ones, and the others unless modified in place."""
    return unmodified(getattr(ctx, "others", (None,) * 5), saved)  # (the op saves every input)


def kept(t):
    """``t`` with its version, for :func:`unmodified` (None for inference tensors, which have no version counter)."""
    return None if t is None else (t, None if t.is_inference() else t._version)


def unmodified(others, saved) -> tuple:
    """``saved``, with each None replaced by the tensor ``others`` keeps in its place, ``(tensor, version)`` (version
    None for inference tensors): RuntimeError where one was modified in place since."""
    out = []
    for t, other in zip(saved, others):
        if other is not None:
            t = other[0]
            if other[1] is not None and t._version != other[1]:
                raise RuntimeError("tritonmm: a backward that recomputes the forward (with create_graph=True, of "
                                   "batched gradients, or a fused MLP's second backward) needs its inputs, and one of "
                                   "them was modified by an inplace operation since the forward")
        out.append(t)
    return tuple(out)


def saved_backward(ctx, grad_h):
    *saved, g, u = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[:5])
    if torch.is_grad_enabled():  # create_graph=True
        return graph_backward(grad_h, *recompute_inputs(ctx, saved), ctx.activation, needs)
    return backward(grad_h, ctx.x_shape, saved[0], saved[1], saved[2], g, u, ctx.activation, needs)
