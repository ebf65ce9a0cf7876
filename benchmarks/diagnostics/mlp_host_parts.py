"""Diagnostic: where a fused MLP call's host time goes inside a Llama prefill, against the same call alone.

A Llama-3-8B-sized model (bench --model's llama3-8b-2l, bf16), fused, with the gated GEMM on packed weights from
2^33 FLOP per projection (so its 1 x 512 prefill's MLPs take it), and tritonmm off. Each MLP call's host time is
split into its parts, each timed with a wrapper (the same wrappers in every setting): the whole MLP forward, the
gated linear's bound replay (one kernel launch and one allocation), Triton's launcher alone, the down projection's
F.linear (off: the whole forward only; hooks on its children would unfuse it). Settings: inside prefills (the calls as the model makes them), and the
same MLP module on the same input called alone back to back, each call issued behind ``torch.cuda._sleep`` so the
GPU never drains (the host's own time); and the same in eager decode with a KV cache (1 and 16 sequences), with
each attention call's host time too. The question it answers: which part costs more host time in the model than
alone, and whether the packed path's extra host time in a prefill is its Python or its launches.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/mlp_host_parts.py   (writes $OUT/mlp_host_parts.json)
"""

import collections
import json
import os
import statistics
import time

import torch

import tritonmm
from tritonmm.bench import model as bench_model
from tritonmm.bench.timing import machine_facts
from tritonmm.dispatch import gated_cublas
from tritonmm.kernels import launch as _launch
from tritonmm.modules import fusion
from tritonmm.ops import gated as gated_op

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (CPU: a smoke test of the script)
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
cuda = device.type == "cuda"
model = bench_model.build_model("llama3-8b-2l" if cuda else "tiny", device, dtype)
tritonmm.fuse(model)
gated_cublas.PACKED_KERNEL_MIN_FLOPS = 2**33 if cuda else None
times = collections.defaultdict(list)
now = time.perf_counter_ns


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = now()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name].append((now() - t0) / 1e3)
    return wrapper


# the parts: the down projection's F.linear as the fused forward calls it, the bound replays (wrapped as they are
# stored), Triton's launcher (DirectLaunch's bound run), the off path's child modules
fusion._F_linear = timed("down F.linear", fusion._F_linear)


class _Timed(dict):
    def get(self, key, default=None):
        run = super().get(key, default)
        return None if run is None else (run if getattr(run, "_timed", False) else self._wrap(key, run))

    def _wrap(self, key, run):
        w = timed("replay", run)
        w._timed = True
        self[key] = w
        return w


gated_op._fast = _Timed()
_orig_call = _launch.DirectLaunch.__call__


def _direct(self, args):
    if self.run is not None and not getattr(self.run, "_timed", False):
        self.run = timed("triton launcher", self.run)
        self.run._timed = True
    return _orig_call(self, args)


_launch.DirectLaunch.__call__ = _direct
mlps = [layer.mlp for layer in model.model.layers]
for m in mlps:
    m.register_forward_pre_hook(lambda mod, args: mod.__dict__.__setitem__("_t0", now()))
    m.register_forward_hook(lambda mod, args, out: times["MLP forward"].append((now() - mod._t0) / 1e3))


def summary():
    out = {k: {"median_us": statistics.median(v), "calls": len(v)} for k, v in times.items()}
    times.clear()
    return out


def issue_us(fn, n, per=1, warm=1):
    """Median host µs to issue ``fn`` (over ``n`` calls after ``warm`` untimed ones, each then synchronized), divided
    by ``per``; the parts' times of those calls are kept."""
    with torch.no_grad():
        for _ in range(warm):
            fn()
        if cuda:
            torch.cuda.synchronize()
        times.clear()
        t = []
        for _ in range(n):
            t0 = now()
            fn()
            t.append((now() - t0) / 1e3 / per)
            if cuda:
                torch.cuda.synchronize()
    return statistics.median(t)


def in_prefill(ids, n=20):
    last = bench_model.prefill_kwargs(model)
    return {"prefill issue_us": issue_us(lambda: model(ids, use_cache=False, **last), n, warm=3), **summary()}


def alone(x, n=20):
    mlp = mlps[0]
    with torch.no_grad():
        for _ in range(3):
            mlp(x)
        times.clear()
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(50_000_000)  # tens of ms of GPU time ahead of the calls: the host is not blocked
            for _ in range(n):
                mlp(x)
        if cuda:
            torch.cuda.synchronize()
    return summary()


def in_decode(batch, tokens=16, n=3):
    """Each MLP and attention call's host time in eager decode with a KV cache (``n`` decodes of ``tokens``)."""
    prompt = bench_model._tokens(model.config.vocab_size, batch, 64, device)
    step = bench_model._tokens(model.config.vocab_size, batch, tokens, device)
    decode = bench_model.decoder(model, prompt, step)
    return {"decode issue_us per token": issue_us(decode, n, per=tokens), **summary()}


for m in model.model.layers:
    a = m.self_attn
    a.register_forward_pre_hook(lambda mod, args, kwargs: mod.__dict__.__setitem__("_t0", now()), with_kwargs=True)
    a.register_forward_hook(lambda mod, args, out: times["attention forward"].append((now() - mod._t0) / 1e3))
rows = []
cases = [(f"prefill {b} x {s}", (lambda b=b, s=s: in_prefill(bench_model._tokens(model.config.vocab_size, b, s, device))),
          (b, s)) for b, s in ((1, 512), (2, 512))]
cases += [(f"decode {b} seq", (lambda b=b: in_decode(b)), (b, 1)) for b in (1, 16)]
chosen = os.environ.get("CASES")  # e.g. CASES=decode: only the cases whose name starts so
cases = [c for c in cases if not chosen or any(c[0].startswith(p) for p in chosen.split(","))]
for what, fn, (b, s) in cases:
    x = torch.randn(b, s, model.config.hidden_size, device=device, dtype=dtype)
    for setting in ("fuse", "off"):
        if setting == "off":
            tritonmm.unfuse(model, unpack=False)
        gated_op.clear_cache()
        for where, run in (("model", fn), ("alone", lambda: alone(x))):
            row = {"case": what, "setting": setting, "where": where, **run()}
            rows.append(row)
            print(json.dumps({k: (round(v["median_us"], 1) if isinstance(v, dict) else v) for k, v in row.items()}))
        if setting == "off":
            tritonmm.fuse(model)
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "mlp_host_parts.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "rows": rows}, f, indent=1)
