"""The fused gated MLP's training call: ``F.linear(act(x @ Wg^T) * (x @ Wu^T), Wd, bd)`` as one autograd Function
on packed gate and up weights (``[Wg; Wu]`` in one allocation, as :func:`tritonmm.fuse` arranges).

What it keeps for the backward: the two projections as one (M, 2N) tensor, next to x and the parameters that
torch keeps too. Eager keeps four (M, N) activations (the gate projection, its activation, the up projection and
the product); the gated linear's autograd (:mod:`tritonmm.ops.gated`) three. In the backward, after the GEMM for
the product's gradient dH, one elementwise pass writes both projections' gradients over the saved projections and
the product, recomputed for the down weight's gradient, over dH: the backward holds the saved tensor and one (M, N)
tensor besides.

The forward is the gated linear's cuBLAS path (one GEMM on the packed weights, one Triton pass for the activation
and product) and the down GEMM; the backward's GEMMs run on cuBLAS. A second backward through the same graph
(``retain_graph=True``) recomputes the projections from x; one with ``create_graph=True`` differentiates the torch
expression, recomputed.

:func:`gated_mlp` serves plain eager calls with autograd (under ``torch.autocast`` too: the packed weights cast as one
tensor) on tensors the Triton passes take, from
:data:`tritonmm.dispatch.gated.PRODUCT_MIN_FLOPS` per projection; others return None, for the caller's other paths.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import modes
from ..dispatch import gated_cublas
from ..dispatch.gated import GATED_MAX_M, below_product_flops
from . import eager, gated_grads
from .gated_args import PackedCast

_any_autocast = torch._C._is_any_autocast_enabled


def _expression(x, w_gate, w_up, w_down, b_down, activation):
    return F.linear(gated_grads._expression(x, w_gate, w_up, None, None, activation), w_down, b_down)


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


class _GatedMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) in eager mode with autograd. Saves [G | U] and, as torch would, x where a weight
    of gate or up needs a gradient, those weights where x does, the down weight where any of them does; the other
    inputs are kept with their versions for a second backward that recomputes [G | U] and for one with
    ``create_graph=True``."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_down, activation):
        M, K, N = x.shape[:-1].numel(), x.shape[-1], w_gate.shape[0]
        gu = _gate_up(x.reshape(M, K), w_gate, w_up)
        y = F.linear(_product(gu, N, activation), w_down, b_down)
        needs = ctx.needs_input_grad
        keep = (needs[1] or needs[2], needs[0], needs[0], needs[0] or needs[1] or needs[2], False)
        inputs = (x, w_gate, w_up, w_down, b_down)
        ctx.save_for_backward(*(t if k else None for t, k in zip(inputs, keep)), gu)
        ctx.others = tuple(None if k or t is None else (t, None if t.is_inference() else t._version)
                           for t, k in zip(inputs, keep))
        ctx.activation, ctx.consumed, ctx.x_shape = activation, False, x.shape
        ctx.in_place = not _saved_tensor_hooks()  # (hooks may hold the saved tensor: it must stay as it was)
        return y.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy):
        *saved, gu = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:5])
        activation = ctx.activation
        if torch.is_grad_enabled() or modes.torch_only(dy):
            # create_graph=True, or batched gradients: the torch expression, recomputed and differentiated
            return (*gated_grads.differentiate(lambda *t: _expression(*t, activation),
                                               gated_grads.recompute_inputs(ctx, saved), dy, needs,
                                               create_graph=torch.is_grad_enabled()), None)
        x, w_gate, w_up, w_down, _ = saved
        M, N = gu.shape[0], gu.shape[1] // 2
        K = ctx.x_shape[-1]
        dy2 = dy.reshape(M, dy.shape[-1])
        if ctx.consumed:  # a second backward: the first wrote the gradients over the saved projections
            x, w_gate, w_up, w_down, _ = gated_grads.recompute_inputs(ctx, saved)
            gu = _gate_up(x.reshape(M, K), w_gate, w_up)
        elif not gu.is_contiguous():  # (given back by a hook in another layout)
            gu = gu.contiguous()
        dx = dwg = dwu = dwd = dbd = None
        if needs[4]:
            dbd = dy2.sum(0)
        if needs[0] or needs[1] or needs[2]:
            dh = dy2 @ w_down
            dgu = gu if ctx.in_place else torch.empty_like(gu)
            gated_cublas.grads_into(dh, gu[:, :N], gu[:, N:], activation, dgu[:, :N], dgu[:, N:])
            if dgu is gu:  # [dG | dU] over [G | U]; the product over dh
                ctx.consumed = True
            if needs[3]:
                dwd = dy2.t() @ dh
            del dh, gu
            dg, du = dgu[:, :N], dgu[:, N:]
            if needs[0]:  # (as one GEMM on [Wg; Wu] its K is 2N: slower than these two)
                dx = (dg @ w_gate).addmm_(du, w_up).view(ctx.x_shape)
            if needs[1] or needs[2]:
                dw = dgu.t() @ x.reshape(M, K)  # both weights' gradients, the halves of one GEMM
                dwg, dwu = (dw[:N] if needs[1] else None), (dw[N:] if needs[2] else None)
        elif needs[3]:
            dwd = dy2.t() @ _product(gu, N, activation)
        return dx, dwg, dwu, dwd, dbd, None


def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, b_down: Optional[Tensor],
              activation: str) -> Optional[Tensor]:
    """``F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), w_down, b_down)`` through :class:`_GatedMLPFunction`
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
    if autocast is not None:
        with torch._C._ExcludeDispatchKeyGuard(eager.AUTOCAST_KEYS):  # (cast already)
            return _GatedMLPFunction.apply(x, w_gate, w_up, w_down, b_down, activation)
    return _GatedMLPFunction.apply(x, w_gate, w_up, w_down, b_down, activation)
