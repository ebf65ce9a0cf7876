"""Diagnostic: a fused Llama model's eager prefill as shipped, with the gated GEMM on packed weights from 2^35
(gated_cublas.PACKED_KERNEL_MIN_FLOPS, shipped 2^36), and with the cuBLAS GEMM on the packed weights and the product
pass from 2^35 (gated.PRODUCT_MIN_FLOPS_NO_GRAD, shipped 2^37) where the shipped code runs the torch expression,
against tritonmm off and its A/A control, alternated as `bench --model` alternates its modes. The question it answers: which path serves the
Llama-3-8B-sized 1 x 512 prefill's MLPs (6.0e10 FLOP per projection) best in the model, where the MLP benchmark alone
times them differently (diagnostics/h200_mlp_forward_parts.json). Then, per mode, each MLP call's host time (its
Python call, unsynchronized) and GPU time (CUDA events around it) inside the prefill: whether a slower prefill is host
or GPU time. The 1 x 512 prefill is timed first and again after 2 x 512: the first row of a fresh process can read
the GPU's clocks ramping up.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/prefill_packed_ab.py [CONFIG] [ROUNDS]  (0 rounds: per-call only)
(writes $OUT/prefill_packed_ab.json)
"""

import contextlib
import json
import os
import statistics
import sys
import time

import torch

import tritonmm
from tritonmm.bench import model as bench_model
from tritonmm.bench.timing import machine_facts
from tritonmm.dispatch import gated, gated_cublas
from tritonmm.ops import gated as gated_op

config = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-2l"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
model = bench_model.build_model(config, device, dtype)
tritonmm.fuse(model)  # packed once; "off" runs the unfused forward on the same packed weights
shipped = gated_cublas.PACKED_KERNEL_MIN_FLOPS, gated.PRODUCT_MIN_FLOPS_NO_GRAD


@contextlib.contextmanager
def variant(packed_kernel=shipped[0], product=shipped[1], fused=True):
    gated_cublas.PACKED_KERNEL_MIN_FLOPS, gated.PRODUCT_MIN_FLOPS_NO_GRAD = packed_kernel, product
    gated_op.clear_cache()  # (bound replays keep the path's decision)
    if not fused:
        tritonmm.unfuse(model, unpack=False)
    try:
        yield
    finally:
        if not fused:
            tritonmm.fuse(model)
        gated_cublas.PACKED_KERNEL_MIN_FLOPS, gated.PRODUCT_MIN_FLOPS_NO_GRAD = shipped
        gated_op.clear_cache()


modes = {"off": lambda: variant(fused=False), "fuse": variant, "fuse_packed_2_35": lambda: variant(2**35),
         "fuse_product_2_35": lambda: variant(product=2**35)}
rows = []
for batch, seq in ((1, 512), (2, 512), (1, 512), (4, 1024)) if rounds else ():  # (1 x 512 again: warmed up)  # (ROUNDS 0: the per-call times only)
    ids = bench_model._tokens(model.config.vocab_size, batch, seq, device)
    with torch.no_grad():
        ms = bench_model.alternate({m: (ctx, lambda: model(ids, use_cache=False)) for m, ctx in modes.items()},
                                   device, 4 * rounds, iters=3)
    row = bench_model._row(f"eager prefill {batch} x {seq}", config, ms)
    rows.append(row)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k.endswith("_ratio")})


def per_mlp_call(ids, calls=20):
    """Median host µs and GPU µs of one MLP call inside ``calls`` prefills (the first prefill untimed)."""
    host, events = [], []
    mlps = [layer.mlp for layer in model.model.layers]

    cuda = device.type == "cuda"

    def pre(module, args):
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        module._probe = (time.perf_counter(), start)

    def post(module, args, out):
        t0, start = module._probe
        host.append((time.perf_counter() - t0) * 1e6)
        if cuda:
            (end := torch.cuda.Event(enable_timing=True)).record()
            events.append((start, end))

    handles = [h for m in mlps for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
            host.clear(), events.clear()
            for _ in range(calls):
                model(ids, use_cache=False)
        if cuda:
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    gpu = [s.elapsed_time(e) * 1e3 for s, e in events]
    return {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu) if gpu else None}


per_call = []
for batch, seq in ((1, 512), (2, 512)):
    ids = bench_model._tokens(model.config.vocab_size, batch, seq, device)
    for m, ctx in modes.items():
        with ctx():
            per_call.append({"prefill": f"{batch} x {seq}", "mode": m, **per_mlp_call(ids)})
        print(per_call[-1])
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "prefill_packed_ab.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "rows": rows, "per_mlp_call": per_call},
              f, indent=1)
