"""Where fuse's extra time in a 1 x 512 eager prefill comes from: fuse in full, MLPs only and attentions only
against off (the model benchmark's alternation), and torch.profiler's per-op host time of off against fuse.

Usage: PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_fuse_prefill_diag.py  (prints; writes
$OUT/h200_fuse_prefill_diag.json)
"""
import contextlib
import json
import os
import statistics
import timeit

import torch

import tritonmm
from tritonmm.bench.model import CONTROL, _row, _tokens, alternate, build_model

dev = torch.device("cuda")
out = {"what": __doc__.split("\n\n")[0], "rows": [], "profile": {}}
g = {"torch": torch}
ns = sorted(timeit.timeit("torch.cuda.is_current_stream_capturing()", globals=g, number=100000) * 1e4
            for _ in range(5))[2]
out["is_current_stream_capturing_ns"] = ns
print("is_current_stream_capturing ns", ns)


def ctx(model, filter_fn, fused: bool):
    @contextlib.contextmanager
    def c():
        if fused:
            tritonmm.fuse(model, filter_fn=filter_fn)
        try:
            yield
        finally:
            if fused:
                tritonmm.unfuse(model, unpack=False)
    return c


for config in ("llama3-8b-2l", "small"):
    model = build_model(config, dev, torch.bfloat16)
    tritonmm.fuse(model)
    tritonmm.unfuse(model, unpack=False)  # packed once, as in the model benchmark
    ids = _tokens(model.config.vocab_size, 1, 512, dev)
    fwd = lambda: model(ids, use_cache=False)  # noqa: E731
    variants = {"off": (None, False), "fuse": (None, True), "fuse_mlp": (lambda m, n: n.endswith("mlp"), True),
                "fuse_attn": (lambda m, n: n.endswith("self_attn"), True)}
    runs = {k: (ctx(model, f, on), fwd) for k, (f, on) in variants.items()}
    runs[CONTROL] = runs["off"]
    with torch.no_grad():
        ms = alternate(runs, dev, 60, iters=3)
        row = _row("eager prefill 1 x 512", config, ms)
        row.pop("rounds_ms")
        out["rows"].append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
        prof = {}
        for m in ("off", "fuse", "off", "fuse"):
            with ctx(model, None, m == "fuse")():
                for _ in range(3):
                    fwd()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                    for _ in range(10):
                        fwd()
                    torch.cuda.synchronize()
                prof[m] = {e.key: (e.count / 10, e.self_cpu_time_total / 10) for e in p.key_averages()}
        keys = set(prof["off"]) | set(prof["fuse"])
        diff = sorted(((prof["fuse"].get(k, (0, 0))[1] - prof["off"].get(k, (0, 0))[1], k) for k in keys),
                      key=lambda t: -abs(t[0]))
        tot = {m: sum(v[1] for v in prof[m].values()) for m in prof}
        print(config, "profiled self cpu us per forward", tot)
        rows = []
        for d, k in diff[:25]:
            o, f = prof["off"].get(k, (0, 0)), prof["fuse"].get(k, (0, 0))
            rows.append({"key": k, "off_count": o[0], "fuse_count": f[0], "off_us": round(o[1], 2),
                         "fuse_us": round(f[1], 2), "diff_us": round(d, 2)})
            print(f"{d:9.2f} us  {k}  count {o[0]} -> {f[0]}  self {o[1]:.1f} -> {f[1]:.1f}")
        out["profile"][config] = {"total_self_cpu_us": tot, "top_diff": rows}
    del model
    torch.cuda.empty_cache()
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "h200_fuse_prefill_diag.json"), "w") as f:
    json.dump(out, f, indent=1)
