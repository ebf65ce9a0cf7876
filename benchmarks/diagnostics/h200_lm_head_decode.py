"""Whether the 8B-sized 16-sequence eager decode pays for lm_head's path through tritonmm (its weight plan is 0:
some of its GEMMs may reach Triton, so the swapped layer never settles and each call checks the plan's kept
input sizes): off, lm_head alone swapped in (``lm_swap``), and lm_head alone swapped in then given its settled
class by hand (``lm_settled``: ``F.linear`` with no checks, what a settled layer runs), alternated as the model
benchmark alternates its modes, three times.

Usage: PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_lm_head_decode.py  (prints; writes
$OUT/h200_lm_head_decode.json). On a CPU it dry-runs a tiny model.
"""
import contextlib
import json
import os

import torch

import tritonmm
from tritonmm import nn as tnn
from tritonmm.bench import model as bm

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
config, batch = ("llama3-8b-2l", 16) if dev.type == "cuda" else ("tiny", 2)
model = bm.build_model(config, dev, torch.bfloat16)
vocab = model.config.vocab_size
decode = bm.decoder(model, bm._tokens(vocab, batch, 64, dev), bm._tokens(vocab, batch, 32, dev))


@contextlib.contextmanager
def lm_swap(settled=False):
    tritonmm.swap_linear(model, lambda m, n: n == "lm_head")
    if settled:
        with torch.no_grad():
            decode()  # (makes the weight's plan)
        cls = type(model.lm_head)
        if "_tritonmm_unsettled" not in cls.__dict__:  # (on a CPU it settled itself: its plan is 2 there)
            object.__setattr__(model.lm_head, "__class__", tnn._settled_classes[cls])
    try:
        yield
    finally:
        tritonmm.unswap_linear(model)


runs = {"off": (contextlib.nullcontext, decode), "lm_swap": (lm_swap, decode),
        "lm_settled": (lambda: lm_swap(True), decode)}
reps = []
with torch.no_grad():
    for rep in range(3):
        ms = bm.alternate(runs, dev, 40 if dev.type == "cuda" else 4)
        row = bm._row(f"eager decode {batch} seq x 32 tokens", config, ms)
        keep = {k: (round(v, 4) if isinstance(v, float) else [round(x, 4) for x in v])
                for k, v in row.items() if k.endswith(("_ms", "_ratio", "_interval")) and k != "rounds_ms"}
        print(rep, keep, flush=True)
        reps.append(keep)
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "h200_lm_head_decode.json"), "w") as f:
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    json.dump({"what": __doc__.split("\n\n")[0], "device": device, "torch": torch.__version__, "config": config,
               "batch": batch, "rounds": 40, "reps": reps}, f, indent=1)
