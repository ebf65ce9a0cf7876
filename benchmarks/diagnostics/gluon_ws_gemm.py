"""Probe: a warp-specialized persistent GEMM for Hopper written in Gluon (``triton.experimental.gluon``), plain and
gated on packed [Wg; Wu] weights, against cuBLAS. One loader warp issues the TMA loads of a STAGES-deep ring;
the consumer partition (``num_warps`` warps) issues the WGMMAs, keeping one k-step in flight, frees each stage
through an mbarrier, and runs the epilogue while the loader already fetches the next tile; in the ping-pong configs
(``pp_``) two consumers of one warpgroup each take turns, one's main loop running while the other's epilogue does.
Each tile has two accumulators of (BLOCK_M, HALF): plain, columns [n, n + HALF) and [n + HALF, n + 2 HALF) of one
output tile; gated, the gate and up projections of the same HALF columns, so the epilogue computes act(G) * U in
registers and stores H once (each projection rounded to the output dtype first, as eager does).
The backward kernel is a fused MLP's down-projection input gradient dH = dY @ Wd with the SiLU product's backward as
its epilogue: the loader also fetches the tile's G and U, the epilogue stores dG, dU and H (for the down weight's
gradient) and dH is never stored; it is timed against cuBLAS's dH and tritonmm's one gradient pass. In the
``bwd_async`` configs the epilogue stores dG and dU from G's and U's buffers and awaits none of its stores: they drain
during the next tile's WGMMAs, which free the buffers at k-step ``release_at``; the loader fetches the next G and U
then (the other configs' epilogue awaits each of its three stores, 96 KB a 128 x 128 tile, while the Tensor Cores
idle).

The question it answers: whether warp specialization brings the GEMM under the fused MLP to cuBLAS's speed on an
H100/H200, where the Triton TMA kernel reaches 0.93-0.99x (``h200.json``, ``h100_gated_packed_variants.json``).
On an H100 (``h100_gluon_ws_gemm.json``), every config checks right; the best, 128 x (2 x 128) with 4 stages, runs
the gated GEMM at 0.99-1.00x the cuBLAS GEMM on [Wg; Wu] at Llama-3-8B widths and M >= 4096 (0.96x TinyLlama's,
0.91x at 512 rows), 1.01-1.07x the shipped Triton kernel; plain, 1.08x cuBLAS at 8192^3 and 0.92x at 4096^3. The
backward kernel with awaited stores runs at 0.95-1.01x cuBLAS's dH plus the one gradient pass: it does not pay.
On the H200 (``h200_gluon_ws_gemm.json``) every config checks right too, and none pays: the best gated config runs
at 0.97x the cuBLAS GEMM on [Wg; Wu] at 8B widths, 4096 rows (0.99x the shipped Triton kernel), 1.04x at 16384 rows
(1.00x the shipped kernel); plain 1.04x cuBLAS at 8192^3, 0.90x at 4096^3; the backward configs whose stores drain
during the next tile (``bwd_async``) 0.92-0.97x the cuBLAS dH plus the gradient pass at M >= 4096, 0.89x at 512.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/gluon_ws_gemm.py           (GPU: checks, then timings; writes
                                                                              $OUT/gluon_ws_gemm.json)
    python3 benchmarks/diagnostics/gluon_ws_gemm.py --compile-only           (no GPU: compiles for sm_90)

Written against triton 3.6's Gluon API (the GPU hosts'): ``gl.warp_specialize`` changed its arguments after it.
The 128 x (2 x 128) tile with 4 stages holds 229,572 bytes of shared memory, 168 registers per thread, no spills
(``--compile-only`` prints each config's). The checks run in a child process with a timeout: a wrong mbarrier
phase hangs the GPU rather than failing.
"""
import argparse
import json
import os
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _tile_coords(tile, M, N, BLOCK_M: gl.constexpr, HALF: gl.constexpr, GATED: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """Group-M order; the rows of the weight feeding the two accumulators and the output column of the tile."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    width: gl.constexpr = HALF if GATED else 2 * HALF
    num_pid_n = gl.cdiv(N, width)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_m
    pid_n = (tile % in_group) // group_m
    off_n = pid_n * width
    off_hi = N + off_n if GATED else off_n + HALF
    return pid_m * BLOCK_M, off_n, off_hi


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, lo_bufs, hi_bufs, ready, empty, M, N, K,
                    GATED: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    width: gl.constexpr = HALF if GATED else 2 * HALF
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, width)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        off_m, off_lo, off_hi = _tile_coords(tile, M, N, BLOCK_M, HALF, GATED, GROUP_M)
        for k in range(0, K, BLOCK_K):
            s = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(empty.index(s), phase ^ 1)  # (barriers start with phase 1 complete: the ring is free)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_lo, k], bar, lo_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_hi, k], bar, hi_bufs.index(s))
            it += 1


@gluon.jit
def _mma_partition(a_bufs, lo_bufs, hi_bufs, ready, empty, order, c_desc, c_smem, M, N, K, GATED: gl.constexpr,
                   GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, WHICH: gl.constexpr, CONSUMERS: gl.constexpr):
    """The WGMMAs and the epilogue of every CONSUMERS-th tile of this program from its WHICH-th. Ping-pong (two
    consumers): the loader's ring is in tile order and the main loops take turns through the ``order`` barriers, so
    one consumer's main loop runs while the other's epilogue does; the turns also keep a consumer from waiting on a
    ring position two phases ahead of the barrier's (a parity wait cannot tell those apart)."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    HALF: gl.constexpr = lo_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    width: gl.constexpr = HALF if GATED else 2 * HALF
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                     instr_shape=[16, HALF, 16])
    dtype: gl.constexpr = c_desc.dtype
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, width)
    pid = gl.program_id(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    for local in range(WHICH, gl.cdiv(num_tiles - pid, NUM_SMS), CONSUMERS):
        off_m, off_lo, off_hi = _tile_coords(pid + local * NUM_SMS, M, N, BLOCK_M, HALF, GATED, GROUP_M)
        lo = gl.zeros((BLOCK_M, HALF), dtype=gl.float32, layout=layout)
        hi = gl.zeros((BLOCK_M, HALF), dtype=gl.float32, layout=layout)
        it = local * k_steps  # (the ring position of this tile's first k-step: the loader fills it in tile order)
        first = it
        if CONSUMERS > 1:  # (consumer 0 goes first: a fresh barrier's phase 1 counts as complete)
            mbarrier.wait(order.index(WHICH), ((local // CONSUMERS) & 1) ^ (1 - WHICH))
        for k in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s)
            lo = warpgroup_mma(a, lo_bufs.index(s).permute((1, 0)), lo, is_async=True)
            hi = warpgroup_mma(a, hi_bufs.index(s).permute((1, 0)), hi, is_async=True)
            lo, hi = warpgroup_mma_wait(num_outstanding=2, deps=(lo, hi))  # the previous k-step's pair is done
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > first)
            it += 1
        lo, hi = warpgroup_mma_wait(num_outstanding=0, deps=(lo, hi))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > first)
        if CONSUMERS > 1:
            mbarrier.arrive(order.index(1 - WHICH), count=1)  # the other consumer's turn
        if GATED:
            g = lo.to(dtype).to(gl.float32)  # each projection rounded, as eager's GEMMs round them
            u = hi.to(dtype).to(gl.float32)
            act = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)  # SiLU, rounded as eager's kernel rounds it
            tma.store_wait(0)  # (the previous tile's store has read c_smem)
            c_smem.store((act * u).to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_lo], c_smem)
        else:
            tma.store_wait(0)
            c_smem.store(lo.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_lo], c_smem)
            tma.store_wait(0)
            c_smem.store(hi.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_hi], c_smem)
    tma.store_wait(0)


