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

from ..core import activations, modes
from ..dispatch import gated_cublas
from ..dispatch.gated import GATED_MAX_M, below_product_flops
from . import eager
from .gated_args import PackedCast

_any_autocast = torch._C._is_any_autocast_enabled


def _expression(x, w_gate, w_up, w_down, b_down, activation):
    return F.linear(activations.apply(F.linear(x, w_gate), activation) * F.linear(x, w_up), w_down, b_down)


def _product(gu: Tensor, N: int, activation: str) -> Tensor:
    h = gated_cublas._empty((gu.shape[0], N), dtype=gu.dtype, device=gu.device)  # (tests: NaN-filled)
    gated_cublas.product(gu[:, :N], gu[:, N:], h, activation)
    return h


class _GatedMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) in eager mode with autograd; saves x, the weights and [G | U]."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_down, activation):
        M, K, N = x.shape[:-1].numel(), x.shape[-1], w_gate.shape[0]
        gu = torch.mm(x.reshape(M, K), gated_cublas.packed(w_gate, w_up).t())
        y = F.linear(_product(gu, N, activation), w_down, b_down)
        ctx.save_for_backward(x, w_gate, w_up, w_down, b_down, gu)
        ctx.activation, ctx.consumed = activation, False
        return y.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, b_down, gu = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        activation = ctx.activation
        if torch.is_grad_enabled():  # create_graph=True: the torch expression, recomputed and differentiated
            inputs = (x, w_gate, w_up, w_down, b_down)
            wanted = [t for t, n in zip(inputs, needs) if n]
            with torch.enable_grad():
                grads = iter(torch.autograd.grad(_expression(*inputs, activation), wanted, dy, create_graph=True,
                                                 allow_unused=True))
            return (*(next(grads) if n else None for n in needs), None)
        M, K, N = gu.shape[0], x.shape[-1], w_gate.shape[0]
        x2, dy2 = x.reshape(M, K), dy.reshape(M, w_down.shape[0])
        if ctx.consumed:  # a second backward: the first wrote the gradients over the saved projections
            gu = torch.mm(x2, gated_cublas.packed(w_gate, w_up).t())
        dx = dwg = dwu = dwd = dbd = None
        if needs[4]:
            dbd = dy2.sum(0)
        if needs[0] or needs[1] or needs[2]:
            dh = dy2 @ w_down
            g, u = gu[:, :N], gu[:, N:]
            gated_cublas.grads_into(dh, g, u, activation)  # [dG | dU] over [G | U], the product over dh
            ctx.consumed = True
            if needs[3]:
                dwd = dy2.t() @ dh
            del dh
            if needs[0]:  # (as one GEMM on [Wg; Wu] its K is 2N: slower than these two)
                dx = (g @ w_gate).addmm_(u, w_up).view(x.shape)
            if needs[1] or needs[2]:
                dw = gu.t() @ x2  # both weights' gradients, the halves of one GEMM
                dwg, dwu = (dw[:N] if needs[1] else None), (dw[N:] if needs[2] else None)
        elif needs[3]:
            dwd = dy2.t() @ _product(gu, N, activation)
        return dx, dwg, dwu, dwd, dbd, None


def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, b_down: Optional[Tensor],
              activation: str) -> Optional[Tensor]:
    """``F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), w_down, b_down)`` through :class:`_GatedMLPFunction`
    where it serves the call: autograd needed, plain eager mode, plain tensors of one dtype the Triton passes take
    (under ``torch.autocast``, once cast as F.linear casts them), packed gate and up weights, more than ``GATED_MAX_M`` rows and at least
    ``PRODUCT_MIN_FLOPS`` per projection. Else None (nothing run): the caller serves the call."""
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
