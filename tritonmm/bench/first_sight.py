"""``--first-sight``: first-sight tuning on the linear layers of model families outside the public suite.

Every geometry (a family's nn.Linear weight, bf16, M tokens) runs once in this process with an empty
machine table (a temporary ``TRITONMM_TUNED_DIR``) and first-sight tuning on: its first
``tritonmm.linear`` call is timed on the host (tuning included), checked against a float64 reference,
and the decision it leaves is timed against ``F.linear`` in GPU time, call by call in alternation
(:func:`tritonmm.core.timing._bench_pair`). Then a second process makes the same first calls
with the table the first one wrote: it should measure nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

FAMILIES = {  # hidden, q/o out, k/v out, MLP intermediate, vocabulary (the models' config.json)
    "qwen2-7b": (3584, 3584, 512, 18944, 152064),
    "gemma-2b": (2048, 2048, 256, 16384, 256000),
    "phi3-mini": (3072, 3072, 3072, 8192, 32064),
    "llama2-13b": (5120, 5120, 5120, 13824, 32000),
    "qwen2.5-0.5b": (896, 896, 128, 4864, 151936),
    "falcon-7b": (4544, 4544, 64, 18176, 65024),
}
TOKENS = (1, 16, 512, 4096)


def geometries() -> list[dict]:
    """(family, layer, M, N, K) of every distinct linear GEMM of :data:`FAMILIES` at :data:`TOKENS`."""
    out = []
    for family, (h, q, kv, inter, vocab) in FAMILIES.items():
        layers = {"q": (q, h), "kv": (kv, h), "o": (h, q), "up": (inter, h), "down": (h, inter), "head": (vocab, h)}
        seen = set()
        for layer, (N, K) in layers.items():
            if (N, K) in seen:
                continue
            seen.add((N, K))
            out += [{"family": family, "layer": layer, "M": M, "N": N, "K": K} for M in TOKENS]
    return out


def _first_call(g: dict, gen) -> tuple:
    import tritonmm
    from tritonmm.dispatch import first_sight

    tritonmm.clear_cache()  # as a new process: no weight plan made for an earlier tensor at the same address
    x = torch.randn(g["M"], g["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(g["N"], g["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
    measured, seconds = first_sight.stats["measured"], first_sight.stats["seconds"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = tritonmm.linear(x, w)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    return x, w, out, first, first_sight.stats["measured"] - measured, first_sight.stats["seconds"] - seconds


def _fresh_process_env(table_dir: str) -> None:
    import tritonmm

    os.environ["TRITONMM_TUNED_DIR"] = table_dir
    os.environ["TRITONMM_FIRST_SIGHT"] = "1"
    tritonmm.clear_cache()


def run(rep: int = 60, progress=print) -> dict:
    """Measure every geometry (module docstring); returns the rows and the second process's counts."""
    import tritonmm
    from tritonmm.core.reference import error_report

    from ..core.timing import _bench_pair

    table_dir = tempfile.mkdtemp(prefix="tritonmm-first-sight-")
    _fresh_process_env(table_dir)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for g in geometries():
        x, w, out, first, measured, seconds = _first_call(g, gen)
        rep_ = error_report(out, x, w.t())
        d = tritonmm.explain(x, w.t())
        t_torch, t_mm = _bench_pair(lambda: F.linear(x, w), lambda: tritonmm.linear(x, w), rep=rep, rounds=4)
        rows.append({**g, "first_call_s": round(first, 3), "measured": measured, "tuning_s": round(seconds, 3),
                     "backend": d.backend, "kernel": d.kernel, "reason": d.reason, "torch_us": t_torch,
                     "tritonmm_us": t_mm, "ratio": t_torch / t_mm, "ok": rep_["ok"]})
        progress(f"{g['family']:13} {g['layer']:5} M={g['M']:<5} N={g['N']:<6} K={g['K']:<6} first call "
                 f"{first:6.3f} s (measured {measured}) {d.backend:6} {d.kernel or '':8} ratio {t_torch / t_mm:.3f}")
        del x, w, out
        torch.cuda.empty_cache()
    second = subprocess.run([sys.executable, "-c", "from tritonmm.bench.first_sight import _second; _second()",
                             table_dir], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    if second.returncode != 0:
        raise RuntimeError(f"second process failed: {second.stderr[-2000:]}")
    tuned = [r for r in rows if r["measured"]]
    triton = [r["ratio"] for r in rows if r["backend"] == "triton"]
    cublas = [r["ratio"] for r in rows if r["backend"] == "torch"]
    summary = {
        "geometries": len(rows), "measured": len(tuned),
        "tuning_s_max": max((r["tuning_s"] for r in tuned), default=0.0),
        "tuning_s_median": statistics.median([r["tuning_s"] for r in tuned]) if tuned else 0.0,
        "triton_chosen": len(triton), "triton_ratio_min": min(triton, default=None),
        "triton_ratio_max": max(triton, default=None),
        # rows left to cuBLAS time the same call twice: their spread is the timing's noise
        "cublas_ratio_min": min(cublas), "cublas_ratio_max": max(cublas),
        "all_ok": all(r["ok"] for r in rows),
        "second_process": json.loads(second.stdout.strip().splitlines()[-1]),
    }
    return {"rows": rows, "summary": summary}


def _second() -> None:
    """The second process: the same first calls, the first process's table on disk (argv[1])."""
    _fresh_process_env(sys.argv[1])
    F.linear(torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda"))  # CUDA and cuBLAS start-up
    gen = torch.Generator(device="cuda").manual_seed(0)
    firsts, measured = [], 0
    for g in geometries():
        x, w, out, first, m, _ = _first_call(g, gen)
        firsts.append(first)
        measured += m
        del x, w, out
    print(json.dumps({"measured": measured, "first_call_s_max": round(max(firsts), 3)}))


def print_report(result: dict) -> None:
    s = result["summary"]
    tri = (f" ({s['triton_ratio_min']:.3f}-{s['triton_ratio_max']:.3f}x F.linear's GPU time)"
           if s["triton_chosen"] else "")
    print(f"{s['geometries']} geometries, {s['measured']} measured at first sight (tuning "
          f"{s['tuning_s_median']:.2f} s median, {s['tuning_s_max']:.2f} s at most); Triton chosen for "
          f"{s['triton_chosen']}{tri}; the others {s['cublas_ratio_min']:.3f}-{s['cublas_ratio_max']:.3f}x (the "
          f"same call timed twice); results {'all within bounds' if s['all_ok'] else 'NOT all within bounds'}; "
          f"a second process measured {s['second_process']['measured']} (slowest first call "
          f"{s['second_process']['first_call_s_max']:.3f} s)")
