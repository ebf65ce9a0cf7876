"""Timing both contenders side by side: CUDA events, L2 flushed, a GPU spin hiding host time,
contenders interleaved call by call (see :func:`_pair_times_ms`); an interval for a median of ratios."""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import platform
import subprocess
import time

import torch


def machine_facts() -> dict:
    import triton

    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                     memory_gib=round(props.total_memory / 2**30, 1))
        try:
            q = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,driver_version"
            out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout.strip().splitlines()
            facts["nvidia_smi"] = dict(zip(q.split(","), [v.strip() for v in out[0].split(",")])) if out else None
        except (OSError, subprocess.SubprocessError):
            facts["nvidia_smi"] = None
    return facts


HOST_SHIELD_CYCLES = 200_000
"""GPU clock cycles of the spin (``torch.cuda._sleep``) between each L2 flush and the timed call:
about 100 µs on an H200, so the host has enqueued the call before the GPU reaches its start event."""


def _event_times_ms(fn, rep: float, warmup: int = 3) -> list[float]:
    """Per-call GPU times (ms) of ``fn``: CUDA events around each call, L2 flushed before each, as
    ``triton.testing.do_bench`` does, plus a GPU spin after each flush. Without the spin, a call whose
    host path outlasts the flush is timed with the GPU idle, waiting for the host, and a short GEMM
    reads as slow as its host path. With the spin both contenders' host paths are hidden; per-call
    host cost is measured separately (``python -m tritonmm.bench --model``, per-call rows)."""
    return _pair_times_ms((fn,), rep, warmup)[0]


def _bench_us(fn, rep: int) -> float:
    """Median µs of ``fn`` (see :func:`_event_times_ms`)."""
    return float(torch.tensor(_event_times_ms(fn, rep, warmup=25)).median()) * 1e3


def _pair_times_ms(fns, rep: float, warmup: int = 3) -> list[list[float]]:
    """Per-call GPU times (ms) of one or more contenders interleaved call by call: each sample flushes L2
    and spins the GPU (see :func:`_event_times_ms`) before every contender's call, in turn, the order
    reversed on every other sample, so each contender's calls follow the same work (timing whole
    batches of one contender after the other read identical calls up to 5% apart). ``rep``: ms of
    samples per contender."""
    from triton.runtime import driver

    cache = driver.active.get_empty_cache_for_benchmark()
    for fn in fns:
        for _ in range(warmup):
            fn()
    k = len(fns)

    def timed(n: int) -> list[list[float]]:
        ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
              for _ in range(n)]
        for i, row in enumerate(ev):
            for j in (range(k) if i % 2 == 0 else reversed(range(k))):
                driver.active.clear_cache(cache)
                torch.cuda._sleep(HOST_SHIELD_CYCLES)
                row[j][0].record()
                fns[j]()
                row[j][1].record()
        torch.cuda.synchronize()
        return [[row[j][0].elapsed_time(row[j][1]) for row in ev] for j in range(k)]

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = timed(4)  # also sizes the run: wall time per sample of every contender, flushes and spins included
    per_sample_ms = (time.perf_counter() - t0) * 1e3 / 4 / k
    rest = timed(max(2, int(rep / per_sample_ms)))
    return [f + r for f, r in zip(first, rest)]


def _bench_pair(f_torch, f_tri, rep: int, rounds: int = 10) -> tuple[float, float]:
    """Median µs of two contenders timed call by call in alternation (:func:`_pair_times_ms`), ``rep``
    ms in all per contender over ``rounds`` synchronized batches, so clock and neighbour drift on a
    shared GPU hits both alike."""
    times = ([], [])
    for _ in range(rounds):
        for t, new in zip(times, _pair_times_ms((f_torch, f_tri), max(rep / rounds, 3))):
            t.extend(new)
    return tuple(float(torch.tensor(t).median()) * 1e3 for t in times)


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy for a moment so its clocks leave idle before the first row is timed (the
    first row of a cold run measured torch.matmul at idle clocks otherwise)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def median_interval(values, confidence: float = 0.95) -> tuple:
    """The order statistics of ``values`` between which their median lies with at least ``confidence``,
    the values taken as independent draws (distribution-free: the count below the median is binomial with
    p = 1/2); the smallest and largest value where too few values give that confidence."""
    v = sorted(values)
    n = len(v)
    alpha, j, below = (1 - confidence) / 2, -1, 0.0  # j: the largest count with P(X <= j) <= alpha
    while j + 1 < n // 2 and below + math.comb(n, j + 1) / 2 ** n <= alpha:
        j += 1
        below += math.comb(n, j) / 2 ** n
    return (v[j], v[n - 1 - j]) if j >= 0 else (v[0], v[-1])


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, device, iters: int) -> float:
    """Wall milliseconds per call of ``iters`` back-to-back calls of ``fn``, between device syncs."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


@contextlib.contextmanager
def gc_paused():
    """Python's garbage collector paused, as ``timeit`` pauses it, after one full collection; callers collect
    the objects made since (:func:`collect_young`) between rounds. (A full collection takes ~0.2 s once
    transformers is imported: once per round, it would take most of a benchmark's time.)"""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def collect_young() -> None:
    """Collect the garbage among the objects made since the last collection (with the collector paused, every
    new object stays in the young generations)."""
    gc.collect(1)
