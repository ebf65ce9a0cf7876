"""The persistent TMA GEMM kernel: C = act(A @ B + bias), fp32 accumulation, Hopper (sm_90) and newer.

After Triton's tutorial 09: grid = number of SMs, output tiles visited in group-M order, tiles loaded
through device-side TMA tensor descriptors (``tl.make_tensor_descriptor``, which needs
``triton.set_allocator``). Operands need a unit stride and 16-byte aligned base and leading stride
(:func:`tritonmm.core.layout.tma_compatible`). With ``SPLIT_K`` > 1 it visits (tile, split) work units and
reduces like the pointer kernel: fp32 partials, an arrival counter, the last split sums in order and
applies the epilogue.
"""

import triton
import triton.language as tl

from .common import _activation, _group_m_order, _to_output


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
