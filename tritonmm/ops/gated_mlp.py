"""The fused gated MLP's training call: ``F.linear(act(x @ Wg^T) * (x @ Wu^T), Wd, bd)`` as autograd nodes on
packed gate and up weights (``[Wg; Wu]`` in one allocation, as :func:`tritonmm.fuse` arranges): the gate and up
projections as one GEMM into one (M, 2N) tensor [G | U] (:class:`_GateUp`, with :class:`_GateWeightGrad` for Wg's
gradient), then the product and the down projection (:class:`_Down`).

What it keeps for the backward: [G | U], next to x and the parameters that torch keeps too. Eager keeps four (M, N)
activations (the gate projection, its activation, the up projection and the product); the gated linear's autograd
(:mod:`tritonmm.ops.gated`) three. In the down node's backward, after the GEMM for the product's gradient dH, one
elementwise pass writes [dG | dU] over the saved [G | U] and the product, recomputed for dWd, over dH. The weights'
gradients come from three nodes, so that autograd accumulates each before the next is allocated, as it does for
eager's three ``nn.Linear`` layers: the backward holds the saved tensor and at most one (M, N) tensor and one
weight's gradient, or one weight's gradient and dx.

The forward is the gated linear's cuBLAS path (one GEMM on the packed weights, one Triton pass for the activation
and product) and the down GEMM; the backward's GEMMs run on cuBLAS. A second backward through the same graph
(``retain_graph=True``) recomputes [G | U] from x; one with ``create_graph=True`` differentiates the torch
expression, recomputed.

:func:`gated_mlp` serves plain eager calls with autograd (under ``torch.autocast`` too: the packed weights cast as one
tensor) on tensors the Triton passes take, from
:data:`tritonmm.dispatch.gated.PRODUCT_MIN_FLOPS` per projection; others return None, for the caller's other paths.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import activations, modes
from ..dispatch import gated_cublas
from ..dispatch.gated import GATED_MAX_M, below_product_flops
from . import eager, gated_grads
from .gated_args import PackedCast

_any_autocast = torch._C._is_any_autocast_enabled


def _product(gu: Tensor, N: int, activation: str) -> Tensor:
    h = gated_cublas._empty((gu.shape[0], N), dtype=gu.dtype, device=gu.device)  # (tests: NaN-filled)
    gated_cublas.product(gu[:, :N], gu[:, N:], h, activation)
    return h


_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``, checkpointing)
    are active: they may keep the saved tensors or give them back in another layout."""
    return _hooks is None or _hooks(False) is not None


def _gate_up(x2: Tensor, w_gate: Tensor, w_up: Tensor) -> Tensor:
    """[G | U] = x2 @ [Wg; Wu]^T as one GEMM (the weights stacked first where they no longer lie packed)."""
    w = gated_cublas.packed(w_gate, w_up)
    return torch.mm(x2, (w if w is not None else torch.cat([w_gate, w_up])).t())


