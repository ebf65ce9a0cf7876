"""A GEMM that reads an RMSNorm's input: Y = (X / rms(X) * w_norm) @ W^T + b, at decode sizes (a few rows).

transformers' ``LlamaRMSNorm`` writes its output in eight eager kernels before the GEMM after it reads it; this
kernel normalizes X's tiles as it loads them, as the gated kernel's ``NORM`` does (:mod:`.gated`): in one pass
(``ONE_PASS``: bfloat16 and float32) it loads X times the norm's weight, rounded once, sums each row's squares on the
way and scales the fp32 accumulator by each row's 1 / rms in the epilogue; in two passes (float16, where X times the
weight may overflow) a first loop sums the squares and the GEMM loop loads X normalized and rounded where the module
rounds. One program per (BLOCK_M, BLOCK_N) output tile, N tiles first (one row tile at these sizes), masked for any
M, N, K; W is an (N, K) nn.Linear weight (q, k and v packed, :mod:`tritonmm.modules.qkv`) read in place.

Configs: BLOCK_M 16 and the grid below, tuned by ``@triton.autotune`` on a geometry's first launch (never in CUDA
graph capture: the caller builds the launcher outside it), keyed by bucketed M, N and K.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..core.env import autotune_enabled, deterministic_configs, interpreting
from ..core.layout import needs_int64
from . import configs as _cfg
from .common import _to_output
from .gated import _row_rstd
from .launch import DirectLaunch, input_precision

CONFIGS = tuple(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=s)
                for bn, bk, s in itertools.product((32, 64, 128), (128, 256), (3, 4)))
"""The candidates (``benchmarks/diagnostics/norm_prologue_gemm.py`` measured these at 1 and 16 rows)."""
HEURISTIC = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
"""The config of launches that may not tune (``TRITONMM_AUTOTUNE=0``, deterministic configs)."""
_INTERPRETER = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)


@triton.jit
def _norm_linear_kernel(
    x_ptr,  # (M, K), unit column stride: the norm's input
    nw_ptr,  # (K,), unit stride: the norm's weight
    w_ptr,  # (N, K), unit column stride
    b_ptr,  # (N,), or a dummy unless HAS_BIAS
    y_ptr,  # (M, N) contiguous
    M, N, K, stride_xm, stride_wn, stride_b,
    eps,
    M_BUCKET, N_BUCKET, K_BUCKET,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    INT64: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_PASS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_xm = offs_m % M  # wrapped rows/columns are in bounds; never stored (as in the pointer GEMM)
    offs_wn = offs_n % N
    if INT64:
        offs_xm = offs_xm.to(tl.int64)
        offs_wn = offs_wn.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_xm[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_wn[None, :] * stride_wn + offs_k[:, None]
    nw_ptrs = nw_ptr + offs_k
    if ONE_PASS:
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        rstd = _row_rstd(x_ptrs, offs_k, K, eps, BLOCK_M, BLOCK_K, EVEN_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
            nw = tl.load(nw_ptrs).to(tl.float32)
        else:
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            nw = tl.load(nw_ptrs, mask=offs_k < k_left, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        if ONE_PASS:  # x times the weight; 1 / rms in the epilogue
            squares += tl.sum(xf * xf, axis=1)
            x = _to_output(xf * nw[None, :], x.dtype, UPCAST)
        else:  # transformers' LlamaRMSNorm: x / rms in fp32, rounded, times the weight, rounded
            xn = _to_output(xf * rstd[:, None], x.dtype, UPCAST)
            x = _to_output(nw[None, :] * xn.to(tl.float32), x.dtype, UPCAST)
        if UPCAST:  # the interpreter multiplies bfloat16 bit patterns (triton-lang/triton#11584)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        nw_ptrs += BLOCK_K
    if ONE_PASS:
        rstd = 1.0 / tl.sqrt(squares / K + eps)
        acc *= rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n * stride_b, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = _to_output(acc, y_ptr.dtype.element_ty, UPCAST)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], y, mask=mask)


def _even_k(args) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


_autotuned = None


def _tuner():
    global _autotuned
    if _autotuned is None:
        configs = [_cfg.to_triton(c) for c in CONFIGS]
        fn = triton.heuristics({"EVEN_K": _even_k})(_norm_linear_kernel)
        _autotuned = triton.autotune(configs=configs, key=["M_BUCKET", "N_BUCKET", "K_BUCKET"], cache_results=True)(fn)
    return _autotuned


def norm_linear_launcher(M: int, N: int, K: int, stride_x: int, stride_w: int, dtype: torch.dtype,
                         device: torch.device, bias_stride=None, config=None):
    """A launcher ``(x, nw, w, b, y, eps) -> None`` of :func:`_norm_linear_kernel` for one geometry: X (M, K) with row
    stride ``stride_x``, W (N, K) with row stride ``stride_w``, both with unit column stride, Y (M, N) contiguous;
    ``bias_stride``: b's stride, or None (no bias). ``config``: one of :data:`CONFIGS`' form; default autotuned on the
    first launch (the caller keeps that out of CUDA graph capture)."""
    if config is None and interpreting():
        config = _INTERPRETER
    elif config is None and (not autotune_enabled() or deterministic_configs()):
        config = HEURISTIC
    state = {"config": None if config is None else dict(config)}
    buckets = (_cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K))
    meta = dict(INT64=needs_int64((M, K, stride_x, 1), (N, K, stride_w, 1), (M, N, N, 1)),
                HAS_BIAS=bias_stride is not None, ONE_PASS=dtype != torch.float16,
                INPUT_PRECISION=input_precision(dtype, device), UPCAST=interpreting() and dtype == torch.bfloat16)
    strides = (M, N, K, stride_x, stride_w, bias_stride or 0)

    def grid(META):
        return triton.cdiv(N, META["BLOCK_N"]), triton.cdiv(M, META["BLOCK_M"])

    direct = None

    def launch(x, nw, w, b, y, eps):
        nonlocal direct
        args = (x, nw, w, y if b is None else b, y, *strides, float(eps), *buckets)
        if direct is not None:
            direct(args)
            return
        cfg = state["config"]
        if cfg is None:
            tuner = _tuner()
            tuner[grid](*args, **meta)
            state["config"] = _cfg.from_triton(tuner.best_config)
            return
        direct = DirectLaunch(_norm_linear_kernel, grid(cfg), {**meta, **cfg, "EVEN_K": K % cfg["BLOCK_K"] == 0})
        direct(args)

    launch.state = state
    return launch
