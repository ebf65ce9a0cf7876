"""Diagnostic: the host cost of one gated linear call on packed weights, layer by layer (the entry point, its bound
replay, the packed launcher, Triton's launcher, the descriptors' scratch allocation), against the torch expression
and the cuBLAS path it replaces, with a profile of the entry point and the kernels' GPU times from torch.profiler.
The question it answers: where the packed path's extra host time per MLP call in a prefill comes from.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/packed_host.py   (writes $OUT/packed_host.json)
"""
import cProfile, io, json, os, pstats, time

import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.dispatch import gated_cublas
from tritonmm.kernels import launch as _launch
from tritonmm.ops import gated as ops_gated

dev, dt = "cuda", torch.bfloat16
out = {"device": torch.cuda.get_device_name(), "rows": []}


def host_us(fn, n=40, reps=7):
    """Median over reps of the host time per call of n unsynchronized calls (the GPU drained before each rep)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(ts)[reps // 2]


for name, K, N, M in (("8b", 4096, 14336, 512), ("8b", 4096, 14336, 2048), ("tiny", 2048, 5632, 1024)):
    w = torch.randn(2 * N, K, device=dev, dtype=dt) / K ** 0.5
    wg, wu = w[:N], w[N:]
    x = torch.randn(1, M, K, device=dev, dtype=dt)
    row = {"config": name, "M": M, "N": N, "K": K, "flops": 2 * M * N * K}
    with torch.no_grad():
        for _ in range(3):
            tritonmm.gated_linear(x, wg, wu)
        torch.cuda.synchronize()
        key = ops_gated._fast_key(x, wg, wu, None, None, "silu")
        run = ops_gated._fast.get(key)
        row["replay"] = getattr(run, "__qualname__", repr(run))
        lkey = (M, N, K, K, K, dt, x.device, False, "silu")
        launch = gated_cublas._packed_launchers.get(lkey)
        row["packed_launcher"] = launch is not None
        h = torch.empty(M, N, device=dev, dtype=dt)
        x2 = x.view(M, K)
        t = {
            "torch_expr": lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu),
            "mm_only": lambda: F.linear(x, w),
            "entry": lambda: tritonmm.gated_linear(x, wg, wu),
            "replay_run": lambda: run(x, wg, wu, None, None),
            "empty_h": lambda: torch.empty(M, N, device=dev, dtype=dt),
            "scratch_alloc": lambda: _launch._torch_alloc(132 * 384, 128, None),
            "hooks_active": _launch._hooks_active,
        }
        if launch is not None and launch is not gated_cublas._FAILED:
            t["packed_launcher"] = lambda: launch(x2, w, h, None)
            inner = launch.__closure__
            cells = {n: c.cell_contents for n, c in zip(launch.__code__.co_freevars, inner)}
            inner_fn = cells.get("inner")
            icells = {n: c.cell_contents for n, c in zip(inner_fn.__code__.co_freevars, inner_fn.__closure__)}
            direct = icells.get("direct")
            row["direct_compiled"] = direct is not None and direct.compiled is not None
            row["config"] = icells["state"]["config"]
            if direct is not None and direct.compiled is not None:
                args = (x2, w, h, h, *icells["ints"])
                t["direct_launch"] = lambda: direct(args)
                k = direct.compiled
                row["global_scratch_size"] = getattr(k.metadata, "global_scratch_size", None)
                row["launcher_type"] = type(k.run).__name__
        row["hooks_active_value"] = _launch._hooks_active()
        row["host_us"] = {n: round(host_us(f), 2) for n, f in t.items()}
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            tritonmm.gated_linear(x, wg, wu)
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        row["profile"] = s.getvalue()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                tritonmm.gated_linear(x, wg, wu)
                F.silu(F.linear(x, wg)) * F.linear(x, wu)
            torch.cuda.synchronize()
        row["kernels"] = {e.key[:90]: round(e.device_time_total / e.count, 1) for e in prof.key_averages()
                          if e.device_time_total > 0}
    print(json.dumps({k: v for k, v in row.items() if k != "profile"}, indent=1))
    print(row["profile"])
    out["rows"].append(row)
    del w, x
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "packed_host.json"), "w") as f:
    json.dump(out, f, indent=1)
