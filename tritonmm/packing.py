"""Packed gate and up weights: the two parameters of a gated MLP stored in one allocation.

Where the up weight directly follows the gate weight in memory, the gate and up projections that run on
cuBLAS (:data:`tritonmm.gated.PRODUCT_MIN_FLOPS`) run as one GEMM on x @ [Wg; Wu]^T, and both weights'
gradients as one GEMM: one launch instead of two, one grid of tiles instead of two quantized ones
(:func:`tritonmm.gated_cublas.packed`). :func:`pack` arranges that in place: the parameters stay the
same objects with the same values, shapes, dtypes and ``requires_grad``; only their storage moves, as
with ``param.data = ...``. Nothing is copied twice: the old storages are freed when nothing else holds them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .gated_cublas import packed, serves

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_moved = WeakIdKeyDictionary()  # gate weights :func:`pack` moved (:func:`unpack` undoes those), by identity


def _sole_owner(p: torch.Tensor) -> bool:
    """Whether ``p`` is the whole of its storage and, where torch can tell, the only tensor on it (a view
    of it elsewhere would stop seeing its values once it moved)."""
    storage = p.untyped_storage()
    if p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
        return False
    return _use_count is None or _use_count(storage._cdata) <= 2  # the tensor's reference and ``storage``'s


def packable(gate: nn.Module, up: nn.Module) -> bool:
    """Whether :func:`pack` can store ``gate``'s and ``up``'s weights in one allocation: plain contiguous
    parameters of one shape, dtype and device that the gated kernels serve (CUDA), each alone on its
    storage (not in shared or pinned memory, no inference tensors), no biases, not yet packed."""
    wg, wu = gate._parameters.get("weight"), up._parameters.get("weight")
    if type(wg) is not nn.Parameter or type(wu) is not nn.Parameter or wg is wu or not serves(wg):
        return False
    if wg.is_inference() or wu.is_inference():
        return False
    if wg.device.type == "cpu" and any(w.is_shared() or w.is_pinned() for w in (wg, wu)):
        return False  # (shared with other processes, or pinned for copies: a new allocation would be neither)
    if gate._parameters.get("bias") is not None or up._parameters.get("bias") is not None:
        return False  # (the packed GEMM takes no biases)
    if wg.shape != wu.shape or wg.dim() != 2 or wg.dtype != wu.dtype or wg.device != wu.device \
            or wg.device.type == "meta" or not wg.numel() or not (wg.is_contiguous() and wu.is_contiguous()):
        return False
    return packed(wg, wu) is None and _sole_owner(wg) and _sole_owner(wu)


def pack(gate: nn.Module, up: nn.Module) -> bool:
    """Move ``gate.weight`` and ``up.weight`` into one (2N, K) allocation, gate first, where
    :func:`packable`; returns whether they are packed now."""
    wg, wu = gate._parameters.get("weight"), up._parameters.get("weight")
    if wg is not None and wu is not None and packed(wg, wu) is not None:
        return True
    if not packable(gate, up):
        return False
    N = wg.shape[0]
    with torch.inference_mode(False), torch.no_grad():  # (under inference mode too: parameters stay normal tensors)
        both = torch.empty((2 * N, wg.shape[1]), dtype=wg.dtype, device=wg.device)
        both[:N].copy_(wg)
        both[N:].copy_(wu)
        wg.data, wu.data = both[:N], both[N:]
    _moved[wg] = True
    return True


def unpack(gate: nn.Module, up: nn.Module) -> bool:
    """Give packed weights their own storage again (copies of their current values): those :func:`pack`
    moved, and pairs whose storage holds exactly the two (as a packed model's does after ``torch.save`` and
    ``torch.load``); returns whether it did."""
    wg, wu = gate._parameters.get("weight"), up._parameters.get("weight")
    if wg is None or wu is None or packed(wg, wu) is None:
        return False
    exact = wg.storage_offset() == 0 and wg.untyped_storage().nbytes() == 2 * wg.numel() * wg.element_size()
    if wg not in _moved and not exact:
        return False
    with torch.inference_mode(False), torch.no_grad():
        wg.data, wu.data = wg.data.clone(), wu.data.clone()
    _moved.pop(wg, None)
    return True
