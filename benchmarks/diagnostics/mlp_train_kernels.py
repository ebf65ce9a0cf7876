"""Diagnostic: where a LlamaMLP forward + backward spends its GPU time, eager against ``tritonmm.fuse``: each
kernel's time per step from torch.profiler (bf16, a fixed upstream gradient, parameters' gradients kept). The
question it answers: which of the fused training call's kernels keep it near eager's time at Llama-3-8B widths.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/mlp_train_kernels.py   (writes $OUT/mlp_train_kernels.json)
"""
import copy, json, os

import torch
from torch.profiler import ProfilerActivity, profile

import tritonmm
from tritonmm.bench.mlp import _mlp

STEPS = 5
out = {"device": torch.cuda.get_device_name(), "steps": STEPS, "rows": []}
for name, (hidden, inter), M in (("llama3-8b", (4096, 14336), 4096), ("tinyllama", (2048, 5632), 4096)):
    eager = _mlp(hidden, inter, "cuda", torch.bfloat16)
    fused = tritonmm.fuse(copy.deepcopy(eager))
    x = torch.randn(1, M, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, M, hidden, device="cuda", dtype=torch.bfloat16)
    row = {"config": name, "M": M}
    for mode, mlp in (("eager", eager), ("fused", fused)):
        for _ in range(3):
            mlp(x).backward(dy)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                mlp(x).backward(dy)
            torch.cuda.synchronize()
        kernels = sorted(((e.key[:110], e.device_time_total / STEPS, e.count / STEPS) for e in prof.key_averages()
                          if e.device_time_total > 0), key=lambda k: -k[1])
        row[mode] = {"gpu_us_per_step": sum(k[1] for k in kernels),
                     "kernels": [{"name": n, "us_per_step": round(t, 1), "calls_per_step": c} for n, t, c in kernels]}
        print(name, mode, round(row[mode]["gpu_us_per_step"], 1), flush=True)
        for k in row[mode]["kernels"][:14]:
            print("   ", k, flush=True)
    row["gpu_ratio"] = row["eager"]["gpu_us_per_step"] / row["fused"]["gpu_us_per_step"]
    print(name, "eager / fused GPU time", round(row["gpu_ratio"], 3), flush=True)
    out["rows"].append(row)
    del eager, fused, x, dy
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "mlp_train_kernels.json"), "w") as f:
    json.dump(out, f, indent=1)
