"""Diagnostic: a fused Llama model's eager decode and 1 x 512 prefill (KV cache; the last position's logits) as
shipped, and with the MLP calls of up to 16 rows running the torch expression instead of the gated GEMM kernel
(``gated.GATED_MAX_M`` and ``gated.KERNEL_MAX_FLOPS_NO_GRAD`` set to 0: ``fuse_torch_small``), against tritonmm
off and its A/A control, alternated as ``bench --model`` alternates its modes; and with each layer's RMSNorm folded
into its MLP's gated kernel (``norm_fold.FOLD``: ``fuse_folded``). The question it answers: whether the gated kernel's
eager launches or the fused modules' own checks make host-paced decode slower than off, and what the fold's host
cost does there.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/decode_path_ab.py [CONFIG] [ROUNDS]  (writes $OUT/decode_path_ab.json)
"""

import contextlib
import json
import os
import sys

import torch

import tritonmm
from tritonmm.bench import model as bench_model
from tritonmm.bench.timing import machine_facts
from tritonmm.dispatch import gated
from tritonmm.modules import norm_fold
from tritonmm.ops import gated as gated_op

config = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-2l"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
model = bench_model.build_model(config, device, dtype)
norm_fold.FOLD = True
tritonmm.fuse(model)  # packed once; "off" runs the unfused forward on the same packed weights
folding = [(layer, type(layer)) for layer in model.modules() if "_tritonmm_folds" in type(layer).__dict__]
norm_fold.FOLD = False
for layer, cls in folding:  # ("fuse_folded" gives them their folding class back, a swap that resets nothing)
    layer.__class__ = cls._tritonmm_fused_base
shipped = gated.GATED_MAX_M, gated.KERNEL_MAX_FLOPS_NO_GRAD


@contextlib.contextmanager
def variant(fused=True, small_kernel=True, fold=False):
    if fold:
        for layer, cls in folding:
            layer.__class__ = cls
    if not small_kernel:
        gated.GATED_MAX_M, gated.KERNEL_MAX_FLOPS_NO_GRAD = 0, 0
    gated_op.clear_cache()  # (bound replays keep the path's decision)
    if not fused:
        tritonmm.unfuse(model, unpack=False)
    try:
        yield
    finally:
        if not fused:
            tritonmm.fuse(model)
        gated.GATED_MAX_M, gated.KERNEL_MAX_FLOPS_NO_GRAD = shipped
        gated_op.clear_cache()
        if fold:
            for layer, cls in folding:
                layer.__class__ = cls._tritonmm_fused_base


modes = {"off": lambda: variant(fused=False), "fuse": variant, "fuse_torch_small": lambda: variant(small_kernel=False),
         "fuse_folded": lambda: variant(fold=True), "control": lambda: variant(fused=False)}  # (control: off again)
rows = []
vocab = model.config.vocab_size
with torch.no_grad():
    for batch in (1, 16):
        prompt, step = bench_model._tokens(vocab, batch, 64, device), bench_model._tokens(vocab, batch, 32, device)
        ms = bench_model.alternate({m: (ctx, bench_model.decoder(model, prompt, step)) for m, ctx in modes.items()},
                                   device, 2 * rounds, iters=1)
        rows.append(bench_model._row(f"eager decode {batch} seq x 32 tokens", config, ms))
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items() if "ratio" in k or "interval" in k})
    ids = bench_model._tokens(vocab, 1, 512, device)
    last = bench_model.prefill_kwargs(model)
    ms = bench_model.alternate({m: (ctx, lambda: model(ids, use_cache=False, **last)) for m, ctx in modes.items()},
                               device, 4 * rounds, iters=3)
    rows.append(bench_model._row("eager prefill 1 x 512", config, ms))
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items() if "ratio" in k or "interval" in k})
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "decode_path_ab.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "rows": rows}, f, indent=1)
