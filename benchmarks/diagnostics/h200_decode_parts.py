"""Where the Llama-3-8B-sized model's 16-sequence eager decode spends the time tritonmm adds: the prompt's forward
(64 tokens a sequence, GPU-paced) and the 32 one-token forwards after it (host-paced) timed apart, with tritonmm
off, swapped in, swapped in but for lm_head (``swap_no_lm``), patched in, and off again (``control``), the modes'
order rotated round by round; and, swapped in, the calls that leave the weight plans' fast path (keyed routes) and
the route of each linear layer's GEMM at the prompt's and a step's rows.

Usage: PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_decode_parts.py  (prints; writes
$OUT/h200_decode_parts.json). On a CPU it dry-runs a tiny model.
"""
import contextlib
import json
import os
import statistics
import time

import torch

import tritonmm
from tritonmm.bench import model as bm
from tritonmm.bench.timing import collect_young, gc_paused
from tritonmm.ops import routes

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = dev.type == "cuda"
config, batch, rounds = ("llama3-8b-2l", 16, 40) if gpu else ("tiny", 2, 4)
model = bm.build_model(config, dev, torch.bfloat16 if gpu else torch.float32)
vocab = model.config.vocab_size
prompt, step = bm._tokens(vocab, batch, 64, dev), bm._tokens(vocab, batch, 32, dev)
sync = torch.cuda.synchronize if gpu else (lambda: None)


def parts():
    """(prompt ms, steps ms) of one decode."""
    from transformers import DynamicCache

    cache = DynamicCache()
    sync()
    t0 = time.perf_counter()
    model(prompt, use_cache=True, past_key_values=cache)
    sync()
    t1 = time.perf_counter()
    for t in range(step.shape[1]):
        out = model(step[:, t:t + 1], use_cache=True, past_key_values=cache)
    out.logits.sum().item()
    sync()
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


@contextlib.contextmanager
def swapped(filter_fn=None):
    tritonmm.swap_linear(model, filter_fn)
    try:
        yield
    finally:
        tritonmm.unswap_linear(model)


MODES = {"off": contextlib.nullcontext, "swap": swapped, "swap_no_lm": lambda: swapped(lambda m, n: n != "lm_head"),
         "patch": tritonmm.patch_linear, "control": contextlib.nullcontext}


def alternate():
    names = list(MODES)
    times = {n: ([], []) for n in names}
    with torch.no_grad(), gc_paused():
        for name in names:
            with MODES[name]():
                parts()
        for r in range(-(-rounds // len(names)) * len(names)):
            collect_young()
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                with MODES[name]():
                    parts()
                    p, s = parts()
                times[name][0].append(p)
                times[name][1].append(s)
    out = {}
    for k, part in enumerate(("prompt", "steps")):
        row = {f"{n}_ms": round(statistics.median(times[n][k]), 4) for n in names}
        for n in names[1:]:
            row[f"{n}_ratio"] = round(statistics.median(a / b for a, b in zip(times["off"][k], times[n][k])), 4)
        out[part] = row
    return out


def keyed_calls():
    """Calls per decode reaching routes.linear_keyed, swapped in (by layer shape and rows), and each layer's route
    and class after the decode (layer 1's, as layer 0's, left out)."""
    seen = {}
    real = routes.linear_keyed

    def counting(input, weight, bias=None, activation="none"):
        key = f"{tuple(weight.shape)} rows {input.numel() // input.shape[-1]}"
        seen[key] = seen.get(key, 0) + 1
        return real(input, weight, bias, activation)

    with swapped(), torch.no_grad():
        parts()
        routes.linear_keyed = counting
        try:
            parts()
        finally:
            routes.linear_keyed = real
        decisions = {}
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".1." not in name:
                for rows in (batch * prompt.shape[1], batch):
                    x = torch.randn(rows, m.in_features, device=dev, dtype=m.weight.dtype)
                    d = tritonmm.explain(x, m.weight.t())
                    decisions[f"{name} rows {rows}"] = f"{d.backend} {d.kernel or ''}: {d.reason}"
                decisions[f"{name} class"] = type(m).__name__ + (" (settled)" if "_tritonmm_unsettled"
                                                                 in type(m).__dict__ else "")
    return seen, decisions


keyed, decisions = keyed_calls()
print("keyed calls per decode, swapped:", keyed)
for k, v in decisions.items():
    print(f"  {k}: {v}")
reps = []
for rep in range(2):
    reps.append(alternate())
    print(rep, json.dumps(reps[-1]), flush=True)
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "h200_decode_parts.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "device": torch.cuda.get_device_name() if gpu else "cpu",
               "torch": torch.__version__, "config": config, "batch": batch, "rounds": rounds,
               "keyed_calls_per_decode_swapped": keyed, "routes_swapped": decisions, "reps": reps}, f, indent=1)
