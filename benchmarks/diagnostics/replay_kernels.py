"""Diagnostic: where a CUDA-graph replay of a Llama model's forward spends its GPU time, tritonmm off against
``fuse``: the replay's wall time (CUDA events, replays back to back, as ``bench --model`` times them), each
kernel's time per replay from torch.profiler, the time between kernels (wall minus kernel time), and the floor
that reading every weight once at the HBM bandwidth sets, with each weight's size to read the GEMM kernels'
times against. The question it answers: whether the
replay's GEMMs read their weights at the bandwidth in place (no L2 flush between calls: ``h200.json`` times them
after one, whose dirty lines are written back during the call) or whether the rest of the replay (elementwise
kernels, attention, gaps) is where time goes.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/replay_kernels.py [CONFIG] [SEQ...]
    (default llama3-8b-2l 16 128; writes $OUT/replay_kernels.json; step replay_kernels of benchmarks/h200_run.sh)
"""

import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import tritonmm
from tritonmm.bench.model import _capture, _tokens, build_model, mode
from tritonmm.bench.timing import machine_facts, warm_up_gpu
from tritonmm.modules import norm_fold

REPLAYS = 50
PROFILED = 10
HBM_TBS = 4.8  # the H200's HBM3e bandwidth as specified; the floor below is read against it


def _replay_ms(graph, n: int) -> float:
    """Median of ``n`` samples of one replay's wall time (CUDA events around 20 back-to-back replays)."""
    samples = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 20)
    return statistics.median(samples)


def _kernels(graph) -> list[dict]:
    """Each kernel's GPU time (µs) and calls per replay, from torch.profiler over PROFILED replays."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            graph.replay()
        torch.cuda.synchronize()
    rows = [{"name": e.key[:140], "us": e.device_time_total / PROFILED, "calls": e.count / PROFILED}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])


def _weights_mb(model) -> list[dict]:
    """Each 2-D weight's size in MB, by parameter name."""
    return [{"name": n, "mb": round(p.numel() * p.element_size() / 1e6, 2)} for n, p in model.named_parameters()
            if p.dim() == 2]


def main():
    config = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-2l"
    seqs = [int(s) for s in sys.argv[2:]] or [16, 128]
    device = torch.device("cuda")
    warm_up_gpu()
    model = build_model(config, device, torch.bfloat16)
    weights_mb = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if p.dim() == 2 and "embed" not in n) / 1e6
    out = {"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "config": config,
           "weights_read_mb": round(weights_mb, 1), "floor_us_at_spec_bandwidth": round(weights_mb / HBM_TBS, 1),
           "weights": _weights_mb(model), "rows": []}
    print(f"{config}: {weights_mb:.0f} MB of weights read per forward (embedding aside): "
          f"{weights_mb / HBM_TBS:.0f} µs at {HBM_TBS} TB/s", flush=True)
    norm_fold.FOLD = True  # fuse folds each layer's RMSNorm into its MLP ("fuse_unfolded" takes the fold out)
    with mode("fuse", model):  # packs gate and up (and q, k, v) once, before any capture: graphs read a weight's
        pass                   # memory as captured, and packing moves the weights (unfuse(unpack=False) keeps them)
    for seq in seqs:
        ids = _tokens(model.config.vocab_size, 1, seq, device)
        graphs = {}
        for m in ("off", "fuse", "fuse_unfolded", "off_again"):
            with mode({"off_again": "off", "fuse_unfolded": "fuse"}.get(m, m), model), torch.no_grad():
                if m == "fuse_unfolded":  # fuse without its RMSNorm folded into the MLP's gated kernel
                    for layer in model.modules():
                        if "_tritonmm_folds" in type(layer).__dict__:
                            layer.__class__ = type(layer)._tritonmm_fused_base
                graphs[m] = _capture(lambda: model(ids, use_cache=False).logits)
        row = {"batch": 1, "seq": seq}
        for _ in range(3):  # modes alternated, medians kept per mode
            for m, g in graphs.items():
                row.setdefault(f"{m}_wall_us", []).append(_replay_ms(g, REPLAYS // 3) * 1e3)
        for m, g in graphs.items():
            row[f"{m}_wall_us"] = round(statistics.median(row[f"{m}_wall_us"]), 1)
            ks = _kernels(g)
            busy = sum(k["us"] for k in ks)
            row[m] = {"kernel_us": round(busy, 1), "gaps_us": round(row[f"{m}_wall_us"] - busy, 1),
                      "kernels_per_replay": round(sum(k["calls"] for k in ks), 1),
                      "kernels": [{**k, "us": round(k["us"], 2), "calls": round(k["calls"], 2)} for k in ks]}
            print(f"1 x {seq} {m:9}: wall {row[f'{m}_wall_us']:8.1f} µs, kernels {busy:8.1f} µs in "
                  f"{row[m]['kernels_per_replay']:.0f} launches, between kernels {row[m]['gaps_us']:6.1f} µs",
                  flush=True)
            for k in ks[:16]:
                print(f"    {k['us']:8.1f} µs {k['calls']:5.1f}x  {k['name'][:110]}", flush=True)
        row["fuse_ratio"] = round(row["off_wall_us"] / row["fuse_wall_us"], 4)
        row["fuse_unfolded_ratio"] = round(row["off_wall_us"] / row["fuse_unfolded_wall_us"], 4)
        row["control_ratio"] = round(row["off_wall_us"] / row["off_again_wall_us"], 4)
        print(f"1 x {seq}: off / fuse {row['fuse_ratio']:.3f}, off / fuse unfolded {row['fuse_unfolded_ratio']:.3f}, "
              f"off / off again {row['control_ratio']:.3f}", flush=True)
        out["rows"].append(row)
        del graphs
        torch.cuda.empty_cache()
        path = os.path.join(os.environ.get("OUT", "/tmp/out"), "replay_kernels.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    tritonmm.clear_cache()


if __name__ == "__main__":
    main()
