"""Diagnostic: the gated GEMM on packed weights (kernels/gated_packed.py's forward, no SAVE) in launch variants
and configs, against the cuBLAS GEMM on [Wg; Wu] it must match (the fused bound's first half) and that GEMM
plus eager's activation and product, GPU time by triton.testing.do_bench (median, L2 flushed), bf16, Llama MLP
widths. Variants: the shipped persistent launch (one program per SM, flattened loop), one program per tile (two
programs share an SM where their shared memory fits, so one's epilogue overlaps the other's main loop), the
persistent loop not flattened, and Triton's automatic warp specialization of the persistent loop. The question
it answers: which launch and config brings the gated GEMM to the cuBLAS GEMM's time.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/gated_packed_variants.py   (writes $OUT/gated_packed_variants.json)
"""
import json, os, time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritonmm.kernels.common import _activation, _group_m_order, _to_output
from tritonmm.kernels.launch import ensure_allocator


@triton.jit
def _variant_kernel(x_ptr, w_ptr, h_ptr, M, N, K, stride_xm, stride_w, stride_hm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, N, K], strides=[N * stride_w, stride_w, 1],
                                       block_shape=[2, HALF, BLOCK_K])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N], strides=[stride_hm, 1], block_shape=[BLOCK_M, HALF])
    dtype = h_ptr.dtype.element_ty
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, HALF)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(axis=0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN,
                            warp_specialize=WS):
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
        a = _to_output(_activation(g.to(tl.float32), "silu"), dtype, False)
        h_desc.store([offs_am, offs_hn], _to_output(a.to(tl.float32) * u.to(tl.float32), dtype, False))


CONFIGS = [(128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (256, 128, 64, 8, 3, 8), (256, 128, 64, 8, 4, 8),
           (128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 4, 4), (128, 128, 128, 8, 3, 8),
           (64, 256, 64, 8, 4, 4)]
MODES = {"persistent": dict(FLATTEN=True, WS=False), "tiles": dict(FLATTEN=False, WS=False),
         "persistent_noflat": dict(FLATTEN=False, WS=False), "ws": dict(FLATTEN=False, WS=True)}
SHAPES = [("8b", 512, 14336, 4096), ("8b", 4096, 14336, 4096), ("tiny", 4096, 5632, 2048), ("8b", 16384, 14336, 4096)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


ensure_allocator()
SMS = torch.cuda.get_device_properties(0).multi_processor_count
out = {"device": torch.cuda.get_device_name(), "rows": []}
t_end = time.time() + float(os.environ.get("VARIANTS_BUDGET_S", "420"))
for name, M, N, K in SHAPES:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    ref = (F.silu(x.float() @ w[:N].float().T) * (x.float() @ w[N:].float().T))
    base = {"cublas_gemm_2n": bench(lambda: F.linear(x, w)),
            "eager_expr": bench(lambda: F.silu(F.linear(x, w[:N])) * F.linear(x, w[N:]))}
    gu = F.linear(x, w)
    base["cublas_gemm_2n_plus_product"] = base["cublas_gemm_2n"] + bench(lambda: F.silu(gu[:, :N]) * gu[:, N:])
    row = {"config": name, "M": M, "N": N, "K": K, "baselines_us": base, "variants": []}
    print(name, M, {k: round(v, 1) for k, v in base.items()}, flush=True)
    for mode, flags in MODES.items():
        for cfg in CONFIGS:
            if time.time() > t_end:
                break
            if mode == "ws" and cfg not in CONFIGS[:2] + CONFIGS[4:5]:
                continue
            BM, BN, BK, G, st, nw = cfg
            tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN // 2)
            sms = tiles if mode == "tiles" else SMS
            h = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)

            def run():
                _variant_kernel[(min(sms, tiles),)](x, w, h, M, N, K, x.stride(0), w.stride(0), h.stride(0),
                                                     BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=G, NUM_SMS=sms,
                                                     num_stages=st, num_warps=nw, **flags)
            v = {"mode": mode, "config": cfg}
            try:
                run()
                torch.cuda.synchronize()
                err = ((h.float() - ref).norm() / ref.norm()).item()
                v.update(us=bench(run), rel_err=err)
                v["vs_gemm_2n"] = base["cublas_gemm_2n"] / v["us"]
                v["vs_gemm_plus_product"] = base["cublas_gemm_2n_plus_product"] / v["us"]
                v["vs_eager"] = base["eager_expr"] / v["us"]
            except Exception as e:  # (a config that does not fit or compile: reported, the probe goes on)
                v["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["variants"].append(v)
            print(" ", mode, cfg, {k: (round(val, 3) if isinstance(val, float) else val) for k, val in v.items()
                                   if k not in ("mode", "config")}, flush=True)
    out["rows"].append(row)
    del x, w, ref, gu
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "gated_packed_variants.json"), "w") as f:
        json.dump(out, f, indent=1)  # (after each shape: a run cut short keeps its rows)
