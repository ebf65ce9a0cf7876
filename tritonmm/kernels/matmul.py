"""Triton GEMM kernels and their launchers: C = act(A @ B + bias), fp32 accumulation.

Two kernels:

* ``_matmul_kernel``: the tiled pointer-based GEMM of Triton's tutorial 03 (group-M
  program order for L2 reuse), reading any strides in place, masked for any M, N, K,
  with a two-level batch folded into grid axis 0 and an optional split-K over grid
  axis 1: fp32 partials in a workspace, summed in the same kernel by each tile's last split to
  finish (counted with an atomic; ``REDUCE_LAST``), or by ``_splitk_reduce_kernel``; either applies
  the epilogue after the sum.
* ``_matmul_tma_kernel``: a persistent kernel (grid = number of SMs, tiles visited in
  group-M order) loading tiles through device-side TMA tensor descriptors
  (``tl.make_tensor_descriptor``), after Triton's tutorial 09. Hopper (sm_90) and newer;
  operands need a unit stride and 16-byte aligned base and leading stride.

Both fuse the epilogue: bias add and an activation ("relu", "gelu", "gelu_tanh", "silu")
on the fp32 accumulator before the single store of C.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import _allocation
from triton.runtime import driver as _driver

from .. import workspace
from .._env import autotune_enabled, deterministic_configs, interpreting
from . import configs as _cfg



# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Group-M swizzle (Triton tutorial 03): GROUP_M rows of tiles are visited column by column."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _to_output(acc, dtype, UPCAST: tl.constexpr):
    """fp32 accumulator -> output dtype, rounding to nearest even.

    Under the interpreter (UPCAST) bfloat16 is rounded by hand: its fp32 -> bf16 cast truncates.
    """
    if dtype == tl.float32:  # split-K partial sums stay fp32 (one rounding, after the reduction)
        return acc
    elif UPCAST:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(acc != acc, acc.to(dtype), out)
    else:
        return acc.to(dtype)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """Elementwise activation on fp32 values; NaN propagates as in torch."""
    if ACTIVATION == "relu":
        x = tl.where(x < 0.0, 0.0, x)
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # tanh(inner) = 2 sigmoid(2 inner) - 1 is exactly +-1 in fp32 past |inner| = 20; clamping there
        # changes no result and keeps exp(-2 inner) finite (the interpreter's NumPy warned of overflow)
        inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)
        x = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    return x


# --------------------------------------------------------------------------- pointer kernel


@triton.jit
def _matmul_kernel(
    a_ptr,  # (B0, B1, M, K)
    b_ptr,  # (B0, B1, K, N)
    c_ptr,  # (B0, B1, M, N), or (SPLIT_K, M, N) float32 partials when SPLIT_K > 1
    bias_ptr,  # (N,) or a dummy when HAS_BIAS is False
    out_ptr,  # REDUCE_LAST: the (M, N) contiguous output; else a dummy
    lock_ptr,  # REDUCE_LAST: int32 arrival counters, one per tile, zero between launches; else a dummy
    M, N, K, B1,
    stride_ab0, stride_ab1, stride_am, stride_ak,
    stride_bb0, stride_bb1, stride_bk, stride_bn,
    stride_cb0, stride_cb1, stride_cm, stride_cn,
    stride_cs, stride_bias,
    M_BUCKET, N_BUCKET, K_BUCKET, LAYOUT,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, REDUCE_LAST: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    pid_s = tl.program_id(axis=1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    pid_b = pid // num_tiles
    pid_m, pid_n = _group_m_order(pid % num_tiles, num_pid_m, num_pid_n, GROUP_M)

    # batch offsets are always 64-bit: batch x stride passes 2**31 easily
    b_outer = (pid_b // B1).to(tl.int64)
    b_inner = (pid_b % B1).to(tl.int64)
    a_ptr += b_outer * stride_ab0 + b_inner * stride_ab1
    b_ptr += b_outer * stride_bb0 + b_inner * stride_bb1
    p_ptr = c_ptr  # split-K: partial 0 (one GEMM, so no batch offset)
    c_ptr += b_outer * stride_cb0 + b_inner * stride_cb1 + pid_s.to(tl.int64) * stride_cs

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows/columns past the edge wrap around (in bounds); their results are never stored. The
    # modulo keeps the contiguity Triton needs for wide loads when M/N divide by 16 (tutorial 03)
    offs_am = offs_m % M
    offs_bn = offs_n % N
    if INT64:
        offs_am = offs_am.to(tl.int64)
        offs_bn = offs_bn.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    # this program's K range: all of K, or one of SPLIT_K slices of whole BLOCK_K steps
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.multiple_of(pid_s * k_per_split, BLOCK_K)
    k_len = tl.minimum(K - k_start, k_per_split)
    if INT64:
        k_start = k_start.to(tl.int64)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + (k_start + offs_k[None, :]) * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k[:, None]) * stride_bk + offs_bn[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = k_len - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:  # the interpreter multiplies bfloat16 bit patterns (triton-lang/triton#11584)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        acc = _activation(acc, ACTIVATION)
    offs_cm = offs_m
    offs_cn = offs_n
    if INT64:
        offs_cm = offs_cm.to(tl.int64)
        offs_cn = offs_cn.to(tl.int64)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, _to_output(acc, c_ptr.dtype.element_ty, UPCAST), mask=c_mask)

    if REDUCE_LAST:  # split-K without a second kernel: the tile's last split to finish reduces
        # CTA barrier, then one thread's acq_rel atomic (the semaphore pattern of CUTLASS's serial
        # split-K): every split's partial store is visible once SPLIT_K arrivals are counted
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            offs = offs_cm[:, None] * stride_cm + offs_cn[None, :]
            p_ptrs = p_ptr + offs
            acc = tl.load(p_ptrs, mask=c_mask, other=0.0, cache_modifier=".cg")
            for _ in tl.static_range(1, SPLIT_K):  # partial order 0..SPLIT_K-1: deterministic
                p_ptrs += stride_cs
                acc += tl.load(p_ptrs, mask=c_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            acc = _activation(acc, ACTIVATION)
            tl.store(out_ptr + offs, _to_output(acc, out_ptr.dtype.element_ty, UPCAST), mask=c_mask)
            tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next launch on this stream


@triton.jit
def _splitk_reduce_kernel(
    p_ptr,  # (SPLIT_K, M, N) float32 partial sums, contiguous
    c_ptr,  # (M, N) output, contiguous
    bias_ptr,  # (N,) or a dummy when HAS_BIAS is False
    MN, N, stride_bias,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Split-K epilogue in one pass: C = act(sum of the SPLIT_K partials + bias), rounded once.

    Sums in partial order 0..SPLIT_K-1 (deterministic); 1-D grid over blocks of M*N elements.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    p_ptrs = p_ptr + offs
    acc = tl.load(p_ptrs, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLIT_K):
        p_ptrs += MN  # one partial further; a pointer step, so s * MN never overflows 32 bits
        acc += tl.load(p_ptrs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + (offs % N) * stride_bias, mask=mask, other=0.0).to(tl.float32)
    acc = _activation(acc, ACTIVATION)
    tl.store(c_ptr + offs, _to_output(acc, c_ptr.dtype.element_ty, UPCAST), mask=mask)


# --------------------------------------------------------------------------- TMA persistent kernel


@triton.jit
def _tma_dot_step(a_desc, b_desc, offs_am, offs_bn, offs_k, acc, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr,
                  UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One BLOCK_K step of the TMA kernel: load an A and a B tile (TMA zero-fills past K, M and N: no
    masks) and accumulate their product into ``acc``."""
    if A_TRANS:
        a = a_desc.load([offs_k, offs_am]).T
    else:
        a = a_desc.load([offs_am, offs_k])
    if B_TRANS:
        b = b_desc.load([offs_bn, offs_k]).T
    else:
        b = b_desc.load([offs_k, offs_bn])
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _tma_store_c(acc, c_desc, c_ptr, bias_ptr, offs_am, offs_bn, M, N, stride_cm, stride_bias,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, C_TMA: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr):
    """The TMA kernel's epilogue on one fp32 tile: bias, activation, rounding, store of C."""
    offs_n = offs_bn + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    acc = _activation(acc, ACTIVATION)
    if C_TMA:
        if EPILOGUE_SUBTILE:  # two half-width stores: half the epilogue's shared memory
            acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            c_desc.store([offs_am, offs_bn], _to_output(acc0, c_ptr.dtype.element_ty, UPCAST))
            c_desc.store([offs_am, offs_bn + BLOCK_N // 2], _to_output(acc1, c_ptr.dtype.element_ty, UPCAST))
        else:
            c_desc.store([offs_am, offs_bn], _to_output(acc, c_ptr.dtype.element_ty, UPCAST))
    else:  # C's row stride is not 16-byte aligned: masked pointer store, 64-bit offsets
        offs_m = offs_am + tl.arange(0, BLOCK_M)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptrs, _to_output(acc, c_ptr.dtype.element_ty, UPCAST), mask=c_mask)


@triton.jit
def _matmul_tma_kernel(
    a_ptr,  # (M, K) row-major, or (K, M) row-major storage when A_TRANS
    b_ptr,  # (K, N) row-major, or (N, K) row-major storage when B_TRANS (an nn.Linear weight)
    c_ptr,  # (M, N), unit column stride
    bias_ptr,  # (N,) or a dummy when HAS_BIAS is False
    p_ptr,  # SPLIT_K > 1: (SPLIT_K, M, N) float32 partials, contiguous; else a dummy
    lock_ptr,  # SPLIT_K > 1: int32 arrival counters, one per tile, zero between launches; else a dummy
    M, N, K,
    stride_a, stride_b, stride_cm, stride_bias,  # leading (row) strides in elements
    stride_p,  # elements from one split's partial to the next (M * N; an argument: M or N may be the constant 1)
    M_BUCKET, N_BUCKET, K_BUCKET, SPLIT_POOL,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, SPLIT_K: tl.constexpr, NUM_SMS: tl.constexpr,
    A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, C_TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    if A_TRANS:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1], block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_TRANS:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N])
    if EPILOGUE_SUBTILE:
        C_BLOCK_N: tl.constexpr = BLOCK_N // 2
    else:
        C_BLOCK_N: tl.constexpr = BLOCK_N
    c_desc = c_ptr  # unused when C is stored through pointers
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, C_BLOCK_N])

    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)

    if SPLIT_K == 1:
        for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = _group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
            offs_am = pid_m * BLOCK_M
            offs_bn = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                acc = _tma_dot_step(a_desc, b_desc, offs_am, offs_bn, ki * BLOCK_K, acc,
                                    A_TRANS, B_TRANS, UPCAST, INPUT_PRECISION)
            _tma_store_c(acc, c_desc, c_ptr, bias_ptr, offs_am, offs_bn, M, N, stride_cm, stride_bias,
                         BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE, C_TMA, HAS_BIAS, ACTIVATION, UPCAST)
    else:
        # split-K: work units are (tile, split) pairs, a tile's splits adjacent so they run side by
        # side; each stores an fp32 partial, and the tile's last split to finish (counted with an
        # atomic, as in the pointer kernel) sums the partials in order 0..SPLIT_K-1 and applies the
        # epilogue. For few tiles with a long K (M = 128 rows of a weight): more SMs stream the weight
        k_per_split = tl.cdiv(k_tiles, SPLIT_K)
        for unit in tl.range(start_pid, num_tiles * SPLIT_K, NUM_SMS):
            tile_id = unit // SPLIT_K
            split = unit % SPLIT_K
            pid_m, pid_n = _group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
            offs_am = pid_m * BLOCK_M
            offs_bn = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(split * k_per_split, tl.minimum(split * k_per_split + k_per_split, k_tiles)):
                acc = _tma_dot_step(a_desc, b_desc, offs_am, offs_bn, ki * BLOCK_K, acc,
                                    A_TRANS, B_TRANS, UPCAST, INPUT_PRECISION)
            offs_m = offs_am + tl.arange(0, BLOCK_M)
            offs_n = offs_bn + tl.arange(0, BLOCK_N)
            offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            tl.store(p_ptr + split.to(tl.int64) * stride_p + offs, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is stored before the one atomic below (acq_rel)
            arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                p_ptrs = p_ptr + offs
                acc = tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for _ in tl.static_range(1, SPLIT_K):  # partial order 0..SPLIT_K-1: deterministic
                    p_ptrs += stride_p
                    acc += tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                _tma_store_c(acc, c_desc, c_ptr, bias_ptr, offs_am, offs_bn, M, N, stride_cm, stride_bias,
                             BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE, C_TMA, HAS_BIAS, ACTIVATION, UPCAST)
                tl.atomic_xchg(lock_ptr + tile_id, 0)  # ready for the next launch on this stream


# --------------------------------------------------------------------------- launch helpers


def _hooks_active() -> bool:
    """Whether a launch enter or exit hook (a profiler such as proton) is installed. Triton 3.6 keeps
    hooks in a ``HookChain`` that is never None; older releases use None for "no hook"."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        calls = getattr(hook, "calls", None)
        if (bool(calls) if calls is not None else hook is not None):
            return True
    return False


class _DirectLaunch:
    """Launches of one JIT kernel with fixed constexprs and grid: the first goes through
    ``kernel[grid](...)`` (compiling or finding the binary), later ones call the compiled
    binary's launcher directly, skipping Triton's per-call argument binding and cache lookup
    (tens of µs on a slow host). Safe because a launcher serves one geometry: the engine's
    cache key fixes every integer argument and the 16-byte alignment of every pointer, which
    is all Triton specializes on. Launch hooks (profilers) and the interpreter use the normal path.
    """

    __slots__ = ("fn", "grid", "kwargs", "compiled", "tail")

    def __init__(self, fn, grid: tuple, kwargs: dict):
        self.fn, self.grid, self.kwargs = fn, tuple(grid) + (1,) * (3 - len(grid)), kwargs
        self.compiled = None
        self.tail = None

    def __call__(self, args: tuple) -> None:
        k = self.compiled
        if k is None or _hooks_active():
            k = self.fn[self.grid](*args, **self.kwargs)
            if self.compiled is None and not interpreting() and all(
                    hasattr(k, n) for n in ("run", "function", "packed_metadata")):
                names = self.fn.arg_names[len(args):]
                if all(n in self.kwargs for n in names):
                    self.tail = tuple(self.kwargs[n] for n in names)
                    self.compiled = k
            return
        g0, g1, g2 = self.grid
        stream = _driver.active.get_current_stream(_driver.active.get_current_device())
        k.run(g0, g1, g2, stream, k.function, k.packed_metadata, None, None, None, *args, *self.tail)


_REDUCE_BLOCK = 1024  # elements of C per program of the split-K reduction

SPLITK_REDUCE = "last"
"""How split-K partials are reduced: "last" (in the GEMM kernel, by the last split of each tile to
finish, counted with an atomic; one launch) or "kernel" (a second kernel, :func:`_splitk_reduce_kernel`).
Both sum the partials in the same order, so results are bitwise equal."""

_BIG = 256  # the largest block edge in any config; bounds index overshoot in the INT64 check


def needs_int64(*operands) -> bool:
    """Whether an in-kernel element offset can pass 2**31: operands given as (rows, cols, row stride, col stride)."""
    return any((r + _BIG) * abs(sr) + (c + _BIG) * abs(sc) >= 2**31 for r, c, sr, sc in operands)


def _input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot precision: TF32 for float32 only where torch.matmul would use it (CUDA and allowed)."""
    if dtype == torch.float32 and not (device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"):
        return "ieee"
    return "tf32"


def _early_prune(kernel: str, configs, named_args, **kwargs):
    """``early_config_prune`` for ``triton.autotune``: see :func:`configs.prune`."""
    a, c = named_args["a_ptr"], named_args["c_ptr"]
    smem, sms = _cfg.device_limits(a.device.index if a.device.index is not None else torch.cuda.current_device())
    dicts = [_cfg.from_triton(c_) for c_ in configs]
    out_itemsize = c.element_size() if kernel != "splitk" else a.element_size()
    kept = _cfg.prune(
        dicts, M=named_args["M"], N=named_args["N"], K=named_args["K"], itemsize=a.element_size(),
        out_itemsize=out_itemsize, kernel=kernel, smem_limit=smem, num_sms=sms,
    )
    return [configs[dicts.index(k)] for k in kept]


@functools.cache
def autotuned(kernel: str):
    """The ``@triton.autotune`` wrapper of one kernel, built on first use from ``configs/candidates.json``.

    The key holds bucketed M/N/K (:func:`configs.bucket`), the operand layouts and the
    SM count; Triton adds the tensor dtypes. Results persist on disk in Triton's cache
    (``cache_results=True``), keyed by the Triton version, the GPU target, the kernel
    source and the candidate list, so a change to any of them retunes.
    """
    configs = [_cfg.to_triton(c) for c in _cfg.candidates(kernel)]
    prune = {"early_config_prune": functools.partial(_early_prune, kernel)}
    if kernel == "tma":
        # SPLIT_POOL: which split-K configs pruning kept for this problem. Shapes of one bucket can keep
        # different ones (K = 200 and 256 share a bucket, 4 splits of 64 fit only the second), and the
        # workspace is sized for the pool, so a config tuned on another pool must not be reused
        key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "SPLIT_POOL", "A_TRANS", "B_TRANS", "NUM_SMS"]
        fn = _matmul_tma_kernel
    else:
        key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT"]
        fn = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_matmul_kernel)
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune, cache_results=True)(fn)


