"""Diagnostic: where the compiled static-cache decode (``bench --model``'s serving phase: transformers' StaticCache,
``torch.compile(mode="reduce-overhead", fullgraph=True)``) spends its GPU time per token, tritonmm off against
``fuse``, ``fuse`` with q, k and v traced as one GEMM (``qkv_traced.SERVE_COMPILED``), and that with the lm_head
swapped (``swap_linear``: tritonmm's dispatch, Triton or cuBLAS, picks its GEMM): each mode's wall time
per token (CUDA events around the 32-token decode, modes alternated), and each kernel's GPU time per token from
torch.profiler, with the weights' sizes to read the GEMMs' times against the HBM bandwidth. The question it
answers: which kernels of the decode step ``fuse`` could still make faster.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/static_decode_kernels.py [CONFIG] [BATCH...]
    (default llama3-8b-2l 1 16; writes $OUT/static_decode_kernels.json; step static_kernels of h200_run.sh)
"""

import copy
import inspect
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import tritonmm
from tritonmm.bench.model import _rewind, _tokens, build_model
from tritonmm.bench.timing import machine_facts, warm_up_gpu
from tritonmm.modules import qkv_traced

NEW_TOKENS, PROMPT = 32, 64


def _decoder(model, batch: int, device, fuse: bool, lm_head: bool = False):
    """A compiled decode of NEW_TOKENS tokens on a StaticCache filled with a PROMPT-token prompt (as the model
    benchmark's static phase builds it)."""
    from transformers import StaticCache

    vocab = model.config.vocab_size
    torch.manual_seed(batch)
    prompt, step = _tokens(vocab, batch, PROMPT, device), _tokens(vocab, batch, NEW_TOKENS, device)
    positions = [torch.tensor([PROMPT + t], device=device) for t in range(NEW_TOKENS)]
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    by_position = "cache_position" in inspect.signature(type(model.model).forward).parameters
    if fuse:
        tritonmm.fuse(model)
    if lm_head:
        tritonmm.swap_linear(model.lm_head)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
    with torch.no_grad():
        model(prompt, use_cache=True, **{cache_arg: cache},
              **({"cache_position": torch.arange(PROMPT, device=device)} if by_position else {}))
    forward = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def decode():
        _rewind(cache, PROMPT)
        for t in range(NEW_TOKENS):
            out = forward(step[:, t:t + 1], use_cache=True, position_ids=positions[t].expand(batch, 1),
                          **{cache_arg: cache}, **({"cache_position": positions[t]} if by_position else {}))
        return out.logits

    return decode


def _serving_qkv(fn):
    """``fn`` run (and so traced) with qkv_traced.SERVE_COMPILED on."""

    def run():
        qkv_traced.SERVE_COMPILED = True
        try:
            return fn()
        finally:
            qkv_traced.SERVE_COMPILED = False
    return run


def _wall_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _kernels(fn) -> list[dict]:
    """Each kernel's GPU time (µs) and calls per token, from torch.profiler over two decodes."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    per = 2 * NEW_TOKENS
    rows = [{"name": e.key[:140], "us": round(e.device_time_total / per, 2), "calls": round(e.count / per, 2)}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])


def main():
    config = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-2l"
    batches = [int(s) for s in sys.argv[2:]] or [1, 16]
    device = torch.device("cuda")
    warm_up_gpu()
    model = build_model(config, device, torch.bfloat16)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    out = {"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "config": config,
           "weights": [{"name": n, "mb": round(p.numel() * p.element_size() / 1e6, 2)}
                       for n, p in model.named_parameters() if p.dim() == 2 and ".1." not in n], "rows": []}
    path = os.path.join(os.environ.get("OUT", "/tmp/out"), "static_decode_kernels.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for batch in batches:
        runs = {m: _decoder(copy.deepcopy(model, memo=dict(shared)), batch, device, m.startswith("fuse"),
                            m.endswith("lm"))
                for m in ("off", "fuse", "fuse_qkv", "fuse_qkv_lm", "off_again")}
        runs["fuse_qkv"], runs["fuse_qkv_lm"] = _serving_qkv(runs["fuse_qkv"]), _serving_qkv(runs["fuse_qkv_lm"])
        with torch.no_grad():
            for fn in runs.values():
                for _ in range(3):
                    fn()
            walls = {m: [] for m in runs}
            for _ in range(8):
                for m, fn in runs.items():
                    walls[m].append(_wall_ms(fn) * 1e3 / NEW_TOKENS)
            row = {"batch": batch}
            for m, fn in runs.items():
                ks = _kernels(fn)
                row[m] = {"wall_us_per_token": round(statistics.median(walls[m]), 1),
                          "kernel_us_per_token": round(sum(k["us"] for k in ks), 1),
                          "launches_per_token": round(sum(k["calls"] for k in ks), 1), "kernels": ks}
                print(f"{batch} seq {m:9}: wall {row[m]['wall_us_per_token']:7.1f} µs/token, kernels "
                      f"{row[m]['kernel_us_per_token']:7.1f} µs in {row[m]['launches_per_token']:.0f} launches",
                      flush=True)
                for k in ks[:14]:
                    print(f"    {k['us']:8.2f} µs {k['calls']:5.2f}x  {k['name'][:110]}", flush=True)
        row["fuse_ratio"] = round(row["off"]["wall_us_per_token"] / row["fuse"]["wall_us_per_token"], 4)
        for m in ("fuse_qkv", "fuse_qkv_lm"):
            row[f"{m}_ratio"] = round(row["off"]["wall_us_per_token"] / row[m]["wall_us_per_token"], 4)
        row["control_ratio"] = round(row["off"]["wall_us_per_token"] / row["off_again"]["wall_us_per_token"], 4)
        print(f"{batch} seq: off / fuse {row['fuse_ratio']:.3f}, off / fuse_qkv {row['fuse_qkv_ratio']:.3f}, "
              f"off / fuse_qkv_lm {row['fuse_qkv_lm_ratio']:.3f}, "
              f"off / off again {row['control_ratio']:.3f}", flush=True)
        out["rows"].append(row)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        del runs
        torch._dynamo.reset()
    tritonmm.clear_cache()


if __name__ == "__main__":
    main()
