"""The benchmark's own timing: the machine's facts, a warm-up, first calls and wall time between syncs, the garbage
collector paused, an interval for a median of ratios. GPU time of contenders side by side is
:mod:`tritonmm.core.timing`'s."""

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
