"""Diagnostic: decode-sized GEMMs (M = 1 and 16 rows, bf16, ``F.linear`` layout) in the pointer, split-K and TMA
kernels, swap-AB too, over a config grid wider than ``configs/candidates.json``'s, each config timed side by side
with cuBLAS (``F.linear``), L2 flushed, as first-sight tuning times (:func:`tritonmm.core.timing._pair_times_ms`).
Rows: the Llama-3-8B and TinyLlama projections a decode step reads (q/k/v packed, o, down, gate/up packed). The
question it answers: whether a Triton kernel reads these weights closer to the HBM bandwidth than cuBLAS does,
which would make the memory-bound GEMMs of a CUDA-graph or compiled decode faster. ``benchmarks/h200.json`` bounds
the answer: its ten Llama-3-8B cuBLAS times at 1 and 16 rows (L2 flushed) lie within 3 µs of 13 µs + bytes read /
4.5 TB/s, so cuBLAS reads these weights at the bandwidth once the fixed time that any kernel pays here (the flush's
dirty lines written back during the call, the launch) is set apart: a few µs per GEMM is left to win.

    PYTHONPATH=$PWD [SWEEP_SHAPES=a,b] python3 benchmarks/diagnostics/decode_gemm_sweep.py [SECONDS]
    (writes $OUT/decode_gemm_sweep.json; step decode_sweep of benchmarks/h200_run.sh)
"""

import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.bench.timing import machine_facts, warm_up_gpu
from tritonmm.core.timing import _pair_times_ms

SHAPES = {  # name: (N, K)
    "llama8b-down": (4096, 14336), "llama8b-o": (4096, 4096), "llama8b-qkv": (6144, 4096),
    "llama8b-gate_up": (28672, 4096), "tiny-down": (2048, 5632), "tiny-o": (2048, 2048), "tiny-qkv": (2560, 2048),
}
GRID = [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_stages=s, num_warps=w, SPLIT_K=sk)
        for bn, bk, sk, (s, w) in itertools.product((32, 64, 128), (128, 256), (2, 4, 8, 16), ((4, 4), (3, 8)))]
GRID += [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=512, GROUP_M=1, num_stages=3, num_warps=4, SPLIT_K=sk)
         for bn, sk in itertools.product((32, 64), (4, 8, 16))]
GRID += [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_stages=4, num_warps=4)  # no split: "pointer"
         for bn, bk in itertools.product((32, 64, 128), (128, 256))]
SWAP = [dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=bk, GROUP_M=1, num_stages=4, num_warps=4, SPLIT_K=sk)
        for bm, bk, sk in itertools.product((64, 128), (64, 128), (2, 4, 8))]
SWAP += [dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=bk, GROUP_M=1, num_stages=4, num_warps=4)
         for bm, bk in itertools.product((64, 128), (64, 128))]
SWAP += [dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=bk, GROUP_M=1, num_stages=4, num_warps=4, EPILOGUE_SUBTILE=0, SPLIT_K=sk)
         for bm, bk, sk in itertools.product((64, 128), (64, 128), (1, 2, 4, 8))]
"""Swap-AB configs: ``W @ x.T`` (N x M, the small M as the tile's N), a view's transpose away from F.linear's;
in the pointer kernel, split or not, and in the persistent TMA kernel (the configs with ``EPILOGUE_SUBTILE``)."""


def _kernel(cfg: dict) -> str:
    return "tma" if "EPILOGUE_SUBTILE" in cfg else "splitk" if "SPLIT_K" in cfg else "pointer"


_families = [[(c, False) for c in GRID], [(c, True) for c in SWAP if _kernel(c) != "tma"],
             [(c, True) for c in SWAP if _kernel(c) == "tma"]]
ORDER = [c for group in itertools.zip_longest(*_families) for c in group if c is not None]
"""The configs, the three families taken in turn: a shape's time share cut short still times each."""


def main():
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
    t_end = time.monotonic() + budget
    dev, dtype = torch.device("cuda"), torch.bfloat16
    warm_up_gpu()
    machine, rows = machine_facts(), []
    chosen = os.environ.get("SWEEP_SHAPES")  # e.g. SWEEP_SHAPES=llama8b-down,llama8b-o: those rows only
    shapes = {k: v for k, v in SHAPES.items() if not chosen or k in chosen.split(",")}
    combos = list(itertools.product(shapes.items(), (1, 16)))
    for i, ((name, (N, K)), M) in enumerate(combos):
        t_stop = min(t_end, time.monotonic() + (t_end - time.monotonic()) / (len(combos) - i))  # a share each
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=g) / K ** 0.5
        ref = (x.double() @ w.double().T)
        gb = (N * K + M * K + M * N) * 2 / 1e9
        best = {}
        swap = (lambda: tritonmm.matmul(w, x.T).T)
        for cfg, swapped in ORDER:
            if time.monotonic() > t_stop:
                break
            if K // cfg.get("SPLIT_K", 1) < cfg["BLOCK_K"]:
                continue
            fn = swap if swapped else (lambda: tritonmm.linear(x, w))
            try:
                with tritonmm.force_backend("triton", kernel=_kernel(cfg), config=cfg):
                    out = fn()
                    err = (out.double() - ref).abs().max().item()
                    if not err < 0.05:
                        rows.append({"shape": name, "M": M, "config": cfg, "swap_ab": swapped,
                                     "error": f"max abs error {err}"})
                        continue
                    t_torch, t_tri = _pair_times_ms((lambda: F.linear(x, w), fn), 10)
            except Exception as e:  # a config that does not compile or fit: recorded, the sweep goes on
                rows.append({"shape": name, "M": M, "config": cfg, "swap_ab": swapped,
                             "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            us_t, us_k = statistics.median(t_torch) * 1e3, statistics.median(t_tri) * 1e3
            row = {"shape": name, "M": M, "N": N, "K": K, "kernel": _kernel(cfg), "config": cfg, "swap_ab": swapped,
                   "cublas_us": us_t,
                   "triton_us": us_k, "ratio": us_t / us_k, "cublas_tbps": gb / us_t * 1e3,
                   "triton_tbps": gb / us_k * 1e3}
            rows.append(row)
            kind = ("swap-AB " if swapped else "") + row["kernel"]
            if kind not in best or row["ratio"] > best[kind]["ratio"]:
                best[kind] = row
        for kind, b in best.items():
            print(f"{name:16s} M={M:2d} cuBLAS {b['cublas_us']:6.1f} us ({b['cublas_tbps']:.2f} TB/s)  {kind:16s} "
                  f"{b['triton_us']:6.1f} us ({b['triton_tbps']:.2f} TB/s) ratio {b['ratio']:.3f} {b['config']}",
                  flush=True)
        out = os.environ.get("OUT", "/tmp/out")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "decode_gemm_sweep.json"), "w") as f:  # (after each shape: a cut run keeps them)
            json.dump({"what": __doc__.split("\n\n")[0], "machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