class _GateUp(torch.autograd.Function):
    """[G | U] = x @ [Wg; Wu]^T as one (M, 2N) tensor. Saves, as torch would, x where Wu needs a gradient and the
    weights where x does; its backward takes [dG | dU] from :class:`_Down`'s (through :class:`_GateWeightGrad`,
    which gives Wg's gradient). Wg comes in detached where it needs a gradient (``gate``: itself, in a tuple, so
    not an input), so that its gradient is accumulated before this node runs; a backward with
    ``create_graph=True`` differentiates dx in ``gate``."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, gate):
        needs = ctx.needs_input_grad
        ctx.save_for_backward(x if needs[2] else None, *((w_gate, w_up) if needs[0] else (None, None)))
        ctx.x_shape, (ctx.gate,) = x.shape, gate
        return _gate_up(x.reshape(x.shape[:-1].numel(), x.shape[-1]), w_gate, w_up)

    @staticmethod
    def backward(ctx, dgu):
        x, w_gate, w_up = ctx.saved_tensors  # (unpacking checks Wg's version: its detached copy shares it)
        needs, N = ctx.needs_input_grad, dgu.shape[1] // 2
        dg, du = dgu[:, :N], dgu[:, N:]
        dwu = du.t() @ x.reshape(dgu.shape[0], ctx.x_shape[-1]) if needs[2] else None
        dx = None
        if needs[0]:  # (as one GEMM on [Wg; Wu] its K is 2N: slower than these two)
            if torch.is_grad_enabled():
                w_gate = ctx.gate
            dx = (dg @ w_gate).addmm_(du, w_up).view(ctx.x_shape)  # in place: addmm would copy its first operand
        return dx, None, dwu, None


class _GateWeightGrad(torch.autograd.Function):
    """[G | U] as it is, in a node of its own whose backward gives Wg's gradient: autograd accumulates it before
    :class:`_GateUp`'s backward allocates Wu's, as it does for two ``nn.Linear`` layers (one weight's gradient at a
    time rather than both)."""

    @staticmethod
    def forward(ctx, gu, x, w_gate):
        ctx.save_for_backward(x)
        return gu.view_as(gu)

    @staticmethod
    def backward(ctx, dgu):
        x, = ctx.saved_tensors
        dg = dgu[:, :dgu.shape[1] // 2]
        return dgu, None, dg.t() @ x.reshape(dgu.shape[0], x.shape[-1])


def _down_expression(gu, w_down, b_down, activation):
    N = gu.shape[1] // 2
    return F.linear(activations.apply(gu[:, :N], activation) * gu[:, N:], w_down, b_down)


class _Down(torch.autograd.Function):
    """F.linear(act(G) * U, Wd, bd) from [G | U]. Saves [G | U] and, where [G | U] needs a gradient, Wd; bd and a
    frozen Wd are kept with their versions for a backward that recomputes (``create_graph=True``, batched
    gradients), and x, Wg, Wu for a second backward, which recomputes [G | U]: the first writes [dG | dU] over it.
    Its own node, so that autograd accumulates dWd before the gate and up weights' gradients are allocated."""

    @staticmethod
    def forward(ctx, gu, w_down, b_down, activation, gate_up_inputs):
        y = F.linear(_product(gu, gu.shape[1] // 2, activation), w_down, b_down)
        keep = ctx.needs_input_grad[0]
        ctx.save_for_backward(gu, w_down if keep else None)
        ctx.others = (None, None if keep else gated_grads.kept(w_down), gated_grads.kept(b_down))
        ctx.gate_up = tuple(map(gated_grads.kept, gate_up_inputs)) if keep else None
        ctx.activation, ctx.consumed = activation, False
        ctx.in_place = not _saved_tensor_hooks()  # (hooks may hold the saved tensor: it must stay as it was)
        return y

    @staticmethod
    def backward(ctx, dy):
        gu, w_down = ctx.saved_tensors
        needs, activation = tuple(ctx.needs_input_grad[:3]), ctx.activation
        if ctx.consumed:  # a second backward: the first wrote [dG | dU] over the saved projections
            x, w_gate, w_up = gated_grads.unmodified(ctx.gate_up, (None,) * 3)
            x2 = x.reshape(gu.shape[0], x.shape[-1])  # (with create_graph=True, differentiable in x, Wg and Wu)
            gu = x2 @ torch.cat([w_gate, w_up]).t() if torch.is_grad_enabled() else _gate_up(x2, w_gate, w_up)
        if torch.is_grad_enabled() or modes.torch_only(dy):
            # create_graph=True, or batched gradients: the torch expression, recomputed and differentiated
            if needs[0] and not gu.requires_grad:  # (recomputed for batched gradients)
                gu = gu.requires_grad_()
            return (*gated_grads.differentiate(lambda *t: _down_expression(*t, activation),
                                               gated_grads.unmodified(ctx.others, (gu, w_down, None)), dy, needs,
                                               create_graph=torch.is_grad_enabled()), None, None)
        if not gu.is_contiguous():  # (given back by a hook in another layout)
            gu = gu.contiguous()
        N = gu.shape[1] // 2
        dgu = dwd = dbd = None
        if needs[2]:
            dbd = dy.sum(0)
        if needs[0]:
            dh = dy @ w_down
            dgu = gu if ctx.in_place else torch.empty_like(gu)
            gated_cublas.grads_into(dh, gu[:, :N], gu[:, N:], activation, dgu[:, :N], dgu[:, N:])
            ctx.consumed = dgu is gu  # [dG | dU] over [G | U]; the product over dh
            if needs[1]:
                dwd = dy.t() @ dh
        elif needs[1]:
            dwd = dy.t() @ _product(gu, N, activation)
        return dgu, dwd, dbd, None, None


def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, b_down: Optional[Tensor],
              activation: str) -> Optional[Tensor]:
    """``F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), w_down, b_down)`` through the autograd nodes above
    where it serves the call: autograd needed, plain eager mode, plain tensors of one dtype the Triton passes take
    (under ``torch.autocast``, once cast as F.linear casts them), packed gate and up weights, more than
    ``GATED_MAX_M`` rows and at least ``PRODUCT_MIN_FLOPS`` per projection. Else None (nothing run): the caller
    serves the call."""
    if not (x.requires_grad or w_gate.requires_grad or w_up.requires_grad or w_down.requires_grad
            or b_down is not None and b_down.requires_grad):
        return None
    tensors = (x, w_gate, w_up, w_down, b_down)
    if not modes.eager() or modes.torch_only(*tensors) or not modes.plain(*tensors):
        return None
    if x.dim() < 1 or w_gate.dim() != 2 or w_down.dim() != 2 or x.shape[-1] != w_gate.shape[1] \
            or w_down.shape[1] != w_gate.shape[0] or b_down is not None and b_down.shape != (w_down.shape[0],):
        return None  # (F.linear's errors: the caller's paths)
    if gated_cublas.packed(w_gate, w_up) is None or x.numel() // max(x.shape[-1], 1) <= GATED_MAX_M \
            or below_product_flops(x, w_gate, True, w_up):
        return None
    autocast = eager.autocast_dtype(x) if _any_autocast() else None
    if autocast is not None and any(t is not None and (not t.is_floating_point() or t.dtype == torch.float64)
                                    for t in tensors):  # (autocast leaves float64 as it is)
        return None
    dtype = x.dtype if autocast is None else autocast
    if dtype not in gated_cublas.KERNEL_DTYPES or not gated_cublas.serves(x) or any(
            t is not None and (t.device != x.device or autocast is None and t.dtype != dtype) for t in tensors):
        return None  # (promotions, F.linear's errors: the caller's paths)
    if autocast is not None:  # cast as F.linear is under autocast; the packed weights as one tensor, still packed
        x, w_down, b_down = eager.cast(x, dtype), eager.cast(w_down, dtype), eager.cast(b_down, dtype)
        if w_gate.dtype != dtype:
            w_gate, w_up = PackedCast.apply(w_gate, w_up, dtype)
    with torch._C._ExcludeDispatchKeyGuard(eager.AUTOCAST_KEYS) if autocast is not None \
            else contextlib.nullcontext():  # (cast already)
        gate_up = (x, w_gate, w_up)
        if any(t.requires_grad for t in gate_up):
            if w_gate.requires_grad:
                gu = _GateWeightGrad.apply(_GateUp.apply(x, w_gate.detach(), w_up, (w_gate,)), x, w_gate)
            else:
                gu = _GateUp.apply(x, w_gate, w_up, (w_gate,))
        else:
            gu = _gate_up(x.reshape(-1, x.shape[-1]), w_gate, w_up)
        y = _Down.apply(gu, w_down, b_down, activation, gate_up)
    return y.view(*x.shape[:-1], w_down.shape[0])
