"""``tritonmm::stacked_linear``: ``F.linear`` of one input and several weights as one GEMM on the weights' rows
stacked, ``x @ [W0; W1; ...]^T`` (and ``[b0; b1; ...]``), the op a fused attention's q, k and v projections run as
under ``torch.compile`` (:mod:`tritonmm.modules.qkv_traced`). Weights that :func:`tritonmm.modules.packing.pack` put
one after another in one allocation are read there, as one view (one cuBLAS GEMM, one read of the weights); any
others run as one GEMM each, into the one output. Each eager call checks where the weights are, so a compiled graph
that holds the op stays right after they move (``unfuse``, ``.to()``, ``.data =``)."""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.layout import stacked

_grad_enabled = torch.is_grad_enabled


def _each(x: Tensor, weights: List[Tensor], biases: List[Tensor]) -> Tensor:
    """One GEMM per weight (F.linear's own checks and errors), their outputs concatenated along the last dim."""
    bs = biases if biases else [None] * len(weights)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, bs)], -1)


_lib = torch.library.Library("tritonmm", "FRAGMENT")
_lib.define("stacked_linear(Tensor x, Tensor[] weights, Tensor[] biases) -> Tensor")


def _check(weights: List[Tensor], biases: List[Tensor]) -> None:
    if not weights:
        raise ValueError("stacked_linear: expected at least one weight")
    if biases and len(biases) != len(weights):
        raise ValueError(f"stacked_linear: {len(weights)} weights but {len(biases)} biases")


def _stacked_linear(x: Tensor, weights: List[Tensor], biases: List[Tensor]) -> Tensor:
    _check(weights, biases)
    if _grad_enabled() and (x.requires_grad or any(t.requires_grad for t in (*weights, *biases))):
        return _each(x, weights, biases)  # (the stacked view is detached)
    w = stacked(weights) if x.dim() else None  # (a 0-dim x: F.linear's error)
    b = stacked(biases) if biases and w is not None else None
    if w is None or biases and b is None or w.dtype != x.dtype or w.shape[-1] != x.shape[-1]:
        return _each(x, weights, biases)
    return F.linear(x, w, b)


def _stacked_linear_fake(x: Tensor, weights: List[Tensor], biases: List[Tensor]) -> Tensor:
    _check(weights, biases)
    return _each(x, weights, biases)


# (a plain library op: ``torch.library.custom_op``'s wrapper costs the host more than the GEMM launches this op saves)
_lib.impl("stacked_linear", _stacked_linear, "CompositeExplicitAutograd")
_lib.impl("stacked_linear", torch.library.fallthrough_kernel, "Autograd")  # (calls with gradients: F.linear's own)
torch.library.register_fake("tritonmm::stacked_linear", _stacked_linear_fake, lib=_lib)
stacked_linear = torch.ops.tritonmm.stacked_linear.default
"""``torch.cat([F.linear(x, w, b) for ...], -1)`` (``biases`` empty: no biases), as one GEMM where the weights (and
biases) are stacked in one allocation."""
