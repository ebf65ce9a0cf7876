"""The pointer-based GEMM kernel: C = act(A @ B + bias), fp32 accumulation.

The tiled GEMM of Triton's tutorial 03 (group-M program order for L2 reuse), reading any strides
in place, masked for any M, N, K, with a two-level batch folded into grid axis 0 and an optional
split-K over grid axis 1: fp32 partials in a workspace, summed in the same kernel by each tile's
last split to finish (counted with an atomic, as CUTLASS's serial split-K does), which then applies
the epilogue (bias add and activation on the fp32 accumulator) before the one store of C.
"""

import triton
import triton.language as tl

from .common import _activation, _group_m_order, _to_output


@triton.jit
def _matmul_kernel(
    a_ptr,  # (B0, B1, M, K)
    b_ptr,  # (B0, B1, K, N)
    c_ptr,  # (B0, B1, M, N), or (SPLIT_K, M, N) float32 partials when SPLIT_K > 1
    bias_ptr,  # (N,) or a dummy when HAS_BIAS is False
    out_ptr,  # SPLIT_K > 1: the (M, N) contiguous output; else a dummy
    lock_ptr,  # SPLIT_K > 1: int32 arrival counters, one per tile, zero between launches; else a dummy
    M, N, K, B1,
    stride_ab0, stride_ab1, stride_am, stride_ak,
    stride_bb0, stride_bb1, stride_bk, stride_bn,
    stride_cb0, stride_cb1, stride_cm, stride_cn,
    stride_cs, stride_bias,
    M_BUCKET, N_BUCKET, K_BUCKET, LAYOUT,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
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

    if SPLIT_K > 1:  # split-K: the tile's last split to finish reduces
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
