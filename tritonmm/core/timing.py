"""GPU timing of contenders side by side: CUDA events, L2 flushed, a GPU spin hiding host time, contenders
interleaved call by call (:func:`_pair_times_ms`). First-sight tuning, ``python -m tritonmm.tune`` and
``python -m tritonmm.bench`` time with it."""

from __future__ import annotations

import time

import torch

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
