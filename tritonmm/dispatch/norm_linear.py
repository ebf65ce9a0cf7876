"""``F.linear(rms_norm(x), w, b)`` as one launch at decode sizes: the GEMM with the RMSNorm in its loads
(:mod:`tritonmm.kernels.norm_linear`), for the q/k/v GEMM of an attention whose input an RMSNorm produced
(:mod:`tritonmm.modules.qkv`, :mod:`tritonmm.modules.norm_fold`). Up to :data:`tritonmm.dispatch.gated.GATED_MAX_M`
rows; each geometry's launcher is built, and its config autotuned, on its first call outside CUDA graph capture. On an
H100 the kernel took 0.89x (1 row) and 0.72x (16 rows) of transformers' norm plus the cuBLAS GEMM at Llama-3-8B's
q/k/v sizes, in CUDA graphs (``benchmarks/diagnostics/h100_norm_prologue_gemm.json``)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from ..core import modes
from ..core.env import interpreting
from . import runners
from .gated import GATED_MAX_M

_launchers: dict = {}
_FAILED = object()
_LAUNCHERS_MAX = 1024
_empty = torch.empty  # the kernel's output allocator (tests swap in a NaN-filling one)
_precision = torch.get_float32_matmul_precision
_any_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch.is_grad_enabled


def norm_linear(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor, b: Optional[Tensor]) -> Optional[Tensor]:
    """``F.linear(norm(x), w, b)`` without autograd for transformers' ``LlamaRMSNorm`` ``norm`` (``norm_weight``,
    ``eps``: ``norm_weight * (x / rms(x)).to(x.dtype)``, here with X times the weight rounded once and 1 / rms applied
    to the fp32 accumulator in bfloat16 and float32), as one kernel launch: x (..., K) of up to
    :data:`~tritonmm.dispatch.gated.GATED_MAX_M` rows with a unit last stride, w (N, K) and b (N,), all of one dtype
    and CUDA device (CPU under Triton's interpreter). None where it does not serve (autograd, autocast, a mode,
    other operands, in CUDA graph capture before the geometry's launcher is built, a failed launch): the caller
    normalizes x and calls ``F.linear``."""
    from ..kernels.launch import LAUNCH_FAILURES, capturing
    from ..kernels.norm_linear import norm_linear_launcher

    tensors = (x, norm_weight, w) if b is None else (x, norm_weight, w, b)
    if _any_autocast() or not modes.eager() or not modes.plain(*tensors) or modes.torch_only(*tensors) \
            or _grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    K = x.shape[-1] if x.dim() else 0
    M = x.numel() // K if K else 0
    N = w.shape[0] if w.dim() == 2 else 0
    dtype, device = x.dtype, x.device
    if not (0 < M <= GATED_MAX_M and N and w.shape[1] == K and norm_weight.shape == (K,)) \
            or dtype not in (torch.float16, torch.bfloat16, torch.float32) \
            or any(t.dtype != dtype or t.device != device for t in tensors) \
            or not (device.type == "cuda" or device.type == "cpu" and interpreting()) \
            or norm_weight.stride(0) != 1 or w.stride(1) != 1 or b is not None and b.shape != (N,):
        return None
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1 and K != 1:
        return None
    key = (M, N, K, x2.stride(0), w.stride(0), dtype, device, None if b is None else b.stride(0),
           tuple(t.data_ptr() % 16 == 0 for t in (x2, norm_weight, w, *(() if b is None else (b,)))),
           dtype is torch.float32 and _precision())
    launch = _launchers.get(key)
    if launch is None:
        if capturing(device):  # (no compiling, no tuning in capture)
            return None
        launch = norm_linear_launcher(M, N, K, x2.stride(0), w.stride(0), dtype, device,
                                      None if b is None else b.stride(0))
        if len(_launchers) >= _LAUNCHERS_MAX:
            _launchers.clear()
        _launchers[key] = launch
    elif launch is _FAILED:
        return None
    out = _empty((*x.shape[:-1], N), dtype=dtype, device=device)
    try:
        launch(x2, norm_weight, w, b, out.view(M, N), eps)
    except LAUNCH_FAILURES as e:
        _launchers[key] = _FAILED
        warnings.warn(f"tritonmm: the GEMM with the RMSNorm in its loads failed ({type(e).__name__}: {e}); the norm "
                      "runs as its module for this geometry", runners.KernelFailedWarning, stacklevel=3)
        return None
    return out


def clear_cache() -> None:
    """Forget the launchers."""
    _launchers.clear()
