"""The model benchmark: a transformers Llama-architecture model with tritonmm off, swapped in,
patched in and fused (MLPs and attention projections), alternated in one process; and the per-call
host cost of each entry point.

Phases (each timed per mode, the order of the modes rotated round by round, wall time between
``torch.cuda.synchronize()`` calls): eager prefill, eager decode with a KV cache, a training step
(fp32 weights, bf16 autocast, AdamW), torch.compile prefill and CUDA-graph replay of a forward.
Ratios are off time / on time (> 1: tritonmm faster), against an A/A control (tritonmm off as a second
contender), each with a 95% interval (:func:`tritonmm.bench.timing.median_interval`). Eager prefill and
decode, paced by the host, whose wall time varies by a few percent from sample to sample on a shared host,
take twice the rounds.

Per-call rows time many back-to-back calls of a problem whose GPU work is shorter than its host work,
so the host sets the pace: the difference is what each call costs on the host.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import statistics
import time

import torch

from .timing import median_interval

CONFIGS = {
    # hidden 1024, 4 layers: host time dominates
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000),
    # Llama-3-8B dims, 2 layers: the GEMMs dominate
    "llama3-8b-2l": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
    # no GPU: a tiny model on the CPU
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
MODES = ("off", "swap", "patch", "fuse")
CONTROL = "control"
"""A second contender that is tritonmm off (the same calls as ``off``): its ratio is the A/A spread of the
method on this host, the noise floor the other ratios are read against."""


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_model(name: str, device, dtype):
    """A LlamaForCausalLM with random weights (transformers), in ``dtype``, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIGS[name], max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


@contextlib.contextmanager
def mode(name: str, model):
    """tritonmm off, swapped into ``model`` (``swap_linear``), patched into nn.Linear (``patch_linear``), or
    fused (``fuse``: each MLP's gate and up as one gated GEMM, each attention's q, k and v as one GEMM in
    captured CUDA graphs; the other linears stay nn.Linear)."""
    import tritonmm

    if name == "swap":
        tritonmm.swap_linear(model)
    if name == "patch":
        tritonmm.patch_linear()
    if name == "fuse":
        tritonmm.fuse(model)
    try:
        yield
    finally:
        if name == "swap":
            tritonmm.unswap_linear(model)
        if name == "patch":
            tritonmm.unpatch_linear()
        if name == "fuse":
            tritonmm.unfuse(model, unpack=False)  # (packed once: no copies between samples)


def _wall_ms(fn, device, iters: int) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


SAMPLE_MS = 25.0
"""Wall time of one sample: calls are repeated until a sample takes about this long."""