@gluon.jit
def _ws_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, GATED: gl.constexpr, GROUP_M: gl.constexpr,
                    NUM_SMS: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, LOAD_REGS: gl.constexpr,
                    MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(STAGES >= 2, "a stage is freed one k-step late: one stage would deadlock")
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    lo_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, HALF, BLOCK_K], b_desc.layout)
    hi_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, HALF, BLOCK_K], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_mma_partition, (a_bufs, lo_bufs, hi_bufs, ready, empty, order, c_desc, c_bufs.index(0), M, N, K, GATED,
                              GROUP_M, NUM_SMS, 0, 1)),
            (_load_partition, (a_desc, b_desc, a_bufs, lo_bufs, hi_bufs, ready, empty, M, N, K, GATED, GROUP_M,
                               NUM_SMS))], [1], [LOAD_REGS])
    else:  # ping-pong: a second consumer of num_warps warps takes every other tile
        gl.warp_specialize([
            (_mma_partition, (a_bufs, lo_bufs, hi_bufs, ready, empty, order, c_desc, c_bufs.index(0), M, N, K, GATED,
                              GROUP_M, NUM_SMS, 0, 2)),
            (_mma_partition, (a_bufs, lo_bufs, hi_bufs, ready, empty, order, c_desc, c_bufs.index(1), M, N, K, GATED,
                              GROUP_M, NUM_SMS, 1, 2)),
            (_load_partition, (a_desc, b_desc, a_bufs, lo_bufs, hi_bufs, ready, empty, M, N, K, GATED, GROUP_M,
                               NUM_SMS))], [num_warps, 1], [MMA_REGS, LOAD_REGS])


