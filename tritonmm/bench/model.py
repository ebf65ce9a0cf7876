"""The model benchmark: a transformers Llama-architecture model with tritonmm off, swapped in,
patched in and fused (MLPs and attention projections), alternated in one process; and the per-call
host cost of each entry point (:mod:`tritonmm.bench.per_call`).

Phases (each timed per mode, the order of the modes rotated round by round, wall time between
``torch.cuda.synchronize()`` calls): eager prefill (the last position's logits, as ``generate`` computes them:
:func:`prefill_kwargs`), eager decode with a KV cache, a training step (fp32 weights, bf16 autocast, AdamW),
torch.compile prefill, CUDA-graph replay of a forward, and decode with a static KV cache under
``torch.compile(mode="reduce-overhead")`` (off against fuse).
Ratios are off time / on time (> 1: tritonmm faster), against an A/A control (tritonmm off as a second
contender), each with a 95% interval (:func:`tritonmm.bench.timing.median_interval`). Eager decode (paced by the
host, whose wall time varies by a few percent between samples) and prefills (short rounds) take four times the rounds.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import statistics
from unittest import mock

import torch

from .model_report import _HEADER, UNFOLDED, _line
from .per_call import per_call_rows
from .timing import collect_young, gc_paused, median_interval, wall_ms

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
    captured CUDA graphs; the other linears stay nn.Linear), or fused without the RMSNorm folds (:data:`UNFOLDED`)."""
    import tritonmm
    from tritonmm.modules import norm_fold

    if name == "swap":
        tritonmm.swap_linear(model)
    if name == "patch":
        tritonmm.patch_linear()
    if name in ("fuse", UNFOLDED):
        with mock.patch.object(norm_fold, "FOLD", name == "fuse" and norm_fold.FOLD):
            tritonmm.fuse(model)
    try:
        yield
    finally:
        if name == "swap":
            tritonmm.unswap_linear(model)
        if name == "patch":
            tritonmm.unpatch_linear()
        if name in ("fuse", UNFOLDED):
            tritonmm.unfuse(model, unpack=False)  # (packed once: no copies between samples)


SAMPLE_MS = 25.0
"""Wall time of one sample: calls are repeated until a sample takes about this long."""


