"""One-pass strided copy with zero padding, for the aligned operand copies of the padded and TMA paths.

``dst[r, c] = src[r, c]`` for ``r < rows, c < cols`` and ``0`` elsewhere in the (dst_rows,
dst_cols) window of ``dst``: one memory-bound pass per operand instead of torch's strided
``copy_`` plus a separate ``zero_`` of the padding. Under the interpreter the kernel runs on CPU
tensors; on CPU without it :func:`copier` falls back to torch's copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.env import interpreting
from ..core.layout import is_col_major, tma_compatible, tma_copy_shape
from .launch import DirectLaunch

BLOCK_R = 16
BLOCK_C = 256  # 16 x 256 elements: 8 KiB of bfloat16 a program, 16-byte vector loads along a row


@triton.jit
def _pad_copy_kernel(
    src_ptr, dst_ptr,
    rows, cols, dst_rows, dst_cols,
    stride_sr, stride_sc, stride_dr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # a 1-D grid (CUDA caps grid axes 1 and 2 at 65535 programs; axis 0 at 2**31 - 1)
    pid = tl.program_id(0).to(tl.int64)
    blocks_c = tl.cdiv(dst_cols, BLOCK_C)
    offs_r = (pid // blocks_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (pid % blocks_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
    x = tl.load(src_ptr + offs_r[:, None] * stride_sr + offs_c[None, :] * stride_sc, mask=inside, other=0.0)
    window = (offs_r[:, None] < dst_rows) & (offs_c[None, :] < dst_cols)
    tl.store(dst_ptr + offs_r[:, None] * stride_dr + offs_c[None, :], x, mask=window)


def _check_window(src_shape, dst_window) -> None:
    if dst_window[0] < src_shape[0] or dst_window[1] < src_shape[1]:
        raise ValueError(f"destination window {tuple(dst_window)} smaller than the source {tuple(src_shape)}")


def usable(device: torch.device) -> bool:
    """Whether the copy kernel can run on ``device``: CUDA, or CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


class PadCopy:
    """A copy of one geometry: ``(src, dst)`` with fixed shapes and strides (see the module docstring).

    Args:
        src_shape: (rows, cols) of the source; src_strides: its strides in elements (any).
        dst_window: (dst_rows, dst_cols) >= src_shape, the part of ``dst`` written.
        dst_stride: the destination's row stride in elements (its column stride is 1).

    Launches go through :class:`tritonmm.kernels.launch.DirectLaunch` (callers key geometries by
    the 16-byte alignment of every pointer, which is all Triton specializes on).
    """

    def __init__(self, src_shape, src_strides, dst_window, dst_stride: int):
        _check_window(src_shape, dst_window)
        rows, cols = src_shape
        dst_rows, dst_cols = dst_window
        self.ints = (rows, cols, dst_rows, dst_cols, src_strides[0], src_strides[1], dst_stride)
        grid = (triton.cdiv(dst_rows, BLOCK_R) * triton.cdiv(dst_cols, BLOCK_C),)
        self.launch = DirectLaunch(_pad_copy_kernel, grid, dict(BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4))
        self.empty = dst_rows == 0 or dst_cols == 0

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.empty:
            return
        if src.device.type == "cuda" and src.device.index != torch.cuda.current_device():
            with torch.cuda.device(src.device.index):  # Triton launches on the current device
                self.launch((src, dst, *self.ints))
        else:
            self.launch((src, dst, *self.ints))


def copier(src_shape, src_strides, dst_window, dst_stride: int, device: torch.device):
    """The copy ``(src, dst) -> None`` of one geometry (arguments as :class:`PadCopy`'s): a
    :class:`PadCopy` where :func:`usable`, else torch's ``copy_`` and ``zero_`` with the same result.

    Raises:
        ValueError: the window is smaller than the source.
    """
    if usable(device):
        return PadCopy(src_shape, src_strides, dst_window, dst_stride)
    _check_window(src_shape, dst_window)
    rows, cols = src_shape
    dst_rows, dst_cols = dst_window

    def torch_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
        window = dst[:dst_rows, :dst_cols]
        window[:rows, :cols].copy_(src)
        window[rows:].zero_()
        window[:rows, cols:].zero_()

    return torch_copy


def pad_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy a 2-D ``src`` into the top-left corner of ``dst`` and zero the rest of ``dst``.

    Args:
        src (Tensor): (rows, cols), any strides, same dtype and device as ``dst``.
        dst (Tensor): (dst_rows >= rows, dst_cols >= cols), unit column stride.

    Raises:
        ValueError: shapes, dtypes or devices do not fit; ``dst`` lacks a unit column stride or has
            overlapping rows (as torch's ``copy_`` refuses to write overlapping memory); a device
            the kernel cannot run on (CPU without ``TRITON_INTERPRET=1``).
    """
    if src.dim() != 2 or dst.dim() != 2 or src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError("pad_copy: src and dst must be 2-D tensors of one dtype and device")
    if dst.stride(1) != 1 and dst.shape[1] > 1:
        raise ValueError("pad_copy: dst needs a unit column stride")
    if dst.shape[0] > 1 and dst.stride(0) < dst.shape[1]:
        raise ValueError("pad_copy: dst rows overlap (row stride smaller than the row length)")
    if not usable(dst.device):
        raise ValueError(f"pad_copy: the kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1; got {dst.device}")
    PadCopy(src.shape, src.stride(), dst.shape, dst.stride(0))(src, dst)


def tma_view(t: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` itself when TMA can read it, else a copy with 16-byte aligned rows (same major order).

    The copy lives in a buffer whose rows are padded to a multiple of 16 bytes and is
    returned as a view of the exact shape; the descriptor's bounds keep the padding
    unread, so results are exact. Extra memory: the operand's size plus < 16 bytes a row.

    Args:
        t (Tensor): 2-D operand.
        buf (Tensor, optional): a contiguous, 16-byte aligned buffer of :func:`tritonmm.core.layout.tma_copy_shape`
            and ``t``'s dtype to copy into (e.g. from :mod:`tritonmm.core.workspace`); default: a new one.
    """
    if tma_compatible(t):
        return t
    col = is_col_major(t)
    src = t.mT if col else t  # (outer, inner), unit stride along inner once copied
    inner = src.shape[1]
    if buf is None:
        buf = torch.empty(tma_copy_shape(t), dtype=t.dtype, device=t.device)
    buf = buf[:, :inner]
    buf.copy_(src)
    return buf.mT if col else buf


def tma_copier(t: torch.Tensor):
    """A function ``(x, buf) -> view`` doing :func:`tma_view`'s copy for operands of ``t``'s geometry,
    through :func:`copier` (built once per geometry). ``buf`` is as in :func:`tma_view`."""
    col = is_col_major(t)
    src = t.mT if col else t
    rows, inner = src.shape
    pc = copier((rows, inner), src.stride(), (rows, inner), tma_copy_shape(t)[1], t.device)

    def copy(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        pc(x.mT if col else x, buf)
        view = buf[:, :inner]
        return view.mT if col else view

    return copy
