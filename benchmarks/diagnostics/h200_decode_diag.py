"""Diagnostics on a GPU (benchmarks/diagnostics/h200_decode_diag.json): what differs between tritonmm off / swapped /
patched in eager decode of the Llama-3-8B-sized model (kernels run, host ops, settled classes), the in-situ
cost of each check of the fast path, the host cost of a fused MLP at decode sizes, and eager decode with
``fuse`` against off. Run from the repository root with PYTHONPATH=. on a GPU, optionally naming the parts
(decode checks mlp fuse; DIAG_BATCHES="1 16" the decode's batch sizes); prints its findings. On a CPU it
dry-runs a tiny model."""
import collections
import contextlib
import copy
import cProfile
import os
import pstats
import sys

import torch
import torch.nn.functional as F

import tritonmm
from tritonmm import api
from tritonmm.bench import model as bm
from tritonmm.bench import per_call
from tritonmm.bench.timing import sync
from tritonmm.core.env import raw_env
from tritonmm.ops import routes

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = "llama3-8b-2l" if dev.type == "cuda" else "tiny"  # (a dry run on a CPU)
part = sys.argv[1:] or ["decode", "checks", "mlp", "fuse"]

if "decode" in part:
    model = bm.build_model(CONFIG, dev, torch.bfloat16)
    vocab = model.config.vocab_size

    @contextlib.contextmanager
    def swap_no_lm():
        tritonmm.swap_linear(model, lambda m, n: n != "lm_head")
        try:
            yield
        finally:
            tritonmm.unswap_linear(model)

    @contextlib.contextmanager
    def swap_lm_only():
        tritonmm.swap_linear(model, lambda m, n: n == "lm_head")
        try:
            yield
        finally:
            tritonmm.unswap_linear(model)

    for batch in [int(b) for b in os.environ.get("DIAG_BATCHES", "1 16").split()]:
        prompt, step = bm._tokens(vocab, batch, 64, dev), bm._tokens(vocab, batch, 32, dev)
        decode = bm.decoder(model, prompt, step)
        ctxs = {"off": lambda: bm.mode("off", model), "swap": lambda: bm.mode("swap", model),
                "patch": lambda: bm.mode("patch", model), "swap_no_lm": swap_no_lm,
                "swap_lm_only": swap_lm_only}
        kern = {}
        with torch.no_grad():
            for name, ctx in ctxs.items():
                with ctx():
                    decode(), decode()
                    classes = collections.Counter(type(m).__name__ + ("/settled" if "_tritonmm_unsettled" in type(m).__dict__ else "")
                                                  for m in model.modules() if isinstance(m, torch.nn.Linear))
                    lm = model.lm_head.weight
                    print(f"[{batch}] {name}: linear classes {dict(classes)}; lm_head plan {routes.plans.get(id(lm))}"
                          f" free {routes.free_ptrs.get(id(lm)) is not None}")
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        decode()
                        sync(dev)
                    ka = prof.key_averages()
                    cpu_ops = sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CPU)
                    cuda = {e.key: (e.count, e.device_time_total) for e in ka if e.device_time_total > 0 and e.count and
                            e.device_type == torch.autograd.DeviceType.CUDA}
                    kern[name] = cuda
                    print(f"[{batch}] {name}: cpu events {cpu_ops}, cuda kernels {sum(c for c, _ in cuda.values())}, "
                          f"cuda time {sum(t for _, t in cuda.values()) / 1e3:.2f} ms")
            base = kern["off"]
            for name in ctxs:
                if name == "off":
                    continue
                diff = {k: (kern[name].get(k, (0, 0)), base.get(k, (0, 0))) for k in set(kern[name]) | set(base)}
                diff = {k: v for k, v in diff.items() if v[0][0] != v[1][0] or abs(v[0][1] - v[1][1]) > 0.02 * max(v[1][1], 1)}
                print(f"[{batch}] kernels differing {name} vs off:")
                for k, ((c1, t1), (c0, t0)) in sorted(diff.items(), key=lambda kv: -abs(kv[1][0][1] - kv[1][1][1]))[:8]:
                    print(f"    {k[:90]:90s} {c1:5d} {t1 / 1e3:8.3f} ms | off {c0:5d} {t0 / 1e3:8.3f} ms")
            runs = {name: (ctx, decode) for name, ctx in ctxs.items()}
            for rep in range(2):
                ms = bm.alternate(runs, dev, 40 if dev.type == "cuda" else 5, iters=1)
                row = bm._row(f"decode {batch}", "llama3-8b-2l", ms)
                print(f"[{batch}] alternate rep {rep}: " + " ".join(f"{k}={v:.4f}" for k, v in row.items() if k.endswith(("ratio", "_ms")) and k != "rounds_ms"))
    del model