def alternate(runs: dict, device, rounds: int, iters: int = 1, warmup: int = 2) -> dict:
    """Milliseconds per call of each ``runs[mode] = (context, fn)`` in each round. The order of the modes
    rotates by one place per round, so that over ``len(runs)`` consecutive rounds (a block; ``rounds`` is
    rounded up to whole blocks) each mode is timed once in each place. Each sample repeats the call at least
    ``iters`` times and for about :data:`SAMPLE_MS`, right after one untimed call of the same mode (so no
    mode is timed cold after another mode's calls), with Python's garbage collector paused (it runs between
    rounds instead, as ``timeit`` pauses it). Each round starts with one untimed sample of its first mode:
    on the H200 the first sample after the pause between rounds ran up to 10% faster than the rest
    (``benchmarks/h200_model_first_place.json``), which would favour whichever mode comes first."""
    runs = {**runs, CONTROL: runs["off"]} if "off" in runs and CONTROL not in runs else dict(runs)
    names = list(runs)
    for name in names:
        ctx, fn = runs[name]
        with ctx():
            for _ in range(warmup):
                fn()
            once = _wall_ms(fn, device, 1)
        iters = max(iters, min(200, round(SAMPLE_MS / max(once, 1e-3))))
    times = {n: [] for n in names}
    rounds = -(-rounds // len(names)) * len(names)
    was_enabled = gc.isenabled()
    try:
        for r in range(rounds):
            gc.enable()
            gc.collect()
            gc.disable()
            order = names[r % len(names):] + names[:r % len(names)]
            ctx, fn = runs[order[0]]
            with ctx():
                _wall_ms(fn, device, iters)
            for name in order:
                ctx, fn = runs[name]
                with ctx():
                    fn()
                    times[name].append(_wall_ms(fn, device, iters))
    finally:
        if was_enabled:
            gc.enable()
    return times


def _row(phase: str, config: str, times: dict) -> dict:
    """Median ms per mode; per mode the median over rounds of off time / its time in the same round, each time
    first divided by the factor of its place in the round (the median over rounds of a time at that place over
    its round's median; :func:`alternate` rotates the order, so every mode takes every place equally often and
    an effect of the place cancels); and every round's times (``rounds_ms``). ``times`` lists the modes in the
    order :func:`alternate` timed them in its first round."""
    row = {"config": config, "phase": phase, **{f"{m}_ms": statistics.median(t) for m, t in times.items()}}
    names, n = list(times), len(times)
    rounds = min(len(t) for t in times.values())
    place = [[] for _ in range(n)]
    for r in range(rounds):
        order = names[r % n:] + names[:r % n]
        mid = statistics.median(times[m][r] for m in order)
        for p, m in enumerate(order):
            place[p].append(times[m][r] / mid)
    factor = [statistics.median(f) for f in place]
    at = lambda m, r: times[m][r] / factor[(names.index(m) - r) % n]  # noqa: E731  (a time, place removed)
    for m in names:
        if m != "off":
            ratios = [at("off", r) / at(m, r) for r in range(rounds)]
            row[f"{m}_ratio"] = statistics.median(ratios)
            row[f"{m}_interval"] = list(median_interval(ratios))
    row["rounds_ms"] = {m: [round(v, 4) for v in t] for m, t in times.items()}
    return row


def _tokens(vocab: int, batch: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(batch * 100003 + seq)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def eager_phases(name: str, device, rounds: int, small: bool) -> list[dict]:
    """Prefill, decode and (on a GPU) graph replay, eager, bf16 weights."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(name, device, dtype)
    vocab = model.config.vocab_size
    rows = []
    runs = lambda fn: {m: (lambda m=m: mode(m, model), fn) for m in MODES}  # noqa: E731
    host_rounds = 2 * rounds  # host-paced phases: more samples against the host's jitter
    prefill = [(1, 16)] if small else [(1, 512), (4, 1024)]
    for batch, seq in prefill:
        ids = _tokens(vocab, batch, seq, device)
        with torch.no_grad():
            ms = alternate(runs(lambda: model(ids, use_cache=False)), device, host_rounds, iters=3)
        rows.append(_row(f"eager prefill {batch} x {seq}", name, ms))
    from transformers import DynamicCache

    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    new_tokens = 4 if small else 32
    for batch in ((1,) if small else (1, 16)):
        prompt = _tokens(vocab, batch, 8 if small else 64, device)
        step = _tokens(vocab, batch, new_tokens, device)

        def decode(prompt=prompt, step=step):
            cache = DynamicCache()  # filled in place by each forward
            out = model(prompt, use_cache=True, **{cache_arg: cache})
            for t in range(new_tokens):
                out = model(step[:, t:t + 1], use_cache=True, **{cache_arg: cache})
            return out.logits

        with torch.no_grad():
            ms = alternate(runs(decode), device, host_rounds, iters=1)
        rows.append(_row(f"eager decode {batch} seq x {new_tokens} tokens", name, ms))
    if device.type == "cuda":
        for batch, seq in ((1, 16), (1, 128), (4, 512)):
            ids = _tokens(vocab, batch, seq, device)
            graphs = {}
            for m in (*MODES, CONTROL):  # the control replays a graph of its own (memory placed apart, as each mode's)
                with mode("off" if m == CONTROL else m, model), torch.no_grad():
                    graphs[m] = _capture(lambda: model(ids, use_cache=False).logits)
            ms = alternate({m: (contextlib.nullcontext, g.replay) for m, g in graphs.items()}, device, rounds, iters=20)
            rows.append(_row(f"cuda-graph replay {batch} x {seq}", name, ms))
            del graphs
    del model
    return rows


def _capture(fn):
    """A CUDA graph of ``fn`` (warmed up on a side stream first, as torch's docs do)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def train_phases(name: str, device, rounds: int, small: bool) -> list[dict]:
    """A training step: fp32 weights, bf16 autocast, AdamW; modes alternated on one model and optimizer."""
    model = build_model(name, device, torch.float32).train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    vocab = model.config.vocab_size
    rows = []
    for batch, seq in ([(2, 16)] if small else [(4, 512), (8, 2048)]):
        ids = _tokens(vocab, batch, seq, device)

        def step(ids=ids):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        runs = {m: (lambda m=m: mode(m, model), step) for m in MODES}
        rows.append(_row(f"train step {batch} x {seq}", name, alternate(runs, device, rounds, iters=2)))
    del model, opt
    return rows


def compile_phase(name: str, device, rounds: int) -> list[dict]:
    """torch.compile prefill 4 x 1024: one compiled copy of the model per mode, all reading the same parameters
    and buffers (copies of the modules only, so that no mode gains or loses by where its weights lie)."""
    import tritonmm

    model = build_model(name, device, torch.bfloat16)
    ids = _tokens(model.config.vocab_size, 4, 1024, device)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    copies = {m: copy.deepcopy(model, memo=dict(shared)) for m in (*MODES, CONTROL)}  # the control: off, its own copy
    tritonmm.swap_linear(copies["swap"])
    tritonmm.fuse(copies["fuse"])
    compiled = {m: torch.compile(c) for m, c in copies.items()}
    patched = lambda: tritonmm.patch_linear()  # noqa: E731  (nn.Linear patched only around its copy's calls)
    runs = {m: (patched if m == "patch" else contextlib.nullcontext, lambda m=m: compiled[m](ids, use_cache=False))
            for m in compiled}
    with torch.no_grad():
        ms = alternate(runs, device, rounds, iters=5, warmup=3)
    del copies, compiled, model
    torch._dynamo.reset()
    return [_row("torch.compile prefill 4 x 1024", name, ms)]


def _per_call_us(pairs: dict, device, rounds: int, calls: int) -> dict:
    """µs per call of each of two contenders, ``calls`` back-to-back calls a sample, their order reversed
    every other round (``rounds`` rounded up to an even number): medians over rounds, and ``over``: the
    median over pairs of consecutive rounds of (second - first), averaged over the pair (each contender is
    timed once first and once second in a pair, so an effect of the place in a round cancels)."""
    for fn in pairs.values():
        for _ in range(20):
            fn()
    times = {k: [] for k in pairs}
    names = list(pairs)
    for r in range(rounds + rounds % 2):
        for k in (names if r % 2 == 0 else names[::-1]):
            times[k].append(_wall_ms(pairs[k], device, calls) * 1e3)
    out = {k: statistics.median(v) for k, v in times.items()}
    first, second = times[names[0]], times[names[1]]
    out["over"] = statistics.median((second[i] + second[i + 1] - first[i] - first[i + 1]) / 2
                                    for i in range(0, len(first) - 1, 2))
    return out


def per_call_rows(device, rounds: int = 41, calls: int = 400) -> list[dict]:
    """Host cost per call of each entry point against the torch call it replaces (x 1 x 2048, weight
    5632 x 2048, bf16 on a GPU; fp32 on the CPU), with and without autograd, and of a Sequential of that Linear,
    GELU and a Linear back against the same modules fused (``tritonmm.fuse``); autocast forward + backward
    with fp32 weights (512 x 2048 x 5632); a GEMM forced to the Triton pointer kernel against a bare
    launch of the same compiled kernel."""
    import torch.nn.functional as F

    import tritonmm

    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    K, N = (2048, 5632) if gpu else (64, 176)
    rows = []

    def add(what, base, ours, fns, rounds=rounds, calls=calls):
        us = _per_call_us(fns, device, rounds, calls)
        rows.append({"row": what, "torch": base, "tritonmm": ours, "torch_us": us[base], "tritonmm_us": us[ours],
                     "over_us": us["over"], "ratio": us[base] / (us[base] + us["over"])})

    x = torch.randn(1, K, device=device, dtype=dtype)
    lin = torch.nn.Linear(K, N, device=device, dtype=dtype)
    swapped = tritonmm.swap_linear(copy.deepcopy(lin))
    w, b = lin.weight, lin.bias
    seq = torch.nn.Sequential(lin, torch.nn.GELU(), torch.nn.Linear(N, K, device=device, dtype=dtype))
    fused = tritonmm.fuse(copy.deepcopy(seq))
    for grad in (False, True):
        tag = "grad" if grad else "no_grad"
        with torch.set_grad_enabled(grad):
            add(f"nn.Linear, {tag}", "nn.Linear", "swapped", {"nn.Linear": lambda: lin(x), "swapped": lambda: swapped(x)})
            add(f"F.linear, {tag}", "F.linear", "tritonmm.linear",
                {"F.linear": lambda: F.linear(x, w, b), "tritonmm.linear": lambda: tritonmm.linear(x, w, b)})
            wt = w.detach().t()
            add(f"matmul, {tag}", "torch.matmul", "tritonmm.matmul",
                {"torch.matmul": lambda: torch.matmul(x, wt), "tritonmm.matmul": lambda: tritonmm.matmul(x, wt)})
            add(f"Linear + GELU + Linear, {tag}", "nn.Sequential", "fused",
                {"nn.Sequential": lambda: seq(x), "fused": lambda: fused(x)})
    if gpu:  # fp32 master weights under bf16 autocast, forward + backward
        M = 512
        x32 = torch.randn(M, K, device=device, requires_grad=True)
        lin32 = torch.nn.Linear(K, N, device=device)
        sw32 = tritonmm.swap_linear(copy.deepcopy(lin32))

        def fwd_bwd(m):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = m(x32)
            y.float().sum().backward()

        add("autocast fwd+bwd 512 x 2048 x 5632, fp32 weights", "nn.Linear", "swapped",
            {"nn.Linear": lambda: fwd_bwd(lin32), "swapped": lambda: fwd_bwd(sw32)}, rounds=rounds, calls=20)
        rows.append(_triton_route_row(device, rounds, calls))
    return rows


def _triton_route_row(device, rounds: int, calls: int) -> dict:
    """tritonmm.matmul forced to the pointer kernel against the same compiled kernel launched bare
    (output allocated, then one direct launch), 16 x 64 x 64 bf16."""
    import tritonmm
    from tritonmm.kernels import launchers

    a = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    b = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    with tritonmm.force_backend("triton", "pointer"):
        config = tritonmm.explain(a, b).config or None
        tritonmm.matmul(a, b)
    launch = launchers.pointer_launcher(16, 64, 64, 1, 1, (0, 0, 64, 1), (0, 0, 64, 1), (0, 0, 64, 1), a.dtype, device,
                                        config=config)

    def bare():
        out = torch.empty(16, 64, device=device, dtype=a.dtype)
        launch(a, b, out, None)

    bare()
    forced = tritonmm.force_backend("triton", "pointer", launch.state["config"])
    with forced:
        us = _per_call_us({"bare launch": bare, "tritonmm.matmul": lambda: tritonmm.matmul(a, b)}, device, rounds, calls)
    return {"row": "Triton route, forced pointer kernel 16 x 64 x 64", "torch": "bare launch",
            "tritonmm": "tritonmm.matmul", "torch_us": us["bare launch"], "tritonmm_us": us["tritonmm.matmul"],
            "over_us": us["over"], "ratio": us["bare launch"] / (us["bare launch"] + us["over"])}


def run(device, rounds: int = 15, configs=None, phases=None, progress=print, measured=None) -> dict:
    """Every phase of every config, then the per-call rows; returns what the JSON holds. ``rounds`` is
    rounded up to whole blocks (:func:`alternate`). ``measured(rows)``, if given, gets the phase rows
    measured so far after each phase (the CLI keeps them on disk, so a run cut short keeps its rows)."""
    rounds = max(1, rounds)
    gpu = device.type == "cuda"
    configs = configs or (["small", "llama3-8b-2l"] if gpu else ["tiny"])
    phases = phases or (["eager", "train", "compile"] if gpu else ["eager", "train"])
    rows = []
    progress(f"each phase as it ends:\n{_HEADER}")
    for name in configs:
        small = name == "tiny"
        for phase in phases:
            progress(f"model {name}: {phase}")
            fn = {"eager": eager_phases, "train": train_phases}.get(phase)
            new = fn(name, device, rounds, small) if fn else compile_phase(name, device, rounds)
            for r in new:
                progress(_line(r))
            rows += new
            if measured is not None:
                measured(rows)
            if gpu:
                torch.cuda.empty_cache()
    progress("measuring the per-call rows")
    return {"phases": rows, "per_call": per_call_rows(device)}


def _line(r: dict) -> str:
    nan = float("nan")
    return (f"{r['config']:14} {r['phase']:36} {r['off_ms']:>9.3f} {r['swap_ratio']:>6.3f} {r['patch_ratio']:>6.3f} "
            f"{r.get('fuse_ratio', nan):>6.3f} {r.get('control_ratio', nan):>6.3f}")


_HEADER = f"{'config':14} {'phase':36} {'off ms':>9} {'swap':>6} {'patch':>6} {'fuse':>6} {'A/A':>6}  (off time / on time)"


def print_report(result: dict) -> None:
    print(_HEADER)
    for r in result["phases"]:
        print(_line(r))
    print("\nper call (µs): torch call, tritonmm call (medians over rounds), cost over torch (median over pairs of "
          "rounds in opposite orders of the difference), ratio torch / (torch + cost)")
    for r in result["per_call"]:
        print(f"{r['row']:52} {r['torch']:>14} {r['torch_us']:>8.2f}  {r['tritonmm']:>16} {r['tritonmm_us']:>8.2f}  "
              f"{r['over_us']:>+6.2f}  {r['ratio']:.3f}")


def markdown(result: dict) -> str:
    """The README's model table."""
    lines = ["| model | phase | off ms | swap_linear | patch_linear | fuse | off again (A/A) |",
             "|---|---|---|---|---|---|---|"]

    def cell(r, m):
        if f"{m}_ratio" not in r:
            return "-"
        lo_hi = r.get(f"{m}_interval")
        return f"{r[f'{m}_ratio']:.3f}x" + (f" ({lo_hi[0]:.3f}-{lo_hi[1]:.3f})" if lo_hi else "")

    for r in result["phases"]:
        lines.append(f"| {r['config']} | {r['phase']} | {r['off_ms']:.2f} | {cell(r, 'swap')} | "
                     f"{cell(r, 'patch')} | {cell(r, 'fuse')} | {cell(r, 'control')} |")
    lines += ["", "| per call | torch µs | tritonmm µs | over |", "|---|---|---|---|"]
    for r in result["per_call"]:
        lines.append(f"| {r['row']} ({r['torch']} vs {r['tritonmm']}) | {r['torch_us']:.1f} | {r['tritonmm_us']:.1f} | "
                     f"{r['over_us']:+.2f} µs |")
    return "\n".join(lines)
