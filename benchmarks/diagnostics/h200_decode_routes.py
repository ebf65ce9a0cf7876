"""The route each linear layer of the Llama-3-8B-sized model (2 layers) takes in eager decode, swapped in, and
each swapped layer's host time per call against nn.Linear at decode rows.

Usage: PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_decode_routes.py  (prints; writes
$OUT/h200_decode_routes.json)
"""
import json
import os
import timeit

import torch
from transformers import DynamicCache

import tritonmm
from tritonmm import api
from tritonmm.bench.model import _tokens, build_model

dev = torch.device("cuda")
model = build_model("llama3-8b-2l", dev, torch.bfloat16)
linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
rows = []
with torch.no_grad():
    tritonmm.swap_linear(model)
    for batch in (1, 16):
        cache = DynamicCache()
        model(_tokens(model.config.vocab_size, batch, 64, dev), use_cache=True, past_key_values=cache)
        for t in range(4):
            model(_tokens(model.config.vocab_size, batch, 1, dev), use_cache=True, past_key_values=cache)
        torch.cuda.synchronize()
        seen = set()
        for name, m in linears.items():
            w = m.weight
            key = (batch, tuple(w.shape))
            if key in seen:
                continue
            seen.add(key)
            x = torch.randn(batch, 1, w.shape[1], device=dev, dtype=torch.bfloat16)
            d = tritonmm.explain(x, w.t())
            plain = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=dev, dtype=torch.bfloat16)
            g = dict(m=m, plain=plain, x=x, torch=torch)
            us = {}
            for _ in range(2):
                for k, s in (("swapped_us", "m(x)"), ("nn_linear_us", "plain(x)")):
                    us[k] = min(timeit.repeat(s, "torch.cuda.synchronize()", globals=g, number=50, repeat=9)) / 50 * 1e6
            row = {"rows": batch, "layer": name, "N": w.shape[0], "K": w.shape[1], "backend": d.backend,
                   "kernel": d.kernel, "reason": d.reason, "class": type(m).__name__,
                   "plan": str(api._plans_get(id(w)))[:80], **{k: round(v, 2) for k, v in us.items()}}
            print(row)
            rows.append(row)
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "h200_decode_routes.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "rows": rows}, f, indent=1)