def alternate(runs: dict, device, rounds: int, iters: int = 1, warmup: int = 2) -> dict:
    """Milliseconds per call of each ``runs[mode] = (context, fn)`` in each round. The order of the modes
    rotates by one place per round, so that over ``len(runs)`` consecutive rounds (a block; ``rounds`` is
    rounded up to whole blocks) each mode is timed once in each place. Each sample repeats the call at least
    ``iters`` times and for about :data:`SAMPLE_MS`, right after one untimed call of the same mode (so no
    mode is timed cold after another mode's calls), with Python's garbage collector paused (it runs between
    rounds instead, as ``timeit`` pauses it). Each round starts with one untimed sample of its first mode:
    the first sample after the pause between rounds can run faster than the rest
    (``benchmarks/diagnostics/h200_model_first_place.json``), which would favour whichever mode comes first."""
    runs = {**runs, CONTROL: runs["off"]} if "off" in runs and CONTROL not in runs else dict(runs)
    names = list(runs)
    for name in names:
        ctx, fn = runs[name]
        with ctx():
            for _ in range(warmup):
                fn()
            once = wall_ms(fn, device, 1)
        iters = max(iters, min(200, round(SAMPLE_MS / max(once, 1e-3))))
    times = {n: [] for n in names}
    rounds = -(-rounds // len(names)) * len(names)
    with gc_paused():
        for r in range(rounds):
            collect_young()
            order = names[r % len(names):] + names[:r % len(names)]
            ctx, fn = runs[order[0]]
            with ctx():
                wall_ms(fn, device, iters)
            for name in order:
                ctx, fn = runs[name]
                with ctx():
                    fn()
                    times[name].append(wall_ms(fn, device, iters))
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


def prefill_kwargs(model) -> dict:
    """The keyword that makes ``model`` compute the logits of the last position only (``logits_to_keep=1``, as
    transformers' ``generate`` passes in a prefill), or nothing where its forward has no such argument."""
    params = inspect.signature(model.forward).parameters
    return next(({name: 1} for name in ("logits_to_keep", "num_logits_to_keep") if name in params), {})


def _tokens(vocab: int, batch: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(batch * 100003 + seq)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def decoder(model, prompt: torch.Tensor, step: torch.Tensor):
    """A function running one eager decode of ``model`` with a fresh KV cache (transformers' ``DynamicCache``):
    ``prompt`` (batch, tokens) as one forward, then each column of ``step`` (batch, new tokens) as a forward of one
    token per sequence; it returns the last logits."""
    from transformers import DynamicCache

    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def decode():
        cache = DynamicCache()  # filled in place by each forward
        out = model(prompt, use_cache=True, **{cache_arg: cache})
        for t in range(step.shape[1]):
            out = model(step[:, t:t + 1], use_cache=True, **{cache_arg: cache})
        return out.logits

    return decode


def eager_phases(name: str, device, rounds: int, small: bool, modes=MODES) -> list[dict]:
    """Prefill, decode and (on a GPU) graph replay, eager, bf16 weights, in each of ``modes``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(name, device, dtype)
    vocab = model.config.vocab_size
    rows = []
    runs = lambda fn: {m: (lambda m=m: mode(m, model), fn) for m in modes}  # noqa: E731
    # decode, paced by the host, and prefill, as paced and with rounds of tens of ms: four times the rounds
    decode_rounds = prefill_rounds = 4 * rounds
    last = prefill_kwargs(model)
    for batch, seq in [(1, 16)] if small else [(1, 512), (4, 1024)]:
        ids = _tokens(vocab, batch, seq, device)
        with torch.no_grad():
            ms = alternate(runs(lambda: model(ids, use_cache=False, **last)), device, prefill_rounds, iters=3)
        rows.append(_row(f"eager prefill {batch} x {seq}", name, ms))
    new_tokens = 4 if small else 32
    for batch in ((1,) if small else (1, 16)):
        prompt, step = _tokens(vocab, batch, 8 if small else 64, device), _tokens(vocab, batch, new_tokens, device)
        decode = decoder(model, prompt, step)
        with torch.no_grad():
            ms = alternate(runs(decode), device, decode_rounds, iters=1)
        rows.append(_row(f"eager decode {batch} seq x {new_tokens} tokens", name, ms))
    if device.type == "cuda":
        for batch, seq in ((1, 16), (1, 128), (4, 512)):
            ids = _tokens(vocab, batch, seq, device)
            graphs = {}
            for m in (*modes, CONTROL):  # the control replays a graph of its own (memory placed apart, as each mode's)
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
        # the short step (tens of ms, where the host's jitter is a few percent of a sample) takes twice the rounds
        step_rounds = rounds if batch * seq > 2048 else 2 * rounds

        def step(ids=ids):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        runs = {m: (lambda m=m: mode(m, model), step) for m in MODES}
        rows.append(_row(f"train step {batch} x {seq}", name, alternate(runs, device, step_rounds, iters=2)))
    del model, opt
    return rows


def compile_phase(name: str, device, rounds: int) -> list[dict]:
    """torch.compile prefill 4 x 1024 (the last position's logits, :func:`prefill_kwargs`): one compiled copy of the
    model per mode, all reading the same parameters and buffers (copies of the modules only, so that no mode gains or
    loses by where its weights lie)."""
    import tritonmm

    model = build_model(name, device, torch.bfloat16)
    ids = _tokens(model.config.vocab_size, 4, 1024, device)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    copies = {m: copy.deepcopy(model, memo=dict(shared)) for m in (*MODES, CONTROL)}  # the control: off, its own copy
    tritonmm.swap_linear(copies["swap"])
    tritonmm.fuse(copies["fuse"])
    compiled = {m: torch.compile(c) for m, c in copies.items()}
    patched = lambda: tritonmm.patch_linear()  # noqa: E731  (nn.Linear patched only around its copy's calls)
    last = prefill_kwargs(model)
    runs = {m: (patched if m == "patch" else contextlib.nullcontext,
                lambda m=m: compiled[m](ids, use_cache=False, **last)) for m in compiled}
    with torch.no_grad():
        ms = alternate(runs, device, 4 * rounds, iters=5, warmup=3)  # short rounds: four times as many
    del copies, compiled, model
    torch._dynamo.reset()
    return [_row("torch.compile prefill 4 x 1024", name, ms)]


def static_decode_phase(name: str, device, rounds: int, batches=(1, 16), new_tokens: int = 32) -> list[dict]:
    """Decode with transformers' ``StaticCache``, the model compiled with ``mode="reduce-overhead"`` (CUDA graphs),
    ``fullgraph=True``: the serving setup. One compiled copy per mode (off, fuse and the control), all reading the
    same parameters but fuse's packed gate and up weights. The 64-token prompt is filled once (eager); each sample
    decodes the same ``new_tokens`` positions again, one token per sequence per call (the cache's slots rewritten)."""
    import tritonmm
    from transformers import StaticCache

    model = build_model(name, device, torch.bfloat16)
    vocab, prompt_len = model.config.vocab_size, 64
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    by_position = "cache_position" in inspect.signature(type(model.model).forward).parameters  # (older transformers)
    rows = []
    for batch in batches:
        prompt, step = _tokens(vocab, batch, prompt_len, device), _tokens(vocab, batch, new_tokens, device)
        positions = [torch.tensor([prompt_len + t], device=device) for t in range(new_tokens)]
        runs = {}
        for m in ("off", "fuse", CONTROL):
            copied = copy.deepcopy(model, memo=dict(shared))
            if m == "fuse":
                tritonmm.fuse(copied)
            cache = StaticCache(config=copied.config, max_cache_len=prompt_len + new_tokens)
            with torch.no_grad():
                copied(prompt, use_cache=True, **{cache_arg: cache},
                       **({"cache_position": torch.arange(prompt_len, device=device)} if by_position else {}))
            forward = torch.compile(copied, mode="reduce-overhead", fullgraph=True, dynamic=False)

            def decode(forward=forward, cache=cache):
                _rewind(cache, prompt_len)
                for t in range(new_tokens):
                    out = forward(step[:, t:t + 1], use_cache=True, position_ids=positions[t].expand(batch, 1),
                                  **{cache_arg: cache}, **({"cache_position": positions[t]} if by_position else {}))
                return out.logits

            runs[m] = (contextlib.nullcontext, decode)
        with torch.no_grad():
            ms = alternate(runs, device, rounds, iters=1, warmup=3)
        rows.append(_row(f"compiled static-cache decode {batch} seq x {new_tokens} tokens", name, ms))
        del runs
        torch._dynamo.reset()
    del model
    return rows


def _rewind(cache, length: int) -> None:
    """A static cache's write position back to ``length`` (transformers versions whose layers count the tokens
    written; older ones write at the ``cache_position`` each call passes)."""
    for layer in getattr(cache, "layers", ()):
        written = getattr(layer, "cumulative_length", None)
        if isinstance(written, torch.Tensor):
            written.fill_(length)
        elif written is not None:
            layer.cumulative_length = length


def run(device, rounds: int = 15, configs=None, phases=None, progress=print, measured=None, unfolded=False) -> dict:
    """Every phase of every config, then the per-call rows (``phases`` naming "per_call", as by default); returns what
    the JSON holds. ``rounds`` is rounded up to whole blocks (:func:`alternate`). ``measured(rows)``, if given, gets the
    phase rows measured so far after each phase (the CLI keeps them on disk, so a run cut short keeps its rows).
    ``unfolded``: the eager and CUDA-graph phases also time :data:`UNFOLDED`."""
    rounds = max(1, rounds)
    gpu = device.type == "cuda"
    configs = configs or (["small", "llama3-8b-2l"] if gpu else ["tiny"])
    phases = phases or (["eager", "train", "compile", "static", "per_call"] if gpu else ["eager", "train", "per_call"])
    rows = []
    progress(f"each phase as it ends:\n{_HEADER}")
    for name in configs:
        small = name == "tiny"
        for phase in (p for p in phases if p != "per_call"):
            progress(f"model {name}: {phase}")
            new = {"eager": lambda: eager_phases(name, device, rounds, small, (*MODES, UNFOLDED) if unfolded else MODES),
                   "train": lambda: train_phases(name, device, rounds, small),
                   "compile": lambda: compile_phase(name, device, rounds),
                   "static": lambda: static_decode_phase(name, device, rounds)}[phase]()
            for r in new:
                progress(_line(r))
            rows += new
            if measured is not None:
                measured(rows)
            if gpu:
                torch.cuda.empty_cache()
    if "per_call" not in phases:
        return {"phases": rows, "per_call": []}
    progress("measuring the per-call rows")
    return {"phases": rows, "per_call": per_call_rows(device)}
