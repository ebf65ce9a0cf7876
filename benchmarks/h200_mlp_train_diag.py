"""Forward + backward of transformers' LlamaMLP (Llama-3-8B widths, bf16) eager against tritonmm.fuse at
M = 512 and 4096: per-kernel CUDA time of one step each (torch.profiler), and wall times alternated.
Also: the host time to issue one step (no sync inside it) and the warnings a step raises.
Usage: PYTHONPATH=$PWD python3 benchmarks/h200_mlp_train_diag.py"""
import copy
import statistics
import time
import warnings

import torch

import tritonmm
from tritonmm.bench.mlp import _mlp

dev = torch.device("cuda")
mlp = _mlp(4096, 14336, dev, torch.bfloat16)
fused = tritonmm.fuse(copy.deepcopy(mlp))
for M in (512, 4096):
    x = torch.randn(M, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(M, 4096, device=dev, dtype=torch.bfloat16)
    steps = {"eager": lambda: mlp(x).backward(grad), "fused": lambda: fused(x).backward(grad)}
    for name, fn in steps.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t and e.key and not e.key.startswith("cuda"):
                rows.append((t, e.count, e.key[:100]))
        print(f"M={M} {name}: kernels (us, count, name)")
        for t, c, k in sorted(rows, reverse=True)[:14]:
            print(f"   {t:9.1f} {c:3d} {k}")
    for name, fn in steps.items():  # host time to issue one step (no sync inside), warnings raised per step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            host = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        kinds = sorted({f"{w.category.__name__}: {str(w.message)[:90]}" for w in caught})
        print(f"M={M} {name}: host ms per step (median of 20) {statistics.median(host):.3f}; "
              f"{len(caught)} warnings in 20 steps {kinds}")
    times = {k: [] for k in steps}
    for r in range(21):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                steps[name]()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / 5 * 1e3)
    e, f = statistics.median(times["eager"]), statistics.median(times["fused"])
    ratio = statistics.median(a / b for a, b in zip(times["eager"], times["fused"]))
    print(f"M={M} fwd+bwd eager {e:.3f} ms fused {f:.3f} ms ratio {ratio:.3f}")
