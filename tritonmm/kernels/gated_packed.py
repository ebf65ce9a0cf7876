"""The gated GEMM on packed gate and up weights, forward and backward: persistent TMA kernels (Hopper and newer).

Where a Llama-family MLP's gate and up weights are packed as one (2N, K) tensor [Wg; Wu] (what
:func:`tritonmm.fuse` arranges), a three-dimensional TMA descriptor over it, (2, N, K), loads one
(2, BLOCK_N // 2, BLOCK_K) block per step: BLOCK_N // 2 gate rows and the matching up rows, which
become one (BLOCK_N, BLOCK_K) operand of one MMA. So the gate-and-up half of the MLP runs as the plain
persistent TMA GEMM (:mod:`.tma`: group-M tile order, one fp32 accumulator, operands straight from
shared memory to the Tensor Cores), and the epilogue splits that accumulator into its gate and up
halves in registers and stores H = act(g) * u, (M, N), once.

* :func:`_gated_packed_kernel`: H = act(X @ Wg^T) * (X @ Wu^T); with ``SAVE`` also the rounded projections
  as the halves [G | U] of one (M, 2N) tensor (the layout of the cuBLAS GEMM on [Wg; Wu]), for the backward.
* :func:`_gated_packed_backward_kernel`: the down projection's input-gradient GEMM dH = dY @ Wd with the
  gated product's backward as its epilogue: it reads the saved [G | U] tile and writes [dG | dU], (M, 2N),
  so that one GEMM gives both weights' gradients ([dG | dU]^T @ X, rows [dWg; dWu]) and dH is never stored.

Rounding follows eager's: each projection, the activation and the product (in the backward dH and the
product's gradients) are rounded to the output dtype where eager's separate kernels round them.
Operands: unit column strides, 16-byte aligned bases and row strides, N a multiple of 8 elements for
16-bit dtypes (the halves' bases are then aligned too).
"""

import triton
import triton.language as tl

from .common import _activation, _group_m_order, _to_output
from .gated_product import _activation_grad


@triton.jit
def _gated_packed_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (2N, K): [Wg; Wu]
    h_ptr,  # (M, N)
    gu_ptr,  # SAVE: (M, 2N) out, [G | U]; else a dummy
    M, N, K, stride_xm, stride_w, stride_hm, stride_gum,
    M_BUCKET, N_BUCKET, K_BUCKET,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, SAVE: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_N // 2  # BLOCK_N: columns of the GEMM tile, gate then up; HALF of H
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, N, K], strides=[N * stride_w, stride_w, 1],
                                       block_shape=[2, HALF, BLOCK_K])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N], strides=[stride_hm, 1], block_shape=[BLOCK_M, HALF])
    gu_desc = h_desc
    if SAVE:
        gu_desc = tl.make_tensor_descriptor(gu_ptr, shape=[M, 2, N], strides=[stride_gum, N, 1],
                                            block_shape=[BLOCK_M, 2, HALF])
    dtype = h_ptr.dtype.element_ty
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, HALF)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(axis=0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_am = pid_m * BLOCK_M
        offs_hn = pid_n * HALF
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([offs_am, ki * BLOCK_K])  # TMA zero-fills past M, N and K: no masks
            w = tl.reshape(w_desc.load([0, offs_hn, ki * BLOCK_K]), (BLOCK_N, BLOCK_K)).T
            if UPCAST:  # the interpreter multiplies bfloat16 bit patterns (triton-lang/triton#11584)
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        gu = tl.reshape(_to_output(acc, dtype, UPCAST), (BLOCK_M, 2, HALF))  # each projection rounded
        if SAVE:
            gu_desc.store([offs_am, 0, offs_hn], gu)
        g, u = tl.split(tl.permute(gu, (0, 2, 1)))
        a = _to_output(_activation(g.to(tl.float32), ACTIVATION), dtype, UPCAST)
        h_desc.store([offs_am, offs_hn], _to_output(a.to(tl.float32) * u.to(tl.float32), dtype, UPCAST))


@triton.jit
def _gated_packed_backward_kernel(
    dy_ptr,  # (M, K): the down projection's output gradient
    wd_ptr,  # (K, N): the down projection's weight
    gu_ptr,  # (M, 2N): the forward's [G | U]
    dgu_ptr,  # (M, 2N) out: [dG | dU]
    M, N, K, stride_dym, stride_wd, stride_gum, stride_dgum,
    M_BUCKET, N_BUCKET, K_BUCKET,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, K], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_K])
    wd_desc = tl.make_tensor_descriptor(wd_ptr, shape=[K, N], strides=[stride_wd, 1], block_shape=[BLOCK_K, BLOCK_N])
    gu_desc = tl.make_tensor_descriptor(gu_ptr, shape=[M, 2, N], strides=[stride_gum, N, 1],
                                        block_shape=[BLOCK_M, 2, BLOCK_N])
    dgu_desc = tl.make_tensor_descriptor(dgu_ptr, shape=[M, 2, N], strides=[stride_dgum, N, 1],
                                         block_shape=[BLOCK_M, 2, BLOCK_N])
    dtype = dgu_ptr.dtype.element_ty
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(axis=0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_am = pid_m * BLOCK_M
        offs_bn = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            dy = dy_desc.load([offs_am, ki * BLOCK_K])
            wd = wd_desc.load([ki * BLOCK_K, offs_bn])
            if UPCAST:
                dy = dy.to(tl.float32)
                wd = wd.to(tl.float32)
            acc = tl.dot(dy, wd, acc, input_precision=INPUT_PRECISION)
        dh = _to_output(acc, dtype, UPCAST).to(tl.float32)  # rounded, as the down projection's input gradient
        g, u = tl.split(tl.permute(gu_desc.load([offs_am, 0, offs_bn]), (0, 2, 1)))
        g = g.to(tl.float32)
        u = u.to(tl.float32)
        a = _to_output(_activation(g, ACTIVATION), dtype, UPCAST).to(tl.float32)
        du = _to_output(dh * a, dtype, UPCAST)
        d_act = _to_output(dh * u, dtype, UPCAST).to(tl.float32)  # the product's gradient, rounded as eager's
        if ACTIVATION == "relu":  # as torch's threshold_backward: a select
            dg = tl.where(g <= 0.0, 0.0, d_act)
        else:
            dg = d_act * _activation_grad(g, ACTIVATION)
        dgu_desc.store([offs_am, 0, offs_bn], tl.permute(tl.join(_to_output(dg, dtype, UPCAST), du), (0, 2, 1)))
