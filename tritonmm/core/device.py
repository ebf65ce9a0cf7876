"""Facts about the device a GEMM runs on: SM count, shared memory, TMA, TF32. One helper each."""

from __future__ import annotations

import functools

import torch

from .env import interpreting

INTERPRETER_SMS = 4
"""SM count assumed for CPU tensors under ``TRITON_INTERPRET=1`` (it only shapes grids and pruning)."""


def index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def limits(device_index: int) -> tuple[int, int]:
    """(shared memory per block in bytes, SM count) of a CUDA device, read once."""
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"]), int(props["multiprocessor_count"])


def num_sms(device: torch.device) -> int:
    """SM count of ``device`` (132 on an H200); :data:`INTERPRETER_SMS` for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return limits(index(device))[1]


def smem_limit(device: torch.device) -> int | None:
    """Shared memory per block in bytes; None (no limit) for CPU tensors."""
    return limits(index(device))[0] if device.type == "cuda" else None


def has_tma(device: torch.device) -> bool:
    """Whether the TMA kernel can run: compute capability 9.0+ (Hopper), or CPU under the interpreter."""
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device)[0] >= 9


def tf32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a float32 GEMM may use TF32 here, as torch.matmul would: on CUDA, with
    ``torch.get_float32_matmul_precision() != "highest"``."""
    return dtype == torch.float32 and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