_tune_lock = threading.Lock()  # Autotuner.run keeps per-call state on the object
log = logging.getLogger("tritonmm")

LAUNCH_FAILURES = (triton.errors.TritonError,)
"""What a failing config raises (compile errors, out of shared memory or registers, ptxas, an
autotuner left with no runnable config): the engine then serves the call with torch.matmul."""


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (no benchmarking, no syncs allowed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _capture_config(kernel: str, M, N, K, dtype: torch.dtype, device: torch.device) -> dict:
    """A config for a first launch inside CUDA graph capture, where autotuning cannot benchmark."""
    log.debug("%s %dx%dx%d: first launch inside CUDA graph capture, heuristic config", kernel, M, N, K)
    size = dtype.itemsize
    return _cfg.heuristic(kernel, M, N, K, size, size, device)


def _autotune(kernel: str, grid, args, meta) -> dict:
    """Run ``@triton.autotune`` once for this launch; return the winning config.

    Configs that fail to compile or exceed shared memory / registers are skipped by Triton's
    autotuner (timed as inf) and logged here at DEBUG level. If none runs, Triton raises,
    and the caller (the engine) falls back to torch.matmul with a warning.
    """
    tuner = autotuned(kernel)
    with _tune_lock:
        tuner[grid](*args, **meta)
        timings = dict(getattr(tuner, "configs_timings", None) or {})
        best = tuner.best_config
    for config, ms in timings.items():
        bad = ms if isinstance(ms, float) else (ms[0] if ms else float("inf"))
        if bad == float("inf"):
            log.debug("%s: config %s failed to compile or run; skipped", kernel, config)
    return _cfg.from_triton(best)


def _torch_alloc(size: int, alignment: int, stream):
    """Scratch memory for device-side TMA descriptors, from torch's caching allocator (current device)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


def _ensure_allocator() -> None:
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_alloc)


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (132 on an H200); 4 under the interpreter."""
    if device.type != "cuda":
        return 4
    return _cfg.device_limits(device.index if device.index is not None else torch.cuda.current_device())[1]


def _fixed_config(kernel: str, config, M, N, K, dtype: torch.dtype, device: torch.device):
    """The config to launch without autotuning, or None to autotune.

    An explicit config wins; under the interpreter, its single config; with
    ``TRITONMM_AUTOTUNE=0``, the quantization heuristic's pick.
    """
    if config is not None:
        return _cfg.complete(kernel, config)
    if interpreting():
        return _cfg.interpreter_config(kernel)
    if not autotune_enabled() or deterministic_configs():
        size = dtype.itemsize
        return _cfg.heuristic(kernel, M, N, K, size, size, device)
    return None


# --------------------------------------------------------------------------- launchers
#
# A launcher is built once per problem geometry (sizes, strides, dtype, epilogue) and then
# only receives the tensors: the per-call cost is one Triton launch. Before its first launch
# an autotuned launcher runs @triton.autotune; afterwards it launches the chosen config directly.


def pointer_launcher(M, N, K, B0, B1, sa, sb, sc, dtype, device, bias_stride=None, activation="none",
                     config=None, split_k=False):
    """A launcher ``(a, b, c, bias) -> None`` of the pointer kernel for one problem geometry.

    Args:
        M, N, K, B0, B1 (int): GEMM sizes and the two batch levels.
        sa, sb, sc (tuple): 4 strides (batch0, batch1, row, col) in elements of A (B0, B1, M, K),
            B (B0, B1, K, N) and C (B0, B1, M, N); the tensors passed later point at element 0.
        dtype, device: of A, B and C.
        bias_stride (int, optional): the (N,) bias's stride; None: no bias.
        activation (str): one of :data:`tritonmm.activations.ACTIVATIONS`.
        config (dict, optional): explicit config; default: autotuned (GPU), the interpreter's, or the heuristic's.
        split_k (bool): split K over ``SPLIT_K`` programs; their fp32 partials go to a workspace and
            are summed, then the epilogue applied, by each tile's last split (:data:`SPLITK_REDUCE`
            "last", one launch) or by a second kernel ("kernel"); needs B0 = B1 = 1.
    """
    kernel = "splitk" if split_k else "pointer"
    state = {"config": _fixed_config(kernel, config, M, N, K, dtype, device)}
    if split_k:
        assert B0 == 1 and B1 == 1, "split-K takes one GEMM"
        if config is not None and config.get("SPLIT_K", 1) < 2:  # the epilogue would run twice
            raise ValueError(f"a split-K config needs SPLIT_K >= 2 (one split is the pointer kernel), got {config}")
        sc = (0, 0, N, 1)
    int64 = needs_int64((M, K, sa[2], sa[3]), (K, N, sb[2], sb[3]), (M, N, sc[2], sc[3]))
    layout = int(sa[3] != 1) | (int(sb[3] != 1) << 1)
    ints = (M, N, K, B1, *sa, *sb, *sc, M * N if split_k else 0, bias_stride or 0,
            _cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K), layout)
    reduce_last = split_k and SPLITK_REDUCE == "last"
    meta = dict(INT64=int64, HAS_BIAS=bias_stride is not None,
                ACTIVATION=activation if reduce_last or not split_k else "none",
                INPUT_PRECISION=_input_precision(dtype, device),
                UPCAST=interpreting() and dtype == torch.bfloat16, REDUCE_LAST=reduce_last)
    if not split_k:
        meta["SPLIT_K"] = 1
    tiles = B0 * B1

    def tile_count(x) -> int:  # tiles of config x: one arrival counter each
        return triton.cdiv(M, x["BLOCK_M"]) * triton.cdiv(N, x["BLOCK_N"])

    def grid(META):
        return (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]) * tiles, META.get("SPLIT_K", 1))

    def launch(a, b, c, bias):
        cfg = state["config"]
        if cfg is None and capturing(c.device):
            cfg = state["config"] = _capture_config(kernel, M, N, K, dtype, device)
        target = locks = c
        if split_k:  # fp32 partials live in the reused workspace (no per-call allocation)
            splits = cfg["SPLIT_K"] if cfg else max(x["SPLIT_K"] for x in _cfg.candidates("splitk"))
            (target,) = workspace.buffers(c.device, [((splits, M, N), torch.float32)], slot="splitk")
            if reduce_last:
                if cfg is None:  # autotuning: any candidate may run
                    n_locks = max(map(tile_count, _cfg.candidates("splitk")))
                else:  # the config is fixed from here on: counted once
                    n_locks = state.get("n_locks")
                    if n_locks is None:
                        n_locks = state["n_locks"] = tile_count(cfg)
                locks = workspace.counters(c.device, n_locks)
        args = (a, b, target, bias if bias is not None else target, c, locks, *ints)
        if cfg is None:
            cfg = state["config"] = _autotune(kernel, grid, args, meta)
        else:
            direct = state.get("direct")
            if direct is None:
                direct = state["direct"] = _DirectLaunch(_matmul_kernel, grid({**cfg, **meta}),
                                                         {**meta, **cfg, "EVEN_K": K % cfg["BLOCK_K"] == 0})
            direct(args)
        if split_k and not reduce_last:  # one fused pass: sum of the partials, bias, activation, rounding
            reduce = state.get("reduce")
            if reduce is None:  # built after the first launch, when the config (and its SPLIT_K) is fixed
                reduce = state["reduce"] = _DirectLaunch(
                    _splitk_reduce_kernel, (triton.cdiv(M * N, _REDUCE_BLOCK),),
                    dict(SPLIT_K=cfg["SPLIT_K"], BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias_stride is not None,
                         ACTIVATION=activation, UPCAST=meta["UPCAST"], num_warps=4))
            reduce((target, c, bias if bias is not None else target, M * N, N, bias_stride or 0))

    launch.state = state
    return launch


