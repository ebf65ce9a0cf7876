"""Operand layouts as the kernels and cuBLAS see them: TMA descriptor rules, 16-byte alignment,
the padded path's shapes, the 64-bit offset check, and tensors stacked in one storage (packed weights,
:func:`stacked`). Pure torch (no Triton).

TMA (and cuBLAS's fast Tensor Core kernels) need a unit stride in one dim and a 16-byte aligned
base address and leading stride (CUDA ``cuTensorMapEncodeTiled``; NVIDIA, *Matrix Multiplication
Background*, "Tensor Core Requirements").
"""

from __future__ import annotations

import torch

from .shapes import Plan

PAD = 64
"""Elements: the padded path rounds an unaligned K or N up to a multiple of this (a multiple of
every BLOCK_K and BLOCK_N of the candidates)."""

_BIG = 256  # the largest block edge in any config; bounds index overshoot in the INT64 check


def is_col_major(t: torch.Tensor) -> bool:
    """Whether a 2-D operand is read with unit stride along dim 0 (a transposed view)."""
    if t.stride(1) == 1 and t.shape[1] != 1:
        return False
    return t.stride(0) == 1 or t.shape[0] == 1 or t.stride(1) != 1


def tma_layout(t: torch.Tensor) -> tuple[bool, int]:
    """(transposed, leading stride in elements) of a 2-D operand as a TMA descriptor sees it.

    A transposed operand is described over its storage, shape (cols, rows). Where the
    leading dim has size 1 its stride is never used and an aligned stand-in is returned.
    """
    col = is_col_major(t)
    inner, outer = (t.shape[0], t.shape[1]) if col else (t.shape[1], t.shape[0])
    lead = t.stride(1) if col else t.stride(0)
    if outer == 1:
        per16 = 16 // t.element_size()
        lead = -(-max(inner, 1) // per16) * per16
    return col, lead


def _address(t: torch.Tensor) -> int:
    """``t.data_ptr()``; for fake and functional tensors (tracing), the storage offset in bytes, as if
    the storage were allocator-aligned."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return t.storage_offset() * t.element_size()


def tma_compatible(t: torch.Tensor) -> bool:
    """Whether TMA (or cuBLAS at full speed) can read a 2-D operand in place: a unit stride in one
    dim, and a 16-byte aligned base address and leading stride."""
    if _address(t) % 16:
        return False
    col, lead = tma_layout(t)
    inner = t.shape[0] if col else t.shape[1]
    unit = t.stride(0) if col else t.stride(1)
    if unit != 1 and inner > 1:
        return False
    return lead > 0 and (lead * t.element_size()) % 16 == 0


def tma_copy_layout(t: torch.Tensor) -> tuple[bool, int]:
    """The :func:`tma_layout` of an aligned copy of ``t`` (rows padded to 16 bytes, same major order)."""
    col = is_col_major(t)
    inner = t.shape[0] if col else t.shape[1]
    per16 = 16 // t.element_size()
    return col, -(-max(inner, 1) // per16) * per16


def tma_copy_shape(t: torch.Tensor) -> tuple[int, int]:
    """(rows, padded row length) of the buffer an aligned copy of ``t`` lives in."""
    col, lead = tma_copy_layout(t)
    return (t.shape[1] if col else t.shape[0]), lead


def tma_copies(plan: Plan) -> tuple:
    """The operands ("a", "b") of a 2-D plan that TMA cannot read in place and must copy."""
    return tuple(n for n, t in (("a", plan.a4[0, 0]), ("b", plan.b4[0, 0])) if not tma_compatible(t))


def tag(plan: Plan) -> str:
    """Two letters, A then B: 'n' = row-major (unit stride along the last dim), 't' = transposed."""
    return ("n" if plan.a4.stride(3) == 1 else "t") + ("n" if plan.b4.stride(3) == 1 else "t")


def aligned(n: int, itemsize: int) -> bool:
    """Whether ``n`` elements make a multiple of 16 bytes."""
    return (n * itemsize) % 16 == 0


def round_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`PAD`."""
    return -(-n // PAD) * PAD


def padded_shape(plan: Plan, dtype: torch.dtype) -> tuple[int, int] | None:
    """(Kp, Np) the padded path would use for a 2-D plan, or None when every operand and the
    output are already aligned (or the plan is batched), so padding gains nothing."""
    if plan.batch != 1:
        return None
    size = dtype.itemsize
    a2, b2 = plan.a4[0, 0], plan.b4[0, 0]
    if aligned(plan.N, size) and tma_compatible(a2) and tma_compatible(b2):
        return None
    K, N = plan.K, plan.N
    return (K if aligned(K, size) else round_up(K)), (N if aligned(N, size) else round_up(N))


def needs_int64(*operands) -> bool:
    """Whether an in-kernel element offset can pass 2**31: operands given as (rows, cols, row stride, col stride)."""
    return any((r + _BIG) * abs(sr) + (c + _BIG) * abs(sc) >= 2**31 for r, c, sr, sc in operands)


def adjacent(tensors) -> bool:
    """Whether each tensor directly follows the one before in one storage (all contiguous and non-empty, one
    dtype, one shape but for dim 0): :func:`stacked` without building the view (a check on the per-call path)."""
    first = tensors[0]
    if not first.dim():
        return False
    size, tail = first.element_size(), first.shape[1:]
    ptr = first.data_ptr()
    base = ptr - first.storage_offset() * size
    for t in tensors:
        n = t.numel()
        if not n or t.dtype != first.dtype or t.shape[1:] != tail or not t.is_contiguous() or t.data_ptr() != ptr \
                or ptr - t.storage_offset() * size != base:
            return False  # not adjacent, or adjacent allocations of two storages
        ptr += n * size
    return True


def stacked(tensors) -> torch.Tensor | None:
    """The tensor [t0; t1; ...] (concatenated along dim 0), a view, where the tensors are :func:`adjacent`, else
    None. Detached: callers return the tensors' gradients themselves."""
    if not adjacent(tensors):
        return None
    first = tensors[0]
    tail = first.shape[1:]
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *tail), (tail.numel(), *first.stride()[1:]))
