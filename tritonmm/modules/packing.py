"""Packed weights: the parameters of projections that read one input, stored in one allocation.

Where each weight directly follows the one before in memory, the projections can run as one GEMM on
x @ [W0; W1; ...]^T: one launch instead of several, one grid of tiles instead of several quantized
ones. A fused MLP's gate and up projections run that way where they go to cuBLAS
(:func:`tritonmm.dispatch.gated_cublas.packed`), and their weights' gradients as one GEMM; a fused attention's
q, k and v projections run that way in captured CUDA graphs (:mod:`tritonmm.modules.qkv`). :func:`pack` arranges it
in place: the parameters stay the same objects with the same values, shapes, dtypes and
``requires_grad``; only their storage moves, as with ``param.data = ...``. Nothing is copied twice: the
old storages are freed when nothing else holds them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..core.layout import stacked

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # (no weak reference to a parameter is kept here:
# torch.utils.swap_tensors, which .to() and load_state_dict use under swap_module_params_on_conversion, refuses one)


def _sole_owner(p: torch.Tensor) -> bool:
    """Whether ``p`` is the whole of its storage, allocated by torch, and, where torch can tell, the only tensor on
    it (a view of it elsewhere would stop seeing its values once it moved). Memory torch did not allocate (numpy's
    through ``torch.from_numpy``, DLPack's, a memory-mapped file's: storages torch cannot resize) has another owner
    that may write it. (On the CPU, where weights move only under Triton's interpreter, ``torch.load`` also gives
    storages torch cannot resize.)"""
    storage = p.untyped_storage()
    if p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size() or not storage.resizable():
        return False
    return _use_count is None or _use_count(storage._cdata) <= 2  # the tensor's reference and ``storage``'s


def _movable(ps, accept: Callable[[torch.Tensor], bool]) -> bool:
    """Whether the tensors ``ps`` can move into one allocation: distinct plain contiguous parameters, one
    dtype and device, one shape but for dim 0, that ``accept`` takes, each alone on its storage (not in
    shared or pinned memory, no inference tensors), not stacked already."""
    first = ps[0]
    if any(type(p) is not nn.Parameter for p in ps) or len({id(p) for p in ps}) != len(ps) or not accept(first):
        return False
    if any(p.is_inference() for p in ps) or first.device.type == "meta":
        return False
    if first.device.type == "cpu" and any(p.is_shared() or p.is_pinned() for p in ps):
        return False  # (shared with other processes, or pinned for copies: a new allocation would be neither)
    if any(p.dim() != first.dim() or p.shape[1:] != first.shape[1:] or p.dtype != first.dtype
           or p.device != first.device or not p.numel() or not p.is_contiguous() for p in ps):
        return False
    return stacked(ps) is None and all(_sole_owner(p) for p in ps)


def _params(modules, name: str):
    return [m._parameters.get(name) for m in modules]


def packable(*modules: nn.Module, accept: Callable[[torch.Tensor], bool], biases: bool = False) -> bool:
    """Whether :func:`pack` can store the ``modules``' weights (and, with ``biases``, their biases) in one
    allocation each (see :func:`_movable`; ``accept``: the weights' dtypes and devices the caller serves).
    Without ``biases``, modules with a bias are not packable; with it, either all or none have one."""
    weights, bs = _params(modules, "weight"), _params(modules, "bias")
    if any(w is None for w in weights) or not _movable(weights, accept):
        return False
    present = [b is not None for b in bs]
    if not any(present):
        return True
    return biases and all(present) and (stacked(bs) is not None or _movable(bs, lambda b: True))


def pack(*modules: nn.Module, accept: Callable[[torch.Tensor], bool], biases: bool = False) -> bool:
    """Move the ``modules``' weights into one (sum of N, K) allocation in order (and their biases into another,
    with ``biases``), where :func:`packable`; returns whether they are packed now."""
    weights, bs = _params(modules, "weight"), _params(modules, "bias")
    if all(w is not None for w in weights) and stacked(weights) is not None \
            and (all(b is None for b in bs) or biases and all(b is not None for b in bs) and stacked(bs) is not None):
        return True
    if not packable(*modules, accept=accept, biases=biases):
        return False
    groups = [weights] + ([bs] if bs[0] is not None and stacked(bs) is None else [])
    with torch.inference_mode(False), torch.no_grad():  # (under inference mode too: parameters stay normal tensors)
        for ps in groups:
            rows = sum(p.shape[0] for p in ps)
            whole = torch.empty((rows, *ps[0].shape[1:]), dtype=ps[0].dtype, device=ps[0].device)
            start = 0
            for p in ps:
                whole[start:start + p.shape[0]].copy_(p)
                p.data = whole[start:start + p.shape[0]]
                start += p.shape[0]
    return True


def unpack(*modules: nn.Module) -> bool:
    """Give packed weights (and packed biases) their own storage again (copies of their current values): groups
    whose storage holds exactly those weights, as :func:`pack` leaves them (and a packed model after ``torch.save``
    and ``torch.load``); returns whether it did."""
    weights, bs = _params(modules, "weight"), _params(modules, "bias")
    if any(w is None for w in weights) or stacked(weights) is None:
        return False
    first = weights[0]
    exact = first.storage_offset() == 0 and \
        first.untyped_storage().nbytes() == sum(w.numel() for w in weights) * first.element_size()
    if not exact:
        return False
    with torch.inference_mode(False), torch.no_grad():
        for ps in (weights, bs):
            if all(p is not None for p in ps) and stacked(ps) is not None:
                for p in ps:
                    p.data = p.data.clone()
    return True
