"""Which half of ``tritonmm.fuse`` pays in eager mode: a transformers Llama (the model benchmark's configs, bf16)
with tritonmm off, fused whole, with its MLPs fused only and with its attentions fused only, the q/k/v GEMM served
in eager mode (``qkv.SERVE_EAGER = True``), alternated in one process as ``python -m tritonmm.bench --model``
alternates its modes (``tritonmm.bench.model.alternate`` and ``_row``; A/A control included).

Run from the repository root: ``PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_fuse_ab.py`` writes
``DIR/h200_fuse_ab.json``. Without a GPU it runs the tiny config on the CPU (a smoke test: there the MLP's
kernel runs under Triton's interpreter).
"""

import contextlib
import inspect
import json
import os

import torch
from transformers import DynamicCache

import tritonmm
from tritonmm import qkv
from tritonmm.bench import model as bm

FILTERS = {"fuse": None, "mlp": lambda module, name: "mlp" in name, "qkv": lambda module, name: "self_attn" in name}


def variant(name, model):
    @contextlib.contextmanager
    def ctx():
        if name == "off":
            yield
            return
        tritonmm.fuse(model, filter_fn=FILTERS[name])
        qkv.SERVE_EAGER = True
        try:
            yield
        finally:
            qkv.SERVE_EAGER = False
            tritonmm.unfuse(model, unpack=False)
    return ctx


def main():
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = dev.type == "cuda"
    out = {}
    for cfg in ("small", "llama3-8b-2l") if gpu else ("tiny",):
        model = bm.build_model(cfg, dev, torch.bfloat16 if gpu else torch.float32)
        vocab = model.config.vocab_size
        arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        prompt, step = bm._tokens(vocab, 1, 64, dev), bm._tokens(vocab, 1, 32, dev)

        def decode():
            cache = DynamicCache()
            model(prompt, use_cache=True, **{arg: cache})
            for t in range(32):
                model(step[:, t:t + 1], use_cache=True, **{arg: cache})

        phases = [("decode 1 seq x 32", decode)]
        if cfg != "llama3-8b-2l":
            for b, s in ((1, 512), (4, 1024)):
                ids = bm._tokens(vocab, b, s, dev)
                phases.append((f"prefill {b} x {s}", lambda ids=ids: model(ids, use_cache=False)))
        for phase, fn in phases:
            runs = {n: (variant(n, model), fn) for n in ("off", *FILTERS)}
            with torch.no_grad():
                ms = bm.alternate(runs, dev, (30 if cfg == "small" else 20) if gpu else 5, iters=1)
            row = bm._row(phase, cfg, ms)
            print(cfg, phase, {k: round(v, 3) for k, v in row.items() if "ratio" in k or k == "off_ms"}, flush=True)
            out[f"{cfg} {phase}"] = row
        model = None  # (frees it before the next config)
        if gpu:
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "h200_fuse_ab.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
