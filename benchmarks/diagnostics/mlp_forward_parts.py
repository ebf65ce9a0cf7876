"""Diagnostic: where a LlamaMLP inference forward spends its time, eager against ``tritonmm.fuse``, at 512 to 4096
tokens (bf16, no autograd), and the fused module on the two paths it can take at sizes where its thresholds send
calls to the torch expression: ``fused_product`` (cuBLAS on the packed weights, then the product pass:
``gated.PRODUCT_MIN_FLOPS_NO_GRAD`` = 0, ``gated_cublas.PACKED_KERNEL_MIN_FLOPS`` = None) and ``fused_packed`` (the
gated GEMM on the packed weights: ``PACKED_KERNEL_MIN_FLOPS`` = 0). Per path: one call timed alone between CUDA
events (the GPU idle at the start, so host time before and between launches counts), back-to-back calls
(``do_bench``: GPU-paced where the host runs ahead, as ``bench --mlp``'s samples of back-to-back calls are), the
host's enqueue time per call (behind a ``torch.cuda._sleep`` that keeps the GPU busy) and each kernel's GPU time
from torch.profiler. The questions it answers: why the fused forward at 512 tokens is further from the bound
(cuBLAS gate-and-up GEMM plus down) than at 4096, and whether the product path costs the host more than the torch
expression it would replace there (a host-paced prefill would then lose what a GPU-paced call gains).

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/mlp_forward_parts.py   (writes $OUT/mlp_forward_parts.json)
"""
import contextlib
import copy
import json
import os
import statistics
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import tritonmm
from tritonmm.bench.mlp import _mlp
from tritonmm.dispatch import gated, gated_cublas
from tritonmm.ops import gated as gated_op

F = torch.nn.functional


def alone_us(fn, n=30):
    """Median over n single calls, each between two events on an idle GPU."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def host_us(fn, n=50):
    """Host time per call while the GPU is kept busy (nothing waits on it)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))  # (about a quarter of a second of GPU time ahead of the calls)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def kernels(fn, steps=5):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ks = sorted(((e.key[:90], e.device_time_total / steps) for e in prof.key_averages() if e.device_time_total > 0),
                key=lambda k: -k[1])
    return {"gpu_us": round(sum(k[1] for k in ks), 1), "kernels": [[n, round(t, 1)] for n, t in ks[:8]]}


@contextlib.contextmanager
def thresholds(**values):
    """gated / gated_cublas constants set within (and the gated linear's bound replays forgotten on both sides)."""
    home = {k: gated_cublas if hasattr(gated_cublas, k) else gated for k in values}
    old = {k: getattr(home[k], k) for k in values}
    for k, v in values.items():
        setattr(home[k], k, v)
    gated_op._fast.clear()
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(home[k], k, v)
        gated_op._fast.clear()


none = contextlib.nullcontext
variants = {"fused_product": lambda: thresholds(PRODUCT_MIN_FLOPS_NO_GRAD=0, PACKED_KERNEL_MIN_FLOPS=None),
            "fused_packed": lambda: thresholds(PACKED_KERNEL_MIN_FLOPS=0)}
out = {"device": torch.cuda.get_device_name(), "rows": []}
with torch.no_grad():
    for name, (hidden, inter) in (("llama3-8b", (4096, 14336)), ("tinyllama", (2048, 5632))):
        eager = _mlp(hidden, inter, "cuda", torch.bfloat16)
        fused = tritonmm.fuse(copy.deepcopy(eager))
        w_cat = torch.cat([eager.gate_proj.weight, eager.up_proj.weight])
        for M in (512, 2048, 4096):
            x = torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16)
            paths = {"eager": lambda: eager(x), "fused": lambda: fused(x),
                     "bound": lambda: F.linear(F.linear(x, w_cat)[:, :inter], eager.down_proj.weight),
                     "fused_product": lambda: fused(x), "fused_packed": lambda: fused(x)}
            row = {"config": name, "M": M}
            for p, fn in paths.items():
                with variants.get(p, none)():
                    for _ in range(5):
                        fn()
                    if p != "bound":  # (bf16 roundings differ between paths)
                        torch.testing.assert_close(fn(), eager(x), rtol=2e-2, atol=2e-2)
                    row[p] = {"alone_us": round(alone_us(fn), 1),
                              "back_to_back_us": round(triton.testing.do_bench(fn, warmup=10, rep=100) * 1e3, 1),
                              "host_us": round(host_us(fn), 1), **kernels(fn)}
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
            os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
            with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "mlp_forward_parts.json"), "w") as f:
                json.dump(out, f, indent=1)  # (after each row: a run cut short keeps the rows done)