@gluon.jit
def _fetch_gu(g_desc, u_desc, g_smem, u_smem, epi_ready, epi_empty, off_m, off_n, t):
    """Tile t's G and U into their buffers once the consumer has freed them."""
    mbarrier.wait(epi_empty, (t & 1) ^ 1)  # (a fresh barrier's phase 1 counts as complete: tile 0 passes)
    mbarrier.expect(epi_ready, 2 * g_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(g_desc, [off_m, off_n], epi_ready, g_smem)
    tma.async_copy_global_to_shared(u_desc, [off_m, off_n], epi_ready, u_smem)


@gluon.jit
def _bwd_load_partition(dy_desc, wd_desc, g_desc, u_desc, a_bufs, b_bufs, g_smem, u_smem, ready, empty, epi_ready,
                        epi_empty, M, N, K, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, RELEASE_AT: gl.constexpr):
    """The k-steps' dY and Wd tiles into the ring and each tile's G and U into their buffers: before the tile's
    k-steps (RELEASE_AT < 0), or once k-step ``min(release + STAGES - 1, k_steps - 1)`` is loaded, the consumer
    freeing the buffers (its previous tile's stores from them done) in k-step ``release = min(RELEASE_AT,
    k_steps - 1)``: loading that later k-step needs the slot the consumer frees right after, so the wait rarely
    blocks and the ring stays full."""
    BLOCK_M: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = wd_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    nbytes: gl.constexpr = dy_desc.block_type.nbytes + wd_desc.block_type.nbytes
    k_steps = gl.cdiv(K, BLOCK_K)
    fetch_at = gl.minimum(gl.minimum(RELEASE_AT, k_steps - 1) + STAGES - 1, k_steps - 1)
    it = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        off_m, off_n, _ = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, True, GROUP_M)
        if RELEASE_AT < 0:  # (the previous tile's epilogue has read G and U)
            _fetch_gu(g_desc, u_desc, g_smem, u_smem, epi_ready, epi_empty, off_m, off_n, t)
        for k in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(dy_desc, [off_m, k], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(wd_desc, [k, off_n], bar, b_bufs.index(s))
            if RELEASE_AT >= 0:
                if k // BLOCK_K == fetch_at:  # (the consumer frees G and U's buffers in k-step release)
                    _fetch_gu(g_desc, u_desc, g_smem, u_smem, epi_ready, epi_empty, off_m, off_n, t)
            it += 1
        t += 1


@gluon.jit
def _bwd_mma_partition(a_bufs, b_bufs, g_smem, u_smem, c_smem, ready, empty, epi_ready, epi_empty, dg_desc, du_desc,
                       h_desc, M, N, K, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, RELEASE_AT: gl.constexpr,
                       num_warps: gl.constexpr):
    """The dH WGMMAs and the epilogue. RELEASE_AT < 0: G and U read, their buffers freed, then dG, dU and H stored
    through one buffer, each store awaited before the next. RELEASE_AT >= 0: dG and dU stored from G's and U's
    buffers and H from the third, none awaited; in the next tile's k-step ``min(RELEASE_AT, k_steps - 1)`` the
    stores are awaited and the buffers freed, so that they drain while the WGMMAs run."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    dtype: gl.constexpr = h_desc.dtype
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    release = gl.minimum(RELEASE_AT, gl.cdiv(K, BLOCK_K) - 1)
    it = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        off_m, off_n, _ = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, True, GROUP_M)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        first = it
        for k in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
            if RELEASE_AT >= 0:
                if (k // BLOCK_K == release) & (t > 0):  # the previous tile's stores, drained behind the WGMMAs
                    tma.store_wait(0)
                    mbarrier.arrive(epi_empty, count=1)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > first)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > first)
        # the gated product's backward, rounded where eager's kernels round: dH, act(G), dU, the product's gradient
        mbarrier.wait(epi_ready, t & 1)
        g = g_smem.load(layout).to(gl.float32)
        u = u_smem.load(layout).to(gl.float32)
        if RELEASE_AT < 0:
            fence_async_shared()  # (the loader's next TMA writes G and U after these reads)
            mbarrier.arrive(epi_empty, count=1)
        dh = acc.to(dtype).to(gl.float32)
        sig = 1.0 / (1.0 + gl.exp(-g))
        a = (g * sig).to(dtype).to(gl.float32)
        d_act = (dh * u).to(dtype).to(gl.float32)
        dg = (d_act * (sig * (1.0 + g * (1.0 - sig)))).to(dtype)
        du = (dh * a).to(dtype)
        h = (a * u).to(dtype)  # (for the down weight's gradient)
        if RELEASE_AT >= 0:  # G and U are in registers: their buffers take dG and dU, the third H (the last
            # tile's stores from them were awaited in this tile's k-loop)
            g_smem.store(dg)
            u_smem.store(du)
            c_smem.store(h)
            fence_async_shared()
            tma.async_copy_shared_to_global(dg_desc, [off_m, off_n], g_smem)
            tma.async_copy_shared_to_global(du_desc, [off_m, off_n], u_smem)
            tma.async_copy_shared_to_global(h_desc, [off_m, off_n], c_smem)
        else:
            tma.store_wait(0)
            c_smem.store(dg)
            fence_async_shared()
            tma.async_copy_shared_to_global(dg_desc, [off_m, off_n], c_smem)
            tma.store_wait(0)
            c_smem.store(du)
            fence_async_shared()
            tma.async_copy_shared_to_global(du_desc, [off_m, off_n], c_smem)
            tma.store_wait(0)
            c_smem.store(h)
            fence_async_shared()
            tma.async_copy_shared_to_global(h_desc, [off_m, off_n], c_smem)
        t += 1
    tma.store_wait(0)


@gluon.jit
def _ws_gated_backward_kernel(dy_desc, wd_desc, g_desc, u_desc, dg_desc, du_desc, h_desc, M, N, K,
                              GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, STAGES: gl.constexpr,
                              LOAD_REGS: gl.constexpr, RELEASE_AT: gl.constexpr, num_warps: gl.constexpr):
    """dG, dU and H (M, N each; dG and dU the halves of one (M, 2N) tensor) from dY (M, K) @ Wd (K, N) and the
    forward's G and U (the halves of [G | U]): descriptors over each half, so partial tiles stop at N."""
    gl.static_assert(STAGES >= 2, "a stage is freed one k-step late: one stage would deadlock")
    BLOCK_M: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = wd_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(wd_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], wd_desc.layout)
    g_smem = gl.allocate_shared_memory(g_desc.dtype, g_desc.block_type.shape, g_desc.layout)
    u_smem = gl.allocate_shared_memory(u_desc.dtype, u_desc.block_type.shape, u_desc.layout)
    c_smem = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape, h_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_empty, count=1)
    gl.warp_specialize([
        (_bwd_mma_partition, (a_bufs, b_bufs, g_smem, u_smem, c_smem, ready, empty, epi_ready, epi_empty, dg_desc,
                              du_desc, h_desc, M, N, K, GROUP_M, NUM_SMS, RELEASE_AT, num_warps)),
        (_bwd_load_partition, (dy_desc, wd_desc, g_desc, u_desc, a_bufs, b_bufs, g_smem, u_smem, ready, empty,
                               epi_ready, epi_empty, M, N, K, GROUP_M, NUM_SMS, RELEASE_AT)),
    ], [1], [LOAD_REGS])