def tma_launcher(M, N, K, a_trans, stride_a, b_trans, stride_b, dtype, device, bias_stride=None,
                 activation="none", config=None):
    """A launcher ``(a, b, c, bias) -> None`` of the persistent TMA kernel for one 2-D problem.

    Args:
        M, N, K (int): GEMM sizes.
        a_trans, stride_a: A is read as (M, K) row-major with row stride ``stride_a`` elements, or,
            when ``a_trans``, through its (K, M) row-major storage (see :func:`tma_layout`).
        b_trans, stride_b: likewise for B (K, N); ``b_trans`` reads an (N, K) nn.Linear weight in place.
        dtype, device, bias_stride, activation, config: as in :func:`pointer_launcher`. A config with
            ``SPLIT_K`` >= 2 splits K: (SPLIT_K, M, N) fp32 partials in the workspace (slot
            "splitk"), summed with the epilogue by each tile's last split; without ``SPLIT_K``, 1.
        C is a contiguous (M, N) tensor; it is stored through TMA when its rows are 16-byte aligned.
    """
    state = {"config": _fixed_config("tma", config, M, N, K, dtype, device)}
    sms = num_sms(device)
    esize = torch.tensor([], dtype=dtype).element_size()
    pool, split_pool = [], 0
    if state["config"] is None:  # autotuning: the candidates pruning keeps, as @triton.autotune will
        index = device.index if device.index is not None else torch.cuda.current_device()
        pool = _cfg.prune(_cfg.candidates("tma"), M=M, N=N, K=K, itemsize=esize, out_itemsize=esize, kernel="tma",
                          smem_limit=_cfg.device_limits(index)[0], num_sms=sms)
        split_pool = _cfg.split_pool_key("tma", pool)
    ints = (M, N, K, stride_a, stride_b, N, bias_stride or 0, M * N, _cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K),
            split_pool)
    meta = dict(NUM_SMS=sms, A_TRANS=a_trans, B_TRANS=b_trans, C_TMA=(N * esize) % 16 == 0,
                HAS_BIAS=bias_stride is not None, ACTIVATION=activation,
                INPUT_PRECISION=_input_precision(dtype, device), UPCAST=interpreting() and dtype == torch.bfloat16)

    def tiles(x) -> int:
        return triton.cdiv(M, x["BLOCK_M"]) * triton.cdiv(N, x["BLOCK_N"])

    def grid(META):
        return (min(sms, tiles(META) * META["SPLIT_K"]),)

    def scratch(cfg, device):
        """(partials, counters) for a launch of ``cfg`` (None: autotuning, any config of the pool may run)."""
        split = [x for x in ([cfg] if cfg is not None else pool) if x["SPLIT_K"] > 1]
        if not split:
            return None, None
        (partials,) = workspace.buffers(device, [((max(x["SPLIT_K"] for x in split), M, N), torch.float32)],
                                        slot="splitk")
        return partials, workspace.counters(device, max(map(tiles, split)))

    def launch(a, b, c, bias):
        _ensure_allocator()
        cfg = state["config"]
        if cfg is None and capturing(c.device):
            cfg = state["config"] = _capture_config("tma", M, N, K, dtype, device)
        partials, locks = scratch(cfg, c.device) if cfg is None or cfg["SPLIT_K"] > 1 else (None, None)
        args = (a, b, c, bias if bias is not None else c, c if partials is None else partials,
                c if locks is None else locks, *ints)
        if cfg is None:
            state["config"] = _autotune("tma", grid, args, meta)
        else:
            direct = state.get("direct")
            if direct is None:
                direct = state["direct"] = _DirectLaunch(_matmul_tma_kernel, grid(cfg), {**meta, **cfg})
            direct(args)

    launch.state = state
    return launch


