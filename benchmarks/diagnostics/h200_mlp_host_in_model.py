"""Host time of each part of a transformers Llama eager prefill, tritonmm off against fuse and fuse variants.

For each model (the model benchmark's small and llama3-8b-2l configs, bf16) and prefill shape, each mode
runs one forward per round (order rotated, gc paused, one untimed forward first), timed three ways: the host
time to issue it (``model(ids)`` returning, before the sync), its wall time (after the sync), and the host
time spent in each attention and each MLP (an instance-level ``forward`` wrapper on each, the same in every
mode). The MLP alone (same module, same shape of input) is also timed back to back per call.

Modes: off; fuse (as released); fuse_own (``gated.PRODUCT_MIN_FLOPS`` and ``PRODUCT_MIN_FLOPS_NO_GRAD``
infinite: every MLP call of more than 16 rows runs the MLP's own forward); fuse_product (both 0: the cuBLAS +
product path from 17 rows); fuse_kernel (``gated.GATED_MAX_M`` 4096 and the pointer kernel: calls up to 4096 rows
run the gated GEMM kernel, Triton's autotuner choosing its config, first-sight tuning off for it).

Usage: PYTHONPATH=$PWD OUT=DIR [ROUNDS=24] [CONFIGS=small,llama3-8b-2l] [MODES=off,fuse,...] python3
benchmarks/diagnostics/h200_mlp_host_in_model.py  (writes $OUT/h200_mlp_host_in_model.json)
"""
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch

from tritonmm import gated
from tritonmm.bench.model import _tokens, build_model, mode
from tritonmm.ops import gated as gated_op

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (CPU: a smoke test of the script)
DTYPE = torch.bfloat16 if dev.type == "cuda" else torch.float32
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
ROUNDS = int(os.environ.get("ROUNDS", "24"))
out_dir = os.environ.get("OUT", "/tmp/out")


@contextlib.contextmanager
def variant(model, **globs):
    saved = {k: getattr(gated, k) for k in globs}
    env = os.environ.get("TRITONMM_FIRST_SIGHT")
    with mode("fuse", model):
        for k, v in globs.items():
            setattr(gated, k, v)
        if "GATED_MAX_M" in globs:
            os.environ["TRITONMM_FIRST_SIGHT"] = "0"
        gated_op._fast.clear()
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(gated, k, v)
            if env is None:
                os.environ.pop("TRITONMM_FIRST_SIGHT", None)
            else:
                os.environ["TRITONMM_FIRST_SIGHT"] = env
            gated_op._fast.clear()


def instrument(model):
    rec = {"attn": [], "mlp": []}
    for layer in model.model.layers:
        for part, m in (("attn", layer.self_attn), ("mlp", layer.mlp)):
            def fwd(*args, _m=m, _part=part, **kw):
                t0 = time.perf_counter_ns()
                out = type(_m).forward(_m, *args, **kw)
                rec[_part].append(time.perf_counter_ns() - t0)
                return out
            m.forward = fwd
    return rec


def run(config, shapes):
    model = build_model(config, dev, DTYPE)
    rec = instrument(model)
    modes = {
        "off": lambda: mode("off", model),
        "fuse": lambda: mode("fuse", model),
        "fuse_own": lambda: variant(model, PRODUCT_MIN_FLOPS=float("inf"), PRODUCT_MIN_FLOPS_NO_GRAD=float("inf")),
        "fuse_product": lambda: variant(model, PRODUCT_MIN_FLOPS=0, PRODUCT_MIN_FLOPS_NO_GRAD=0),
        "fuse_kernel": lambda: variant(model, GATED_MAX_M=4096, TMA_MIN_M=10**9),
    }
    chosen = os.environ.get("MODES")
    if chosen:
        modes = {m: modes[m] for m in chosen.split(",")}
    rows = {}
    for batch, seq in shapes:
        ids = _tokens(model.config.vocab_size, batch, seq, dev)
        fwd = lambda: model(ids, use_cache=False)  # noqa: E731
        data = {m: {"issue_us": [], "wall_us": [], "attn_us": [], "mlp_us": [], "mlp_call_us": []} for m in modes}
        names = list(modes)
        with torch.no_grad():
            for m in names:  # warm-up: compile, tune, settle
                with modes[m]():
                    for _ in range(3):
                        fwd()
            sync()
            gc.collect()
            gc.disable()
            try:
                for r in range(ROUNDS):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for m in order:
                        with modes[m]():
                            fwd()
                            sync()
                            rec["attn"].clear()
                            rec["mlp"].clear()
                            t0 = time.perf_counter_ns()
                            fwd()
                            t1 = time.perf_counter_ns()
                            sync()
                            t2 = time.perf_counter_ns()
                        d = data[m]
                        d["issue_us"].append((t1 - t0) / 1e3)
                        d["wall_us"].append((t2 - t0) / 1e3)
                        d["attn_us"].append(sum(rec["attn"]) / 1e3)
                        d["mlp_us"].append(sum(rec["mlp"]) / 1e3)
                        d["mlp_call_us"].append(statistics.median(rec["mlp"]) / 1e3)
            finally:
                gc.enable()
            # the MLP alone, back to back, per call (host-paced where its GPU work is short)
            mlp = model.model.layers[0].mlp
            x = torch.randn(batch, seq, model.config.hidden_size, device=dev, dtype=DTYPE)
            alone = {}
            for m in names:
                with modes[m]():
                    for _ in range(3):
                        mlp(x)
                    sync()
                    ts = []
                    for _ in range(9):
                        t0 = time.perf_counter_ns()
                        for _ in range(20):
                            mlp(x)
                        ts.append((time.perf_counter_ns() - t0) / 20e3)
                        sync()
                    alone[m] = statistics.median(ts)
        row = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in data.items()}
        for m in names:
            row[m]["mlp_alone_issue_us"] = alone[m]
            if m != "off":
                row[m]["wall_ratio"] = statistics.median(
                    a / b for a, b in zip(data["off"]["wall_us"], data[m]["wall_us"]))
        rows[f"{config} prefill {batch} x {seq}"] = row
        print(f"== {config} prefill {batch} x {seq}")
        for m in names:
            print(f"  {m:12s}" + " ".join(f"{k}={v:9.1f}" for k, v in row[m].items()))
        sys.stdout.flush()
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    res = {"what": __doc__.split("\n\n")[0], "rounds": ROUNDS, "modes": os.environ.get("MODES"),
           "machine": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}, "rows": {}}
    shapes = {"small": [(1, 512), (4, 1024)], "llama3-8b-2l": [(1, 512)]}
    if dev.type == "cuda":
        for config in os.environ.get("CONFIGS", "small,llama3-8b-2l").split(","):
            res["rows"].update(run(config, shapes[config]))
    else:
        res["rows"].update(run("tiny", [(1, 32)]))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "h200_mlp_host_in_model.json"), "w") as f:
        json.dump(res, f, indent=1)