if "checks" in part:
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(2048, 5632, device=dev, dtype=torch.bfloat16)
    w, b = lin.weight, lin.bias
    tritonmm.linear(x, w, b)
    print("weight free:", routes.free_ptrs.get(id(w)) is not None)
    _free_get, _F = api._free_get, F.linear
    _dyn, _forced, B, K = api._dynamo_compiling, api._forced, api._BACKEND, api._KERNEL

    # each variant written out, its checks inline as the fast path has them (a shared helper would add a call)
    def call_only(input, weight, bias=None, activation="none"):
        return _F(input, weight, bias)

    def dict_ptr(input, weight, bias=None, activation="none"):
        ptr = _free_get(id(weight))
        if ptr is not None and ptr == weight.data_ptr():
            return _F(input, weight, bias)

    def dyn_dict_ptr(input, weight, bias=None, activation="none"):
        if _dyn():
            return None
        ptr = _free_get(id(weight))
        if ptr is not None and ptr == weight.data_ptr():
            return _F(input, weight, bias)

    def all_checks(input, weight, bias=None, activation="none"):
        if _dyn():
            return None
        ptr = _free_get(id(weight))
        if ptr is not None and _forced() is None and B not in raw_env and K not in raw_env:
            if ptr == weight.data_ptr():
                if activation == "none":
                    return _F(input, weight, bias)

    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for name, fn in (("call_only", call_only), ("dict_ptr", dict_ptr), ("dyn_dict_ptr", dyn_dict_ptr),
                             ("all_checks", all_checks), ("tritonmm.linear", tritonmm.linear)):
                us = per_call.per_call_us({"F.linear": lambda: F.linear(x, w, b), name: lambda fn=fn: fn(x, w, b)}, dev, 41, 400)
                print(f"checks grad={grad}: {name:16s} over F.linear {us['over']:+.3f} us (F.linear {us['F.linear']:.2f} us)")

if "mlp" in part:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    for hidden, inter in ((1024, 2816), (4096, 14336)):
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter)
        mlp = LlamaMLP(cfg).to(dev, torch.bfloat16)
        fused = tritonmm.fuse(torch.nn.Sequential(copy.deepcopy(mlp)))
        for M in (1, 16):
            x = torch.randn(1, M, hidden, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                torch.testing.assert_close(fused(x), mlp(x), rtol=2e-2, atol=2e-2)
                us = per_call.per_call_us({"eager": lambda: mlp(x), "fused": lambda: fused(x)}, dev, 41, 200)
                print(f"mlp {hidden}/{inter} M={M}: eager {us['eager']:.2f} us fused {us['fused']:.2f} us over {us['over']:+.2f}")
                if M == 1 and hidden == 1024:
                    cProfile.run("for _ in range(3000): fused(x)", "/tmp/prof_fused")
                    pstats.Stats("/tmp/prof_fused").sort_stats("tottime").print_stats(16)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            fused(x)
                            mlp(x)
                        sync(dev)
                    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))

if "fuse" in part:  # eager decode with the model fused: host ops and kernels, against off
    for config in (("small", "llama3-8b-2l") if dev.type == "cuda" else ("tiny",)):
        model = bm.build_model(config, dev, torch.bfloat16)
        vocab = model.config.vocab_size
        prompt, step = bm._tokens(vocab, 1, 64, dev), bm._tokens(vocab, 1, 32, dev)
        decode = bm.decoder(model, prompt, step)

        @contextlib.contextmanager
        def mlp_only():
            tritonmm.fuse(model, lambda m, n: n.endswith("mlp"), pack=False)
            try:
                yield
            finally:
                tritonmm.unfuse(model, unpack=False)

        ctxs = {"off": lambda: bm.mode("off", model), "fuse": lambda: bm.mode("fuse", model), "mlp_only": mlp_only}
        events = {}
        with torch.no_grad():
            for name, ctx in ctxs.items():
                with ctx():
                    decode(), decode()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        decode()
                        sync(dev)
                    ka = prof.key_averages()
                    events[name] = {e.key: (e.count, e.cpu_time_total, e.device_time_total) for e in ka}
                    cuda = sum(e.device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
                    print(f"[{config}] {name}: cpu events {sum(c for c, _, _ in events[name].values())}, cuda time {cuda / 1e3:.2f} ms")
            for name in ("fuse", "mlp_only"):
                keys = set(events[name]) | set(events["off"])
                diff = sorted(keys, key=lambda k: -abs(events[name].get(k, (0, 0, 0))[1] - events["off"].get(k, (0, 0, 0))[1]))
                print(f"[{config}] {name} vs off, events by CPU-time difference (count, cpu us, device us):")
                for k in diff[:14]:
                    print(f"    {k[:70]:70s} {events[name].get(k, (0, 0, 0))} | off {events['off'].get(k, (0, 0, 0))}")
            runs = {name: (ctx, decode) for name, ctx in ctxs.items()}
            ms = bm.alternate(runs, dev, 30 if dev.type == "cuda" else 3, iters=1)
            row = bm._row("decode 1", config, ms)
            print(f"[{config}] alternate: " + " ".join(f"{k}={v:.4f}" for k, v in row.items() if k.endswith(("ratio", "_ms")) and k != "rounds_ms"))
        if dev.type == "cuda":
            with torch.no_grad():
                x = torch.randn(1, 1, model.config.hidden_size, device=dev, dtype=torch.bfloat16)
                mlp = model.model.layers[0].mlp
                with mlp_only():
                    fused_mlp = lambda: mlp(x)  # noqa: E731
                    fused_mlp()
                    us = per_call.per_call_us({"eager": lambda: model.model.layers[1].mlp(x), "fused": fused_mlp}, dev, 41, 200)
                print(f"[{config}] in-model MLP at M=1: eager {us['eager']:.2f} us fused {us['fused']:.2f} us over {us['over']:+.2f}")
        del model