def _descs(x, w, out, BLOCK_M, HALF, BLOCK_K):
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))
    return desc(x, [BLOCK_M, BLOCK_K]), desc(w, [HALF, BLOCK_K]), desc(out, [BLOCK_M, HALF])


CONFIGS = {  # name: ws_gemm keywords (maxnreg: registers per thread of every warp, the loader's warpgroup included;
    # pp: ping-pong, two consumers of num_warps warps each, mma_regs each after the registers' reallocation)
    "128x2x128_s3_w8": dict(BLOCK_M=128, HALF=128, BLOCK_K=64, STAGES=3, num_warps=8, maxnreg=168),
    "128x2x128_s4_w8": dict(BLOCK_M=128, HALF=128, BLOCK_K=64, STAGES=4, num_warps=8, maxnreg=168),
    "128x2x128_s4_w8_g4": dict(BLOCK_M=128, HALF=128, BLOCK_K=64, STAGES=4, num_warps=8, maxnreg=168, GROUP_M=4),
    "128x2x128_s4_w8_g16": dict(BLOCK_M=128, HALF=128, BLOCK_K=64, STAGES=4, num_warps=8, maxnreg=168, GROUP_M=16),
    "128x2x64_s6_w4": dict(BLOCK_M=128, HALF=64, BLOCK_K=64, STAGES=6, num_warps=4, maxnreg=232),
    "pp_64x2x128_s4_w4": dict(BLOCK_M=64, HALF=128, BLOCK_K=64, STAGES=4, num_warps=4, consumers=2, maxnreg=168,
                              mma_regs=216),
    "pp_128x2x64_s5_w4": dict(BLOCK_M=128, HALF=64, BLOCK_K=64, STAGES=5, num_warps=4, consumers=2, maxnreg=168,
                              mma_regs=216),
}


