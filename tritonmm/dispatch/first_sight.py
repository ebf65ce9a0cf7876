"""First-sight tuning: a GEMM that no tuned table of this GPU holds is measured at its first eager call.

Which GEMMs: 2-D float16 / bfloat16 problems on a CUDA GPU with K and N in whole 16-byte units (the
others keep the padded path or cuBLAS), large enough that a Triton kernel could save the dispatcher's
``TRITON_MIN_SAVING_US`` per call (:func:`worth_tuning`), with no entry in a table of this GPU and
Triton release, or only a prior measured with another Triton release (whose winner is checked again
this way; a prior naming the padded path holds). Smaller GEMMs go to cuBLAS without a measurement:
there a Triton kernel cannot save what its launch costs on the host. A call's backward GEMMs are
measured with its forward where that call needs gradients.

How: before the first call runs, on the caller's stream, on random operands of the problem's shape
and layout: cuBLAS (torch.matmul) is timed; where it takes at least :data:`MIN_TORCH_US`, the
kernel the dispatcher would launch is compiled and checked against cuBLAS's result in its pruned
candidate configs, in order, until :data:`COMPILE_BUDGET_S` has passed; then cuBLAS and every
candidate are timed call by call in alternation (GPU time, L2 flushed, as ``python -m
tritonmm.bench`` times), the fastest against cuBLAS once more for longer, and it wins only by the
margins :data:`MIN_GAIN` and :data:`MIN_GAIN_US`. The result is one entry of this machine's table (:func:`tuned.record`), which
this process uses at once and later processes read, so a geometry is measured once per machine.

When not: inside CUDA-graph capture, ``torch.compile`` tracing and torch function or dispatch modes
(the table or the heuristic serves, and the geometry is measured at its next plain eager call), with
``TRITONMM_FIRST_SIGHT=0``, a forced backend, ``TRITONMM_AUTOTUNE=0`` and under several ranks (timings differ between GPUs:
:func:`tritonmm.core.env.deterministic_configs`). A layer that settled (:mod:`tritonmm.modules.linear`) calls
F.linear directly and meets no first sight for row counts it sees later;
:func:`tritonmm.tune_model` measures a model's GEMMs ahead of time.
"""

from __future__ import annotations

import threading
import time
import warnings

import torch

from ..core import layout, modes, shapes
from ..core.device import num_sms, smem_limit
from ..core.env import autotune_enabled, deterministic_configs, switch
from ..core.reference import rounding_unit
from ..core.timing import _pair_times_ms
from ..kernels import configs as cfg
from . import decide, runners, tuned

MIN_FLOPS = 2**34
"""FLOP (2·M·N·K) from which a GEMM is measured at first sight (or :data:`MIN_BYTES`): about 25 µs of
cuBLAS on an H200, below which saving ``decide.TRITON_MIN_SAVING_US`` would take a kernel more than
twice as fast as cuBLAS."""
MIN_BYTES = 2**28
"""Bytes of operands and result from which a memory-bound GEMM is measured (256 MiB, about 56 µs at the
H200's 4.8 TB/s: decode rows of a large vocabulary head). Below, a kernel streaming the weight at full
bandwidth saves less than ``TRITON_MIN_SAVING_US`` on cuBLAS's 80-90% of it."""
MIN_TORCH_US = 2 * decide.TRITON_MIN_SAVING_US
"""cuBLAS time (µs) below which no Triton candidate is compiled: the entry records cuBLAS."""
COMPILE_BUDGET_S = 0.7
"""Seconds from the start of a measurement after which no further candidate is compiled (nor one whose
compile, at the longest so far, would end later); the timing that follows takes about 0.1-0.2 s."""
CANDIDATE_US = 20_000
"""At most this many µs of cuBLAS time per candidate (8 candidates up to 2.5 ms GEMMs, 2 from 10 ms): the
sweep and the head-to-head run each contender a few times at least."""
SWEEP_MS, PAIR_MS = 8, 30
"""ms of GPU samples per contender: in the sweep over cuBLAS and every candidate, then in the
head-to-head of the fastest candidate and cuBLAS that decides."""
MIN_GAIN, MIN_GAIN_US = tuned.FIRST_SIGHT_MIN_GAIN, 1.0
"""A candidate wins where cuBLAS time / its time is at least MIN_GAIN and it saves MIN_GAIN_US; the
dispatcher then also asks for ``TRITON_MIN_SAVING_US``. Wider than the offline tuner's 1.01: winners by
a smaller margin made a model's training step slower than cuBLAS alone
(``benchmarks/diagnostics/h200_first_sight_in_model.json``). Entries written with a smaller margin are
held to this one when read (:func:`tuned.saves`)."""
_DTYPES = (torch.float16, torch.bfloat16)

