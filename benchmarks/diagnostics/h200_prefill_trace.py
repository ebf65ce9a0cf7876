"""Timeline of one eager prefill of the Llama-3-8B-sized 2-layer model (1 x 512 tokens, no grad), tritonmm
off against tritonmm.fuse: where the host issues each part of the forward and when the GPU runs it.

One torch.profiler trace (CPU and CUDA) of three forwards per mode, each after a synchronize, with
record_function ranges around the embedding, each layer's attention and MLP, the final norm and lm_head (the
same hooks in both modes). Printed per mode (median over the three forwards): per range, the host time, the
kernel time it launched, and when its kernels started and ended relative to the forward's start; the GPU's
idle time between the first and last kernel; CUDA runtime calls by name (count, host us); the wall time from
the forward's start to its last kernel's end. Then wall times alternated without the profiler. The chrome
traces go to $OUT (gzip).

Usage: PYTHONPATH=$PWD python3 benchmarks/diagnostics/h200_prefill_trace.py [tokens]; re-read saved traces: ... --from TRACE.json.gz..."""
import collections
import gzip
import json
import os
import statistics
import sys

import torch

import tritonmm
from tritonmm.bench.model import _tokens, alternate, build_model, mode

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (CPU: a smoke test of the script)
out_dir = os.environ.get("OUT", "/tmp/out")
os.makedirs(out_dir, exist_ok=True)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def fwd():
    return model(ids, use_cache=False)


def ranges():
    """record_function ranges around the parts of the forward; returns the hook handles."""
    handles = []
    inner = model.model
    parts = [("embed", inner.embed_tokens), ("norm", inner.norm), ("lm_head", model.lm_head)]
    for i, layer in enumerate(inner.layers):
        parts += [(f"L{i}.attn", layer.self_attn), (f"L{i}.mlp", layer.mlp)]
    for name, module in parts:
        def pre(m, args, name=name):
            m._rf = torch.profiler.record_function(name)
            m._rf.__enter__()

        def post(m, args, output):
            m._rf.__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def analyse(trace: dict) -> list:
    events = trace["traceEvents"]
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    # (cuBLAS and Triton launch through the driver API: cuLaunchKernelEx)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    notes = [e for e in events if e.get("cat") == "user_annotation"]
    forwards = sorted((e for e in notes if e["name"] == "prefill"), key=lambda e: e["ts"])
    results = []
    for f in forwards:
        t0, t1 = f["ts"], f["ts"] + f["dur"]
        launched = []
        for k in kernels:
            r = runtime.get(k.get("args", {}).get("correlation"))
            if r is not None and t0 <= r["ts"] <= t1:
                launched.append((k, r))
        launched.sort(key=lambda kr: kr[0]["ts"])
        if not launched:  # (CPU)
            launched = [({"ts": t0, "dur": 0.0, "name": "none"}, {"ts": -1.0})]
        gpu_end = max(k["ts"] + k["dur"] for k, _ in launched)
        busy, idle, cursor = 0.0, 0.0, launched[0][0]["ts"]
        for k, _ in launched:
            if k["ts"] > cursor:
                idle += k["ts"] - cursor
            busy += k["dur"]
            cursor = max(cursor, k["ts"] + k["dur"])
        parts = {}
        for n in notes:
            if n["name"] != "prefill" and t0 <= n["ts"] <= t1:
                ks = [k for k, r in launched if n["ts"] <= r["ts"] <= n["ts"] + n["dur"]]
                parts[n["name"]] = {
                    "host_us": n["dur"], "start_us": n["ts"] - t0,
                    "kernel_us": sum(k["dur"] for k in ks), "kernels": len(ks),
                    "gpu_first_us": (min(k["ts"] for k in ks) - t0) if ks else None,
                    "gpu_last_us": (max(k["ts"] + k["dur"] for k in ks) - t0) if ks else None}
        calls = collections.defaultdict(lambda: [0, 0.0])
        for r in runtime.values():
            if t0 <= r["ts"] <= t1:
                calls[r["name"]][0] += 1
                calls[r["name"]][1] += r["dur"]
        top = collections.defaultdict(float)
        for k, _ in launched:
            top[k["name"][:90]] += k["dur"]
        results.append({"host_us": f["dur"], "wall_us": gpu_end - t0, "kernel_us": busy, "gpu_idle_us": idle,
                        "gpu_first_us": launched[0][0]["ts"] - t0, "parts": parts, "runtime": dict(calls),
                        "top_kernels": sorted(top.items(), key=lambda kv: -kv[1])[:12]})
    return results


def report(m: str, res: list) -> None:
    med = lambda key: statistics.median(r[key] for r in res)  # noqa: E731
    print(f"== {m}: host {med('host_us'):.1f} us, wall {med('wall_us'):.1f} us, kernels {med('kernel_us'):.1f} us, "
          f"GPU idle {med('gpu_idle_us'):.1f} us, first kernel at {med('gpu_first_us'):.1f} us")
    r = res[len(res) // 2]
    print(f"   {'part':10s} {'start':>8s} {'host':>8s} {'kernels':>8s} {'n':>3s} {'gpu first':>9s} {'gpu last':>9s}")
    for name, p in sorted(r["parts"].items(), key=lambda kv: kv[1]["start_us"]):
        print(f"   {name:10s} {p['start_us']:8.1f} {p['host_us']:8.1f} {p['kernel_us']:8.1f} {p['kernels']:3d} "
              f"{p['gpu_first_us'] or 0:9.1f} {p['gpu_last_us'] or 0:9.1f}")
    print("   runtime calls:", ", ".join(f"{k} {c}x {t:.0f}us" for k, (c, t) in sorted(r["runtime"].items())))
    for k, t in r["top_kernels"]:
        print(f"   {t:8.1f} {k}")


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--from":  # re-read saved traces
    for path in sys.argv[2:]:
        with gzip.open(path, "rt") as fh:
            report(path, analyse(json.load(fh)))
    sys.exit()

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 512
model = build_model(os.environ.get("CONFIG", "llama3-8b-2l"), dev, torch.bfloat16)
tritonmm.fuse(model)
tritonmm.unfuse(model, unpack=False)  # off runs on the same packed storage as fuse
ids = _tokens(model.config.vocab_size, 1, tokens, dev)
summary = {}
with torch.no_grad():
    for m in ("off", "fuse"):
        with mode(m, model):
            handles = ranges()
            for _ in range(3):
                fwd()
            sync()
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    sync()
                    with torch.profiler.record_function("prefill"):
                        fwd()
                    sync()
            for h in handles:
                h.remove()
        path = os.path.join(out_dir, f"prefill_trace_{m}.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
        with gzip.open(path + ".gz", "wt") as fh:
            json.dump(trace, fh)
        os.remove(path)
        res = analyse(trace)
        report(m, res)
        summary[m] = res

    times = alternate({m: (lambda m=m: mode(m, model), fwd) for m in ("off", "fuse")}, dev, 20, iters=3)
    for m, t in times.items():
        print(f"no profiler: {m} wall {statistics.median(t):.3f} ms")
    print("ratio off/fuse", round(statistics.median(a / b for a, b in zip(times["off"], times["fuse"])), 4))
    summary["alternated_ms"] = {m: statistics.median(t) for m, t in times.items()}

with open(os.path.join(out_dir, "prefill_trace_summary.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