def launch_pointer(a4, b4, c4, bias=None, activation="none", config=None, split_k=False):
    """C4 = act(A4 @ B4 + bias) with the pointer kernel, for (B0, B1, M, K) @ (B0, B1, K, N) views.

    Returns:
        dict: the config that ran (for autotuned launches, the autotuner's choice).
    """
    B0, B1, M, K = a4.shape
    launch = pointer_launcher(M, b4.shape[-1], K, B0, B1, a4.stride(), b4.stride(), c4.stride(), a4.dtype,
                              a4.device, None if bias is None else bias.stride(0), activation, config, split_k)
    launch(a4, b4, c4, bias)
    return launch.state["config"]


def launch_tma(a2, b2, c2, bias=None, activation="none", config=None):
    """C2 = act(A2 @ B2 + bias) with the TMA kernel; A2 (M, K) and B2 (K, N) accepted by :func:`tma_compatible`,
    C2 a contiguous (M, N) tensor.

    Returns:
        dict: the config that ran.
    """
    (M, K), N = a2.shape, b2.shape[1]
    a_trans, stride_a = tma_layout(a2)
    b_trans, stride_b = tma_layout(b2)
    launch = tma_launcher(M, N, K, a_trans, stride_a, b_trans, stride_b, a2.dtype, a2.device,
                          None if bias is None else bias.stride(0), activation, config)
    launch(a2, b2, c2, bias)
    return launch.state["config"]