_lock = threading.Lock()
_tried: set = set()  # (GPU index, table key) measured or failed in this process
stats = {"measured": 0, "seconds": 0.0}
"""Geometries measured in this process and the seconds they took (benchmarks and tests read it)."""


def enabled() -> bool:
    """Whether first-sight tuning is on: ``TRITONMM_FIRST_SIGHT`` (default 1), ``TRITONMM_AUTOTUNE``
    not 0, a single rank.

    Raises:
        ValueError: ``TRITONMM_FIRST_SIGHT`` or ``TRITONMM_AUTOTUNE`` holds something other than 0 or 1.
    """
    return switch("TRITONMM_FIRST_SIGHT") and autotune_enabled() and not deterministic_configs()


def worth_tuning(M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    """Whether an M x N x K GEMM of ``dtype`` is large enough to measure (:data:`MIN_FLOPS`, :data:`MIN_BYTES`)
    and has a K and N of whole 16-byte units (elsewhere the dispatcher's padded path or cuBLAS serves it, as
    without first sight)."""
    size = dtype.itemsize if dtype in _DTYPES else 0
    return (size > 0 and layout.aligned(K, size) and layout.aligned(N, size)
            and (2 * M * N * K >= MIN_FLOPS or (M * K + K * N + M * N) * size >= MIN_BYTES))


def _flip(c: str) -> str:
    return "n" if c == "t" else "t"


def problems(M: int, N: int, K: int, tag: str, grads: bool) -> list[tuple]:
    """(M, N, K, layout) of ``C = A @ B`` (A: M x K, B: K x N, layouts ``tag``) and, with ``grads``, of
    its backward GEMMs as :mod:`tritonmm.ops.grads` runs them: dA = dC @ B^T, dB = A^T @ dC (dC contiguous)."""
    out = [(M, N, K, tag)]
    if grads:
        out += [(M, K, N, "n" + _flip(tag[1])), (K, N, M, _flip(tag[0]) + "n")]
    return out


def linear_problems(M: int, N: int, K: int, tag: str, grads: bool) -> list[tuple]:
    """As :func:`problems` for ``F.linear`` (B = weight^T): its weight gradient is dC^T @ x, (N, K, M)."""
    out = [(M, N, K, tag)]
    if grads:
        out += [(M, K, N, "n" + _flip(tag[1])), (N, K, M, "t" + tag[0])]
    return out


def _unmeasured(device: torch.device, dtype: torch.dtype, todo: list[tuple]) -> list[tuple]:
    if device.type != "cuda" or dtype not in _DTYPES or not todo:
        return []
    todo = [p for p in todo if worth_tuning(p[0], p[1], p[2], dtype)]
    if not todo or not enabled():
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [p for p in dict.fromkeys(todo) if (index, tuned.entry_key(dtype, *p)) not in _tried
            and not tuned.covered(torch.device("cuda", index), dtype, *p)]


def _not_now() -> bool:
    """Compile tracing, CUDA-graph capture on this thread's stream, or a torch function or dispatch mode
    (a FLOP counter, a tracer) that would see the measurement's calls."""
    return not modes.eager() or torch.cuda.is_current_stream_capturing()


def pending(device: torch.device, dtype: torch.dtype, todo: list[tuple]) -> list[tuple]:
    """The problems of ``todo`` that would be measured now: first-sight tuning on, a CUDA device, plain
    eager mode and no capture, large and aligned enough, no entry of this GPU and Triton release (nor
    of its sibling 16-bit dtype) and no prior naming the padded path, not tried in this process.
    Cheap: no GPU work."""
    todo = _unmeasured(device, dtype, todo)
    return [] if not todo or _not_now() else todo


def deferred(device: torch.device, dtype: torch.dtype, todo: list[tuple]) -> bool:
    """Whether a problem of ``todo`` would be measured but cannot be now (CUDA-graph capture, compile
    tracing): the caller then keeps no decision for it, so its next eager call measures it."""
    return bool(_unmeasured(device, dtype, todo)) and _not_now()


def tune(device: torch.device, dtype: torch.dtype, todo: list[tuple]) -> tuple[int, bool]:
    """Measure each problem (M, N, K, layout) of ``todo`` and record its entry. Returns how many were
    measured, and whether one of them chose a Triton kernel or the padded path (then decisions already
    made for that weight may no longer hold).

    A problem whose measurement fails is left to cuBLAS, with one RuntimeWarning."""
    changed, count = False, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        for M, N, K, tag in pending(device, dtype, todo):  # again under the lock: another thread may have measured it
            entry = measure_and_record(index, tuned.entry_key(dtype, M, N, K, tag),
                                       lambda: measure(torch.device("cuda", index), dtype, M, N, K, tag))
            if entry is not None:
                count += 1
                changed |= entry["backend"] == "triton" or entry.get("kernel") == "padded"
    return count, changed


def measure_and_record(index: int, key: str, measure_fn) -> dict | None:
    """Run ``measure_fn()`` (a table entry for ``key``, measured on GPU ``index``) once in this process, add its
    seconds to :data:`stats` and record it (:func:`tuned.record`). Returns the entry, or None where the
    measurement failed (one RuntimeWarning: the caller serves the geometry as without it). Hold :data:`_lock`."""
    _tried.add((index, key))
    t0 = _clock()
    try:
        with torch.cuda.device(index):  # timing events and launches on the problem's GPU
            entry = measure_fn()
    except Exception as exc:  # noqa: BLE001 - out of memory, a driver error: never the caller's failure
        warnings.warn(f"tritonmm: first-sight tuning of {key} failed ({type(exc).__name__}: "
                      f"{str(exc)[:200]}); served as without it", RuntimeWarning, stacklevel=3)
        return None
    entry["first_sight_s"] = round(_clock() - t0, 3)
    stats["measured"] += 1
    stats["seconds"] += entry["first_sight_s"]
    try:
        tuned.record(torch.device("cuda", index), {key: entry})
    except OSError as exc:  # a read-only home, a full disk: the entry holds in this process
        warnings.warn(f"tritonmm: could not write this machine's tuned table ({exc}); the first-sight "
                      f"entry {key} holds in this process only", RuntimeWarning, stacklevel=3)
    return entry


def tried(index: int, key: str) -> bool:
    """Whether ``key`` was measured (or its measurement failed) on GPU ``index`` in this process."""
    return (index, key) in _tried


_clock = time.perf_counter


def _times(fns, rep_ms: float) -> list[float]:
    """Median GPU µs of each of ``fns``, timed call by call in alternation (:mod:`tritonmm.core.timing`)."""
    return [float(torch.tensor(t).median()) * 1e3 for t in _pair_times_ms(tuple(fns), rep_ms)]


def _operand(rows: int, cols: int, tag: str, dtype, device, gen) -> torch.Tensor:
    t = torch.randn((rows, cols) if tag == "n" else (cols, rows), device=device, dtype=dtype, generator=gen)
    return t if tag == "n" else t.t()


def candidates(plan, dtype: torch.dtype, device: torch.device, keep: int = 8) -> list[tuple[str, dict]]:
    """(kernel, config) to try: the kernel the dispatcher would launch, its candidates pruned and
    ranked as autotuning prunes them (:func:`kernels.configs.prune`), at most ``keep``."""
    kernel, _, _ = decide.kernel_choice(plan, device, "auto")
    size = dtype.itemsize
    pool = cfg.prune(cfg.candidates(kernel), M=plan.M, N=plan.N, K=plan.K, itemsize=size, out_itemsize=size,
                     kernel=kernel, smem_limit=smem_limit(device), num_sms=num_sms(device), keep=keep)
    return [(kernel, c) for c in pool]


def measure(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, tag: str) -> dict:
    """One table entry for the problem, measured now (module docstring); see :func:`tuned.choose`."""
    t0 = _clock()
    gen = torch.Generator(device=device).manual_seed(0)  # the caller's random state stays untouched
    a, b = _operand(M, K, tag[0], dtype, device, gen), _operand(K, N, tag[1], dtype, device, gen)

    def cublas():
        return torch.matmul(a, b)

    (torch_us,) = _times([cublas], SWEEP_MS / 2)
    res = {"tag": "first-sight", "M": M, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch."),
           "layout": tag, "torch_us": torch_us, "configs": []}
    if torch_us >= MIN_TORCH_US:
        plan = shapes.plan(a, b)

        def contender(kernel, config):
            decision = decide.Decision("triton", kernel, "first-sight candidate", config=config,
                                         copies=layout.tma_copies(plan) if kernel == "tma" else ())

            def build():
                run = runners.build(plan, decision, dtype, device)
                return lambda: run(a, b, None)
            return {"kernel": kernel, "config": config}, build

        # long GEMMs: fewer candidates, so the timing of all of them stays within about a second
        keep = max(2, min(8, int(CANDIDATE_US / torch_us)))
        race(res, cublas, [contender(k, c) for k, c in candidates(plan, dtype, device, keep=keep)], t0)
    entry = tuned.choose([res], MIN_GAIN, MIN_GAIN_US)
    if torch_us < MIN_TORCH_US:
        entry["note"] = (f"cuBLAS took {torch_us:.1f} µs, too short for a Triton kernel to save "
                         f"{decide.TRITON_MIN_SAVING_US:g} µs")
    return entry


def race(res: dict, baseline, contenders, t0: float, ulps: float = 4, budget: float = COMPILE_BUDGET_S) -> None:
    """Time ``baseline`` (a callable, the torch call) against ``contenders`` into ``res`` (its ``configs``):
    ``(entry, build)`` pairs in order, ``build()`` compiling one and returning its call. Each is built and
    checked against the baseline's result (``ulps`` rounding units of its largest value) until ``budget``
    seconds (:data:`COMPILE_BUDGET_S`) after ``t0`` (nor one whose compile, at the longest so far, would end later);
    then the baseline and every checked contender are timed in alternation (``us`` of each entry) and the
    fastest against the baseline once more for longer (``res["paired"]``). A contender that fails to build
    or run, or differs, is recorded as ``failed``."""
    ref = baseline()
    bound = ulps * rounding_unit(ref.dtype, ref.device) * ref.abs().max().item()
    runs, longest = [], 0.0
    for entry, build in contenders:
        start = _clock()
        if res["configs"] and start - t0 + longest > budget:  # the next compile would overrun it
            break
        try:
            fn = build()
            err = (fn() - ref).abs_().max().item()  # in the output dtype: one temporary
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or run is recorded, not fatal
            entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            if not err <= bound:
                entry["failed"] = f"differs from the torch call by {err:.3e} > {bound:.3e}"
            else:
                runs.append((entry, fn))
        res["configs"].append(entry)
        longest = max(longest, _clock() - start)
    if runs:  # a sweep over every candidate, then the fastest against the baseline for longer
        sweep = _times([baseline] + [fn for _, fn in runs], SWEEP_MS)
        for (entry, _), us in zip(runs, sweep[1:]):
            entry["us"] = us
        best, fn = min(runs, key=lambda r: r[0]["us"])
        t_torch, t_best = _times([baseline, fn], PAIR_MS)
        res["paired"] = {"kernel": best["kernel"], "config": best["config"], "torch_us": t_torch, "us": t_best}


def forget() -> None:
    """Forget which geometries this process measured (they are measured again if no table holds them)."""
    with _lock:
        _tried.clear()
