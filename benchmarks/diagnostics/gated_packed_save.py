"""Diagnostic: the gated GEMM on packed weights keeping the projections for the backward (SAVE: H and [G | U] out)
with three epilogues, against what a fused MLP's training forward runs now (the cuBLAS GEMM on [Wg; Wu] and the
one-pass product, gated_cublas.product), GPU time by triton.testing.do_bench (median, L2 flushed), bf16, Llama MLP
widths. Epilogues: 0, the shipped one ([G | U] as one (BLOCK_M, 2, BLOCK_N / 2) TMA store, then H); 1, G, U and H
as three (BLOCK_M, BLOCK_N / 2) TMA stores; 2, G and U stored from registers through pointers (no shared memory),
H by TMA. The question it answers: whether an epilogue that needs less shared memory lets the saving kernel keep
the no-save kernel's deep pipeline and beat the cuBLAS GEMM and the product pass.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/gated_packed_save.py   (writes $OUT/gated_packed_save.json)
"""
import json, os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritonmm.dispatch import gated_cublas
from tritonmm.kernels.common import _activation, _group_m_order, _to_output
from tritonmm.kernels.launch import ensure_allocator


@triton.jit
def _save_kernel(x_ptr, w_ptr, h_ptr, gu_ptr, M, N, K, stride_xm, stride_w, stride_hm, stride_gum,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 NUM_SMS: tl.constexpr, EPI: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, N, K], strides=[N * stride_w, stride_w, 1],
                                       block_shape=[2, HALF, BLOCK_K])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N], strides=[stride_hm, 1], block_shape=[BLOCK_M, HALF])
    gu3_desc = tl.make_tensor_descriptor(gu_ptr, shape=[M, 2, N], strides=[stride_gum, N, 1],
                                         block_shape=[BLOCK_M, 2, HALF])
    gu2_desc = tl.make_tensor_descriptor(gu_ptr, shape=[M, 2 * N], strides=[stride_gum, 1],
                                         block_shape=[BLOCK_M, HALF])
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
            x = x_desc.load([offs_am, ki * BLOCK_K])
            w = tl.reshape(w_desc.load([0, offs_hn, ki * BLOCK_K]), (BLOCK_N, BLOCK_K)).T
            acc = tl.dot(x, w, acc)
        gu = tl.reshape(_to_output(acc, dtype, False), (BLOCK_M, 2, HALF))
        g, u = tl.split(tl.permute(gu, (0, 2, 1)))
        if EPI == 0:
            gu3_desc.store([offs_am, 0, offs_hn], gu)
        elif EPI == 1:
            gu2_desc.store([offs_am, offs_hn], g)
            gu2_desc.store([offs_am, N + offs_hn], u)
        else:
            rm = offs_am + tl.arange(0, BLOCK_M)[:, None]
            rn = offs_hn + tl.arange(0, HALF)[None, :]
            mask = (rm < M) & (rn < N)
            ptr = gu_ptr + rm * stride_gum + rn
            tl.store(ptr, g, mask=mask)
            tl.store(ptr + N, u, mask=mask)
        a = _to_output(_activation(g.to(tl.float32), "silu"), dtype, False)
        h_desc.store([offs_am, offs_hn], _to_output(a.to(tl.float32) * u.to(tl.float32), dtype, False))


CONFIGS = [(128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (128, 256, 64, 8, 2, 8), (128, 128, 64, 8, 4, 8),
           (128, 128, 64, 8, 5, 4), (128, 128, 64, 8, 4, 4)]
SHAPES = [("8b", 4096, 14336, 4096), ("tiny", 4096, 5632, 2048), ("8b", 16384, 14336, 4096)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


ensure_allocator()
SMS = torch.cuda.get_device_properties(0).multi_processor_count
out = {"device": torch.cuda.get_device_name(), "rows": []}
for name, M, N, K in SHAPES:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    gu_ref = x.float() @ w.float().T
    h_ref = F.silu(gu_ref[:, :N]) * gu_ref[:, N:]
    h0 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def current():
        gu = F.linear(x, w)
        gated_cublas.product(gu[:, :N], gu[:, N:], h0, "silu")

    base = {"cublas_gemm_2n": bench(lambda: F.linear(x, w)), "cublas_plus_product": bench(current)}
    row = {"config": name, "M": M, "N": N, "K": K, "baselines_us": base, "variants": []}
    print(name, M, {k: round(v, 1) for k, v in base.items()}, flush=True)
    for epi in (0, 1, 2):
        for cfg in CONFIGS:
            BM, BN, BK, G, st, nw = cfg
            tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN // 2)
            h = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gu = torch.full((M, 2 * N), float("nan"), device="cuda", dtype=torch.bfloat16)

            def run():
                _save_kernel[(min(SMS, tiles),)](x, w, h, gu, M, N, K, x.stride(0), w.stride(0), h.stride(0),
                                                  gu.stride(0), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=G,
                                                  NUM_SMS=SMS, EPI=epi, num_stages=st, num_warps=nw)
            v = {"epilogue": epi, "config": cfg}
            try:
                run()
                torch.cuda.synchronize()
                v.update(h_err=rel(h, h_ref), gu_err=rel(gu, gu_ref), us=bench(run))
                v["vs_current"] = base["cublas_plus_product"] / v["us"]
                v["vs_gemm_2n"] = base["cublas_gemm_2n"] / v["us"]
            except Exception as e:  # (a config that does not fit: reported, the probe goes on)
                v["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            row["variants"].append(v)
            print(" ", epi, cfg, {k: (round(val, 3) if isinstance(val, float) else val) for k, val in v.items()
                                  if k not in ("epilogue", "config")}, flush=True)
    out["rows"].append(row)
    del x, w, gu_ref, h_ref
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "gated_packed_save.json"), "w") as f:
        json.dump(out, f, indent=1)  # (after each shape: a run cut short keeps its rows)
