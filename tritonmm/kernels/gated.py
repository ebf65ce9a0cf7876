"""Gated GEMM kernels: H = act(X @ Wg^T + bg) * (X @ Wu^T + bu), the gate-and-up half of a Llama-family MLP.

One program computes the same (BLOCK_M, BLOCK_N) output tile of both GEMMs, reading the X tile once for
both, with two fp32 accumulators; the epilogue adds the biases, applies the activation to the gate and
multiplies by the up projection, rounding where the eager expression rounds, so neither projection
is written to memory unless the backward needs them (``SAVE``: both stored). Both weights are (N, K) nn.Linear weights read in place through their own pointers.

The pointer kernel can also take the RMSNorm that produced X (``NORM``, transformers' ``LlamaRMSNorm``: X / rms(X)
times a weight), so the norm's output is never written. In one pass (``NORM_ONE_PASS``: bfloat16, whose range is
float32's, and float32) the GEMM loop loads X times the weight, rounded once, sums each row's squares on the way, and
the epilogue scales the accumulators by each row's 1 / rms (a factor per row commutes with the GEMM). In two passes
(float16, where X times the weight may overflow though the normalized values do not) a first loop over K sums the
squares and the GEMM loop loads X normalized and rounded where the module rounds
(``round(w * round(x * rsqrt(mean(x^2) + eps)))``).

Two families, as for the plain GEMM: the pointer kernel (any M, masked; small-M tiles) and the
persistent TMA kernel (Hopper and newer; Triton tutorial 09's loop over output tiles).
"""

import triton
import triton.language as tl

from .common import _activation, _group_m_order, _to_output


@triton.jit
def _gated_epilogue(acc_g, acc_u, offs_m, offs_n, M, N, bg_ptr, bu_ptr, stride_bg, stride_bu, h_ptr, g_ptr, u_ptr,
                    HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr):
    """Bias, activation of the gate times the up projection, rounding, masked stores of H (and G, U)."""
    if HAS_BIAS:
        acc_g += tl.load(bg_ptr + offs_n * stride_bg, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bu_ptr + offs_n * stride_bu, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dtype = h_ptr.dtype.element_ty
    # rounded where eager rounds (each projection, the activation, the product): the same values,
    # infinities and NaNs as act(F.linear(x, Wg)) * F.linear(x, Wu) up to the accumulation order
    g = _to_output(acc_g, dtype, UPCAST)
    u = _to_output(acc_u, dtype, UPCAST)
    if SAVE:
        tl.store(g_ptr + offs, g, mask=mask)
        tl.store(u_ptr + offs, u, mask=mask)
    a = _to_output(_activation(g.to(tl.float32), ACTIVATION), dtype, UPCAST)
    h = a.to(tl.float32) * u.to(tl.float32)
    tl.store(h_ptr + offs, _to_output(h, dtype, UPCAST), mask=mask)


@triton.jit
def _row_rstd(x_ptrs, offs_k, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of each of the tile's rows over all K, in fp32 (the RMSNorm's scale)."""
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
        x_ptrs += BLOCK_K
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _gated_kernel(
    x_ptr,  # (M, K), unit column stride
    wg_ptr, wu_ptr,  # (N, K) each, unit column stride
    bg_ptr, bu_ptr,  # (N,) each, or dummies when HAS_BIAS is False
    h_ptr, g_ptr, u_ptr,  # (M, N) contiguous; g and u are dummies unless SAVE
    nw_ptr,  # (K,), unit stride: the RMSNorm's weight, or a dummy unless NORM
    M, N, K, stride_xm, stride_wg, stride_wu, stride_bg, stride_bu,
    eps,  # the RMSNorm's epsilon (read only with NORM)
    M_BUCKET, N_BUCKET, K_BUCKET,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INT64: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE: tl.constexpr,
    ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, NORM: tl.constexpr,
    NORM_ONE_PASS: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _group_m_order(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_xm = offs_m % M  # wrapped rows/columns are in bounds; never stored (as in the pointer GEMM)
    offs_wn = offs_n % N
    if INT64:
        offs_xm = offs_xm.to(tl.int64)
        offs_wn = offs_wn.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_xm[:, None] * stride_xm + offs_k[None, :]
    wg_ptrs = wg_ptr + offs_wn[None, :] * stride_wg + offs_k[:, None]
    wu_ptrs = wu_ptr + offs_wn[None, :] * stride_wu + offs_k[:, None]
    if NORM:
        nw_ptrs = nw_ptr + offs_k
        if NORM_ONE_PASS:
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        else:
            rstd = _row_rstd(x_ptrs, offs_k, K, eps, BLOCK_M, BLOCK_K, EVEN_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
        else:
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            wu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if NORM:
            nw = tl.load(nw_ptrs, mask=offs_k < K - k * BLOCK_K, other=0.0).to(tl.float32)
            xf = x.to(tl.float32)
            if NORM_ONE_PASS:  # x times the weight; 1 / rms in the epilogue
                squares += tl.sum(xf * xf, axis=1)
                x = _to_output(xf * nw[None, :], x.dtype, UPCAST)
            else:  # transformers' LlamaRMSNorm: x / rms in fp32, rounded, times the weight, rounded
                xn = _to_output(xf * rstd[:, None], x.dtype, UPCAST)
                x = _to_output(nw[None, :] * xn.to(tl.float32), x.dtype, UPCAST)
            nw_ptrs += BLOCK_K
        if UPCAST:  # the interpreter multiplies bfloat16 bit patterns (triton-lang/triton#11584)
            x = x.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g, input_precision=INPUT_PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    if NORM_ONE_PASS:  # (only with NORM)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
        acc_g *= rstd[:, None]
        acc_u *= rstd[:, None]
    _gated_epilogue(acc_g, acc_u, offs_m, offs_n, M, N, bg_ptr, bu_ptr, stride_bg, stride_bu, h_ptr, g_ptr, u_ptr,
                    HAS_BIAS, SAVE, ACTIVATION, UPCAST)


@triton.jit
def _gated_tma_kernel(
    x_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr, g_ptr, u_ptr,  # as in _gated_kernel; 16-byte aligned rows
    M, N, K, stride_xm, stride_wg, stride_wu, stride_bg, stride_bu,
    M_BUCKET, N_BUCKET, K_BUCKET,  # autotune key only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE: tl.constexpr,
    ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    wg_desc = tl.make_tensor_descriptor(wg_ptr, shape=[N, K], strides=[stride_wg, 1], block_shape=[BLOCK_N, BLOCK_K])
    wu_desc = tl.make_tensor_descriptor(wu_ptr, shape=[N, K], strides=[stride_wu, 1], block_shape=[BLOCK_N, BLOCK_K])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(axis=0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_am = pid_m * BLOCK_M
        offs_bn = pid_n * BLOCK_N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([offs_am, ki * BLOCK_K])  # TMA zero-fills past M, N and K: no masks
            wg = wg_desc.load([offs_bn, ki * BLOCK_K]).T
            wu = wu_desc.load([offs_bn, ki * BLOCK_K]).T
            if UPCAST:
                x = x.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(x, wg, acc_g, input_precision=INPUT_PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=INPUT_PRECISION)
        _gated_epilogue(acc_g, acc_u, offs_am + tl.arange(0, BLOCK_M), offs_bn + tl.arange(0, BLOCK_N), M, N,
                        bg_ptr, bu_ptr, stride_bg, stride_bu, h_ptr, g_ptr, u_ptr, HAS_BIAS, SAVE, ACTIVATION, UPCAST)
