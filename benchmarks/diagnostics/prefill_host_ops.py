"""Diagnostic: where ``fuse``'s extra host time in a host-paced eager prefill goes, op by op.

The Llama-3-8B-sized model's 1 x 512 prefill (no grad) is paced by the host (``h200_fuse_prefill_host.json``: 2.7 ms
to issue, 3.5 ms wall), and ``fuse`` took about 60 us more host time per layer there, spread over torch's own ops
rather than held by one tritonmm function. Per mode (off, fuse, and fuse with the MLP on the cuBLAS GEMM on the
packed weights and the product pass instead of its own forward: gated.PRODUCT_MIN_FLOPS_NO_GRAD 2^35), on one model (the model benchmark's ``mode``: packed once): the time to issue one
prefill (median of 30, alternated), then torch.profiler over 10 prefills: each op's and CUDA runtime call's count
and self CPU time per prefill. Printed: the ops whose self CPU time per prefill differs most from off's.

    PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/prefill_host_ops.py [CONFIG] (writes $OUT/prefill_host_ops.json)
"""
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tritonmm.bench.model import _tokens, build_model, mode
from tritonmm.bench.timing import machine_facts
from tritonmm.dispatch import gated
from tritonmm.ops import gated as gated_op

config = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-2l"
dev = torch.device("cuda")
model = build_model(config, dev, torch.bfloat16)
ids = _tokens(model.config.vocab_size, 1, 512, dev)


@contextlib.contextmanager
def product_2_35():
    with mode("fuse", model):
        old = gated.PRODUCT_MIN_FLOPS_NO_GRAD
        gated.PRODUCT_MIN_FLOPS_NO_GRAD = 2**35
        gated_op.clear_cache()
        try:
            yield
        finally:
            gated.PRODUCT_MIN_FLOPS_NO_GRAD = old
            gated_op.clear_cache()


modes = {"off": lambda: mode("off", model), "fuse": lambda: mode("fuse", model), "fuse_product_2_35": product_2_35}


def fwd():
    return model(ids, use_cache=False)


issue = {m: [] for m in modes}
with torch.no_grad():
    for m, ctx in modes.items():
        with ctx():
            for _ in range(3):
                fwd()
    torch.cuda.synchronize()
    for r in range(30):
        order = list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]
        for m in order:
            with modes[m]():
                fwd()
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                fwd()
                t1 = time.perf_counter_ns()
                torch.cuda.synchronize()
                t2 = time.perf_counter_ns()
                issue[m].append(((t1 - t0) / 1e3, (t2 - t0) / 1e3))
    ops = {}
    for m, ctx in modes.items():
        with ctx():
            fwd()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fwd()
                torch.cuda.synchronize()
        ops[m] = {e.key: [e.count / 10, e.self_cpu_time_total / 10] for e in prof.key_averages()}
rows = {m: {"issue_us": statistics.median(a for a, _ in v), "wall_us": statistics.median(b for _, b in v)}
        for m, v in issue.items()}
for m, r in rows.items():
    print(m, {k: round(v, 1) for k, v in r.items()}, "self CPU us per prefill", round(sum(v[1] for v in ops[m].values())))
diffs = {}
for m in ("fuse", "fuse_product_2_35"):
    keys = set(ops[m]) | set(ops["off"])
    d = sorted(((ops[m].get(k, [0, 0])[1] - ops["off"].get(k, [0, 0])[1], k) for k in keys), key=lambda t: -abs(t[0]))
    diffs[m] = [[k, round(us, 1), ops["off"].get(k, [0, 0])[0], ops[m].get(k, [0, 0])[0]] for us, k in d[:30]]
    print(f"===== {m} - off: self CPU us per prefill, calls per prefill off -> {m}")
    for k, us, c0, c1 in diffs[m]:
        print(f"{us:+9.1f}  {c0:6.1f} -> {c1:6.1f}  {k[:90]}")
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "prefill_host_ops.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "config": config, "rows": rows,
               "diff_vs_off": diffs, "ops": ops}, f, indent=1)
