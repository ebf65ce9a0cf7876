"""Scratch memory reused across calls, like cuBLAS's workspace: split-K partial sums and aligned operand copies.

One buffer per (slot, thread, device, stream): work queued on one stream runs in order, so a buffer
reused by the next call on that stream is never read and written at once; another stream or
another thread gets its own buffer (two threads may queue work on one stream interleaved).
Buffers grow to the largest request up to :data:`WORKSPACE_MAX` bytes and are kept; larger
requests, and requests while a CUDA graph is being captured (the graph's private pool owns
those), are plain allocations freed with the call.
"""

from __future__ import annotations

import math
import threading

import torch

WORKSPACE_MAX = 256 << 20  # bytes per (slot, thread, device, stream)
_ALIGN = 256  # bytes: each view starts at a multiple (TMA wants 16, coalescing likes 128)
_VIEWS_MAX = 256  # cached view lists per buffer (one per distinct request)
_local = threading.local()


def _stream_key(device: torch.device):
    if device.type != "cuda":
        return (device.type, device.index, 0)
    if torch.cuda.is_current_stream_capturing():
        return None
    return ("cuda", device.index, torch.cuda.current_stream(device).cuda_stream)


def buffers(device: torch.device, specs, slot: str = "copies") -> list[torch.Tensor]:
    """Uninitialized contiguous tensors for one call, carved from this (slot, thread, device, stream)'s buffer.

    Args:
        device: where the tensors live.
        specs: a sequence of (shape, dtype).
        slot: which buffer: each slot is a separate buffer, so a call can hold tensors of two slots
            at once (aligned operand copies in "copies", split-K partials in "splitk").

    Returns:
        list[Tensor]: one tensor per spec, valid until the next ``buffers`` call for the same
        slot on the same thread, device and stream (use them only within one call, and do not
        resize them: a repeated request gets the same view objects back).
    """
    key = _stream_key(device)
    specs = tuple((tuple(shape), dtype) for shape, dtype in specs)
    if key is not None:  # the views of a repeated request are made once (each slice and view is a host op)
        key = (slot, *key)
        made = getattr(_local, "views", {}).get(key, {}).get(specs)
        if made is not None:
            return list(made)
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    if key is None or total > WORKSPACE_MAX:
        raw = torch.empty(total, dtype=torch.uint8, device=device)
        key = None
    else:
        cache = getattr(_local, "buffers", None)
        if cache is None:
            cache = _local.buffers = {}
            _local.views = {}
        raw = cache.get(key)
        if raw is None or raw.numel() < total:
            _local.views.pop(key, None)  # views of the smaller buffer would keep it alive
            cache.pop(key, None)  # free the smaller buffer before allocating the larger one
            raw = cache[key] = torch.empty(total, dtype=torch.uint8, device=device)
    views = [raw[o:o + n].view(dtype).view(shape) for o, n, (shape, dtype) in zip(offsets, sizes, specs)]
    if key is not None:
        made = _local.views.setdefault(key, {})
        if len(made) >= _VIEWS_MAX:
            made.clear()
        made[specs] = tuple(views)
    return views


def counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` int32 counters, zero, for kernels that count arrivals and set them back to zero before
    they finish (split-K's last-arriver reduction). Kept per (thread, device, stream) apart from
    :func:`buffers`, so nothing else writes them; grown by allocating a larger zeroed tensor. During
    CUDA graph capture a fresh zeroed tensor is returned (the zero fill is captured with it).

    Returns:
        Tensor: (n,) int32, zero whenever the stream reaches the caller's next kernel.
    """
    key = _stream_key(device)
    if key is None:
        return torch.zeros(n, dtype=torch.int32, device=device)
    cache = getattr(_local, "counters", None)
    if cache is None:
        cache = _local.counters = {}
    t = cache.get(key)
    if t is None or t.numel() < n:
        t = cache[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return t


def release() -> None:
    """Free this thread's workspace buffers and counters (every device and stream)."""
    getattr(_local, "buffers", {}).clear()
    getattr(_local, "views", {}).clear()
    getattr(_local, "counters", {}).clear()


def held_bytes() -> int:
    """Bytes held by this thread's workspace buffers and counters."""
    return sum(t.numel() * t.element_size() for d in ("buffers", "counters") for t in getattr(_local, d, {}).values())