def ws_gemm(x, w, out, gated, BLOCK_M=128, HALF=128, BLOCK_K=64, GROUP_M=8, STAGES=3, num_warps=8, consumers=1,
            load_regs=40, mma_regs=232, maxnreg=168, num_sms=None):
    """out = x @ w^T (plain: w (N, K), out (M, N)) or act(x @ Wg^T) * (x @ Wu^T) (gated: w = [Wg; Wu] (2N, K),
    out (M, N)); x (M, K); bf16 or fp16, contiguous, 16-byte aligned rows."""
    M, K = x.shape
    N = out.shape[1]
    num_sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, HALF if gated else 2 * HALF)
    a, b, c = _descs(x, w, out, BLOCK_M, HALF, BLOCK_K)
    _ws_gemm_kernel[(min(num_sms, tiles),)](a, b, c, M, N, K, gated, GROUP_M, num_sms, STAGES, consumers, load_regs,
                                            mma_regs, num_warps=num_warps, maxnreg=maxnreg)


def _bwd_descs(dy, wd, gu, dgu, h, BLOCK_M, BLOCK_N, BLOCK_K):
    dt = gl.bfloat16 if dy.dtype == torch.bfloat16 else gl.float16

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))
    N = wd.shape[1]
    tile = [BLOCK_M, BLOCK_N]
    return (desc(dy, [BLOCK_M, BLOCK_K]), desc(wd, [BLOCK_K, BLOCK_N]), desc(gu[:, :N], tile), desc(gu[:, N:], tile),
            desc(dgu[:, :N], tile), desc(dgu[:, N:], tile), desc(h, tile))


