"""Diagnostic: an RMSNorm folded into the GEMM that reads its output, at decode sizes (M = 1 and 16 rows, bf16):
``F.linear(LlamaRMSNorm(x), W)`` as one Triton kernel against transformers' ``LlamaRMSNorm`` (eight eager kernels
in bf16: cast, square, mean, add, rsqrt, scale, cast, weight) followed by the cuBLAS GEMM. The kernel scales A's
tiles by the norm weight as they are loaded, sums the squares of the rows over the same K loop, and applies each
row's 1 / rms to the fp32 accumulator in the epilogue (the factor is per row, so it commutes with the GEMM). Both
contenders run as CUDA graphs of 20 calls back to back, as in a decode's graph replay (no L2 flush), alternated,
and are checked against a float64 reference. Rows: the GEMMs after a norm in a Llama-3-8B decode step (q/k/v packed,
gate/up packed, lm_head). The question it answers: how much of a decode replay's time the norm's launches take
that fusing them into the GEMM would save.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/norm_prologue_gemm.py
    (writes $OUT/norm_prologue_gemm.json; step norm_prologue of benchmarks/h200_run.sh; without a GPU it checks the
    kernel's values under TRITON_INTERPRET=1 and exits)
"""

import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (read when triton is imported)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = {"llama8b-qkv": (6144, 4096), "llama8b-gate_up": (28672, 4096), "llama8b-lm_head": (128256, 4096)}
CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=s)
           for bn, bk, s in itertools.product((32, 64, 128), (128, 256), (3, 4))]
EPS = 1e-5


@triton.jit
def _norm_linear_kernel(x_ptr, g_ptr, w_ptr, y_ptr, M, N, K, eps, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """y = (x / rms(x) * g) @ w.T for x (M, K), g (K,), w (N, K); one program per (BLOCK_M, BLOCK_N) tile."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_in, n_in = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_in = ks < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_in[:, None] & k_in[None, :],
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + ks, mask=k_in, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)
        squares += tl.sum(x * x, axis=1)
        a = (x * g[None, :]).to(w.dtype)
        if UPCAST:  # the interpreter multiplies bfloat16 bit patterns (triton-lang/triton#11584)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(a, w)
    rstd = 1.0 / tl.sqrt(squares / K + eps)
    y = acc * rstd[:, None]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_in[:, None] & n_in[None, :])


def norm_linear(x, g, w, cfg, eps=EPS):
    """The fused call: ``F.linear(rms_norm(x, eps) * g, w)`` for a contiguous 2-D ``x`` and ``w``."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, 16))
    _norm_linear_kernel[grid](x, g, w, y, M, N, K, eps, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=16,
                              BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], UPCAST=x.device.type == "cpu",
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def transformers_norm(x, g, eps=EPS):
    """transformers' LlamaRMSNorm.forward, as written there."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return g * h.to(x.dtype)


def reference(x, g, w, eps=EPS):
    h = x.double()
    return F.linear(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g.double(), w.double())


def _error(y, ref) -> float:
    return (y.double() - ref).abs().max().item()


def _check_on_cpu():
    """float32 and float16: the interpreter converts float32 to bfloat16 by truncation, not rounding."""
    torch.manual_seed(0)
    for dtype, (M, N, K), cfg in itertools.product((torch.float32, torch.float16), ((1, 40, 96), (16, 70, 200),
                                                   (5, 33, 130)), (CONFIGS[0], CONFIGS[-1])):
        x, g = torch.randn(M, K, dtype=dtype) * 3, torch.rand(K, dtype=dtype) + 0.5
        w = torch.randn(N, K, dtype=dtype) / K ** 0.5
        ref = reference(x, g, w)
        fused, eager = _error(norm_linear(x, g, w, cfg), ref), _error(F.linear(transformers_norm(x, g), w), ref)
        assert fused <= 2 * eager + 1e-5, (dtype, M, N, K, cfg, fused, eager)
        print(f"{str(dtype):15} {M:3} x {N:3} x {K:3} BLOCK_N {cfg['BLOCK_N']} BLOCK_K {cfg['BLOCK_K']}: "
              f"error {fused:.2e} (transformers' norm + F.linear {eager:.2e})")


def _graph_us(fn, calls=20, samples=15):
    """Median µs of one call, from CUDA graphs of ``calls`` calls back to back."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main():
    if not torch.cuda.is_available():
        _check_on_cpu()
        return
    from tritonmm.bench.timing import machine_facts, warm_up_gpu

    warm_up_gpu()
    out = {"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "rows": []}
    for (name, (N, K)), M in itertools.product(SHAPES.items(), (1, 16)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
        g = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        eager_fn = lambda: F.linear(transformers_norm(x, g), w)  # noqa: E731
        best, ref = None, reference(x, g, w)  # (the reference and eager's error once per shape)
        eager_err = _error(eager_fn(), ref)
        for cfg in CONFIGS:
            fused_err = _error(norm_linear(x, g, w, cfg), ref)
            if not fused_err <= 2 * eager_err + 1e-2:
                print(f"{name} M={M} {cfg}: error {fused_err:.2e} against {eager_err:.2e}: skipped", flush=True)
                continue
            us = _graph_us(lambda: norm_linear(x, g, w, cfg))
            if best is None or us < best[1]:
                best = (cfg, us, fused_err, eager_err)
        if best is None:
            continue
        cfg = best[0]
        eager, fused, gemm = [], [], []
        for _ in range(5):  # alternated, medians kept
            eager.append(_graph_us(eager_fn))
            fused.append(_graph_us(lambda: norm_linear(x, g, w, cfg)))
            gemm.append(_graph_us(lambda: F.linear(x, w)))
        row = {"name": name, "M": M, "N": N, "K": K, "config": cfg, "eager_us": round(statistics.median(eager), 2),
               "fused_us": round(statistics.median(fused), 2), "fused_err": best[2], "eager_err": best[3],
               "cublas_gemm_alone_us": round(statistics.median(gemm), 2)}
        row["ratio"] = round(row["eager_us"] / row["fused_us"], 3)
        print(f"{name:16} M={M:2}: norm + cuBLAS {row['eager_us']:7.1f} µs, cuBLAS alone "
              f"{row['cublas_gemm_alone_us']:7.1f}, fused {row['fused_us']:7.1f} ({row['ratio']:.3f}x) {cfg}",
              flush=True)
        out["rows"].append(row)
        path = os.path.join(os.environ.get("OUT", "/tmp/out"), "norm_prologue_gemm.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