def _is_col_major(t: torch.Tensor) -> bool:
    """Whether a 2-D operand is read with unit stride along dim 0 (a transposed view)."""
    if t.stride(1) == 1 and t.shape[1] != 1:
        return False
    return t.stride(0) == 1 or t.shape[0] == 1 or t.stride(1) != 1


def tma_layout(t: torch.Tensor) -> tuple[bool, int]:
    """(transposed, leading stride in elements) of a 2-D operand as a TMA descriptor sees it.

    A transposed operand is described over its storage, shape (cols, rows). Where the
    leading dim has size 1 its stride is never used and an aligned stand-in is returned.
    """
    col = _is_col_major(t)
    inner, outer = (t.shape[0], t.shape[1]) if col else (t.shape[1], t.shape[0])
    lead = t.stride(1) if col else t.stride(0)
    if outer == 1:
        per16 = 16 // t.element_size()
        lead = -(-max(inner, 1) // per16) * per16
    return col, lead


def tma_compatible(t: torch.Tensor) -> bool:
    """Whether TMA can read a 2-D operand in place: a unit stride in one dim, and a 16-byte
    aligned base address and leading stride (CUDA ``cuTensorMapEncodeTiled`` rules)."""
    if t.data_ptr() % 16:
        return False
    col, lead = tma_layout(t)
    inner = t.shape[0] if col else t.shape[1]
    unit = t.stride(0) if col else t.stride(1)
    if unit != 1 and inner > 1:
        return False
    return lead > 0 and (lead * t.element_size()) % 16 == 0


def tma_copy_layout(t: torch.Tensor) -> tuple[bool, int]:
    """The :func:`tma_layout` of :func:`tma_view`'s aligned copy of ``t``, without copying."""
    col = _is_col_major(t)
    inner = t.shape[0] if col else t.shape[1]
    per16 = 16 // t.element_size()
    return col, -(-max(inner, 1) // per16) * per16


def tma_copy_shape(t: torch.Tensor) -> tuple[int, int]:
    """(rows, padded row length) of the buffer :func:`tma_view` copies ``t`` into."""
    col, lead = tma_copy_layout(t)
    return (t.shape[1] if col else t.shape[0]), lead


def tma_view(t: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` itself when TMA can read it, else a copy with 16-byte aligned rows (same major order).

    The copy lives in a buffer whose rows are padded to a multiple of 16 bytes and is
    returned as a view of the exact shape; the descriptor's bounds keep the padding
    unread, so results are exact. Extra memory: the operand's size plus < 16 bytes a row.

    Args:
        t (Tensor): 2-D operand.
        buf (Tensor, optional): a contiguous, 16-byte aligned buffer of :func:`tma_copy_shape`
            and ``t``'s dtype to copy into (e.g. from :mod:`tritonmm.workspace`); default: a new one.
    """
    if tma_compatible(t):
        return t
    col = _is_col_major(t)
    src = t.mT if col else t  # (outer, inner), unit stride along inner once copied
    inner = src.shape[1]
    if buf is None:
        buf = torch.empty(tma_copy_shape(t), dtype=t.dtype, device=t.device)
    buf = buf[:, :inner]
    buf.copy_(src)
    return buf.mT if col else buf


def tma_copier(t: torch.Tensor):
    """A function ``(x, buf) -> view`` doing :func:`tma_view`'s copy for operands of ``t``'s geometry.

    :func:`tritonmm.kernels.copy.copier` (one Triton pass on CUDA and under the interpreter, torch's
    ``copy_`` elsewhere), built once per geometry. ``buf`` is as in :func:`tma_view`.
    """
    from . import copy as copy_kernel

    col = _is_col_major(t)
    src = t.mT if col else t
    rows, inner = src.shape
    pc = copy_kernel.copier((rows, inner), src.stride(), (rows, inner), tma_copy_shape(t)[1], t.device)

    def copy(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        pc(x.mT if col else x, buf)
        view = buf[:, :inner]
        return view.mT if col else view

    return copy