BWD_CONFIGS = {  # release_at: the k-step of the next tile in which the epilogue's stores are awaited (-1: in the
    # epilogue, one buffer)
    "bwd_128x128_s3_w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, maxnreg=168),
    "bwd_128x128_s4_w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, num_warps=8, maxnreg=168),
    "bwd_async4_128x128_s4_w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, num_warps=8, maxnreg=168,
                                     release_at=4),
    "bwd_async16_128x128_s4_w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, num_warps=8, maxnreg=168,
                                      release_at=16),
}


def ws_gated_backward(dy, wd, gu, dgu, h, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, STAGES=4, num_warps=8,
                      load_regs=40, maxnreg=168, num_sms=None, release_at=-1):
    """A fused MLP's down-projection backward with the SiLU product's: from dY (M, K), Wd (K, N) and the forward's
    [G | U] (M, 2N), writes [dG | dU] (M, 2N) and H = act(G) * U (M, N); dH = dY @ Wd is never stored."""
    M, K = dy.shape
    N = wd.shape[1]
    num_sms = num_sms or torch.cuda.get_device_properties(dy.device).multi_processor_count
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    descs = _bwd_descs(dy, wd, gu, dgu, h, BLOCK_M, BLOCK_N, BLOCK_K)
    _ws_gated_backward_kernel[(min(num_sms, tiles),)](*descs, M, N, K, GROUP_M, num_sms, STAGES, load_regs,
                                                      release_at, num_warps=num_warps, maxnreg=maxnreg)


def _compile(fn, values, consts, num_warps, maxnreg):
    """Compile ``fn`` for sm_90 without a GPU (TensorDescriptors over CPU tensors give the signature): shared memory
    bytes, registers per thread and spilled bytes from the cubin's resource usage."""
    import re
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature = {name: ("constexpr" if name in consts else mangle_type(values[name])) for name in fn.arg_names}
    src = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, local = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
    return dict(shared=k.metadata.shared, regs=regs, local_bytes=local)


def compile_only():
    M, N, K = 512, 256, 256
    e = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)  # noqa: E731
    for name, c in CONFIGS.items():
        a, b, o = _descs(e(M, K), e(2 * N, K), e(M, N), c["BLOCK_M"], c["HALF"], c["BLOCK_K"])
        for gated in (False, True):
            consts = dict(GATED=gated, GROUP_M=8, NUM_SMS=132, STAGES=c["STAGES"], CONSUMERS=c.get("consumers", 1),
                          LOAD_REGS=40, MMA_REGS=c.get("mma_regs", 232), num_warps=c["num_warps"])
            print(name, "gated" if gated else "plain", _compile(_ws_gemm_kernel, dict(
                a_desc=a, b_desc=b, c_desc=o, M=M, N=N, K=K), consts, c["num_warps"], c["maxnreg"]), flush=True)
    for name, c in BWD_CONFIGS.items():
        descs = _bwd_descs(e(M, K), e(K, N), e(M, 2 * N), e(M, 2 * N), e(M, N), c["BLOCK_M"], c["BLOCK_N"],
                           c["BLOCK_K"])
        names = ("dy_desc", "wd_desc", "g_desc", "u_desc", "dg_desc", "du_desc", "h_desc")
        values = dict(zip(names, descs), M=M, N=N, K=K)
        consts = dict(GROUP_M=8, NUM_SMS=132, STAGES=c["STAGES"], LOAD_REGS=40, RELEASE_AT=c.get("release_at", -1),
                      num_warps=c["num_warps"])
        print(name, _compile(_ws_gated_backward_kernel, values, consts, c["num_warps"], c["maxnreg"]), flush=True)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def check():
    """Every config on odd sizes (partial tiles everywhere) against float64: the forward plain and gated, the
    backward's dG, dU and H; one JSON line per check, config by config (the ping-pong ones last: a hang leaves the
    others' lines whole); exit status 1 on a wrong or NaN value."""
    F = torch.nn.functional
    sizes = ((300, 264, 200), (1000, 1032, 520), (2048, 4096, 1024))
    few_programs = ((1000, 1032, 64), (1000, 1032, 200))  # (the backward on 3 programs: many tiles each, 1 and 4
    bwd_sizes = sizes + few_programs  # k-steps, the release k-step clamped)
    bad = 0
    order = sorted(CONFIGS, key=lambda n: CONFIGS[n].get("consumers", 1))
    for name in order[:1] + list(BWD_CONFIGS) + order[1:]:
        for M, N, K in sizes if name in CONFIGS else bwd_sizes:
            torch.manual_seed(0)
            if name in CONFIGS:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
                ref = x.double() @ w.double().T
                for gated in (False, True):
                    o = torch.full((M, N if gated else 2 * N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    ws_gemm(x, w, o, gated, **CONFIGS[name])
                    torch.cuda.synchronize()
                    err = _rel(o, F.silu(ref[:, :N]) * ref[:, N:] if gated else ref)
                    ok = err < 1e-2 and not o.isnan().any().item()
                    bad += not ok
                    print(json.dumps(dict(config=name, M=M, N=N, K=K, gated=gated, rel_err=err, ok=ok)), flush=True)
                continue
            dy = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            wd = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / N ** 0.5
            gu = torch.randn(M, 2 * N, device="cuda", dtype=torch.bfloat16)
            g, u = gu[:, :N].double(), gu[:, N:].double()
            dh = dy.double() @ wd.double()
            sig = torch.sigmoid(g)
            dgu = torch.full((M, 2 * N), float("nan"), device="cuda", dtype=torch.bfloat16)
            h = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            ws_gated_backward(dy, wd, gu, dgu, h, **BWD_CONFIGS[name],
                              num_sms=3 if (M, N, K) in few_programs else None)
            torch.cuda.synchronize()
            errs = dict(dg=_rel(dgu[:, :N], dh * u * sig * (1 + g * (1 - sig))), du=_rel(dgu[:, N:], dh * g * sig),
                        h=_rel(h, g * sig * u))
            ok = max(errs.values()) < 1e-2 and not (dgu.isnan().any().item() or h.isnan().any().item())
            bad += not ok
            print(json.dumps(dict(config=name, M=M, N=N, K=K, rel_err=errs, ok=ok)), flush=True)
    sys.exit(1 if bad else 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--check", action="store_true", help="the checks alone (run in a child process by default)")
    args = p.parse_args()
    if args.compile_only:
        compile_only()
        return
    if args.check:
        check()
    from tritonmm.dispatch import gated_cublas

    F = torch.nn.functional
    out = {"device": torch.cuda.get_device_name(), "configs": CONFIGS, "bwd_configs": BWD_CONFIGS, "checks": [],
           "rows": []}
    try:  # (a child process: a wrong barrier phase or register request hangs the GPU, and only a timeout ends it)
        done = subprocess.run([sys.executable, __file__, "--check"], capture_output=True, text=True, timeout=150)
        stdout = done.stdout
        status = done.returncode if done.returncode == 0 else f"{done.returncode}: {done.stderr[-600:]}"
    except subprocess.TimeoutExpired as e:
        stdout, status = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timed out"
    out["checks"] = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    out["checks_status"] = status
    passed = {name for name in (*CONFIGS, *BWD_CONFIGS)  # (every size checked and right; a hang leaves the rest out)
              if all(c["ok"] for c in out["checks"] if c["config"] == name)
              and sum(c["config"] == name for c in out["checks"]) == (5 if name in BWD_CONFIGS else 6)}
    out["timed_configs"] = sorted(passed)
    print("checks:", status, "timed:", sorted(passed), flush=True)
    _write(out)
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=150, return_mode="median") * 1e3  # noqa: E731
    for name, M, N, K in (("square", 4096, 4096, 4096), ("square", 8192, 8192, 8192), ("8b", 4096, 14336, 4096),
                          ("8b", 16384, 14336, 4096), ("tiny", 4096, 5632, 2048), ("8b", 512, 14336, 4096)):
        torch.manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        plain_w = w[:N] if name == "square" else w  # (square: N x N; else the GEMM on [Wg; Wu], 2N columns)
        o = torch.empty(M, plain_w.shape[0], device="cuda", dtype=torch.bfloat16)
        h = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        row = dict(config=name, M=M, N=N, K=K, cublas_us=bench(lambda: F.linear(x, plain_w)))
        if name != "square":  # the shipped Triton kernel on packed weights (autotuned at its first call), and eager
            gated_cublas.packed_kernel(x, w, "silu")  # (its first call autotunes: not inside the timing)
            row["triton_packed_us"] = bench(lambda: gated_cublas.packed_kernel(x, w, "silu"))
            row["eager_gated_us"] = bench(lambda: F.silu(F.linear(x, w[:N])) * F.linear(x, w[N:]))
        for cname, cfg in ((n, c) for n, c in CONFIGS.items() if n in passed):
            try:
                row[f"{cname}_plain_vs_cublas"] = row["cublas_us"] / bench(lambda: ws_gemm(x, plain_w, o, False, **cfg))
                if name != "square":
                    t = bench(lambda: ws_gemm(x, w, h, True, **cfg))
                    row[f"{cname}_gated_vs_cublas_gemm"] = row["cublas_us"] / t
                    row[f"{cname}_gated_vs_triton_packed"] = row["triton_packed_us"] / t
            except Exception as e:  # (a config that does not fit: reported)
                row[f"{cname}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        if name != "square":  # the backward: dH = dY @ Wd with the product's backward, against cuBLAS + one pass
            dy = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            wd = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / N ** 0.5
            gu = torch.randn(M, 2 * N, device="cuda", dtype=torch.bfloat16)
            dgu = torch.empty_like(gu)

            def current():  # (a fused MLP's training backward now: cuBLAS dH, then one Triton pass)
                dh = dy @ wd
                gated_cublas.grads_into(dh, gu[:, :N], gu[:, N:], "silu", dgu[:, :N], dgu[:, N:])
            row["bwd_cublas_dh_us"] = bench(lambda: dy @ wd)
            row["bwd_current_us"] = bench(current)
            for cname, cfg in ((n, c) for n, c in BWD_CONFIGS.items() if n in passed):
                try:
                    t = bench(lambda: ws_gated_backward(dy, wd, gu, dgu, h, **cfg))
                    row[f"{cname}_vs_current"] = row["bwd_current_us"] / t
                    row[f"{cname}_vs_cublas_dh"] = row["bwd_cublas_dh_us"] / t
                except Exception as e:
                    row[f"{cname}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        out["rows"].append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        _write(out)


def _write(out):
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "gluon_ws_gemm.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
