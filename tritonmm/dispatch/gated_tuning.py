"""Which kernel serves a gated linear the gated GEMM kernel may serve (:func:`tritonmm.dispatch.gated.kernel_rows`) on a
GPU: this GPU's tuned table, else a measurement at first sight.

An entry's key is ``dtype:M:N:K:gated_<activation>`` (M as :func:`tuned.m_key` buckets it) in the per-GPU
tables of :mod:`tritonmm.dispatch.tuned`. Backend "triton" names the gated GEMM kernel and its config; backend "torch"
the torch expression (two F.linear, the activation and the product: eager's kernels).

First sight: at the first plain eager call of a geometry that no table of this GPU and Triton release
holds (a table of another Triton release is a prior, checked again), in float16 or bfloat16 on a CUDA GPU
with first-sight tuning on (:func:`first_sight.enabled`), on random operands of the call's shape: the torch
expression is timed; the gated kernel's configs (the plain GEMM's candidates with ``BLOCK_N`` halved, pruned
as the plain GEMM on M x 2N x K: :mod:`tritonmm.kernels.gated_launchers`; the smallest ``BLOCK_M`` first)
are compiled and checked against its result in order until :data:`COMPILE_BUDGET_S`; all are timed call by
call in alternation (GPU time, L2 flushed) and the fastest against the torch expression once more
(:func:`first_sight.race`). The kernel is kept where it is faster by :data:`MIN_GAIN` (it also saves three
launches of host time). The entry is recorded in this machine's table, which later processes read.

Inside CUDA-graph capture, compile tracing and torch function or dispatch modes nothing is measured: an entry
serves if there is one, else the heuristic config (capture) or Triton's autotuning, and the geometry is
measured at its next eager call. With first-sight tuning off, entries still serve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import activations
from ..core.device import num_sms, smem_limit
from . import first_sight, tuned

MIN_GAIN = 1.0
"""Torch expression time / kernel time from which a first-sight measurement keeps the gated kernel."""
COMPILE_BUDGET_S = 1.4
"""Seconds after which no further config is compiled (``first_sight.race``): twice the plain GEMM's, since a
config's first compile takes longer (``benchmarks/diagnostics/h200_gated_decode.json``); configs
already in Triton's on-disk cache load in milliseconds, so later geometries compile the whole pool."""
_DTYPES = (torch.float16, torch.bfloat16)


def layout_tag(activation: str) -> str:
    return f"gated_{activation}"


def entry(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, activation: str) -> dict | None:
    """This GPU's entry for the geometry (its own M key: float16 and bfloat16 stand in for each other), or None."""
    entries = tuned._entries(device)
    if not entries:
        return None
    m = str(tuned.m_key(M))
    for key in tuned.lookup_keys(dtype, M, N, K, layout_tag(activation)):
        e = entries.get(key) if key.split(":")[1] == m else None
        if e is not None:
            return e
    return None


def choose(kernel: str, x2: torch.Tensor, w_gate: torch.Tensor, bias: bool, activation: str):
    """(decision, keep) for a gated launcher of ``kernel`` about to be built for x2 (M, K) and (N, K)
    weights: decision "torch" (the torch expression), a config of ``kernel``, or None (no entry: Triton
    autotunes, the heuristic serves in capture); ``keep``: False where a measurement is due but cannot
    run now (capture, tracing, a mode), so the caller keeps no decision and the next eager call measures."""
    device, dtype = x2.device, x2.dtype
    if device.type != "cuda":
        return None, True
    (M, K), N = x2.shape, w_gate.shape[0]
    e = entry(device, dtype, M, N, K, activation)
    if (e is None or "prior" in e) and dtype in _DTYPES and first_sight.enabled():
        if first_sight._not_now():
            index = device.index if device.index is not None else torch.cuda.current_device()
            return _decision(e, kernel), first_sight.tried(index, tuned.entry_key(dtype, M, N, K, layout_tag(activation)))
        tune(device, dtype, M, N, K, activation, bias)  # (waits for another thread's measurement of it)
        e = entry(device, dtype, M, N, K, activation) or e
    return _decision(e, kernel), True


def tune(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, activation: str,
         bias: bool = False) -> dict | None:
    """Measure the geometry and record its entry (:func:`first_sight.measure_and_record`) unless this GPU's
    table holds it (not as a prior) or this process measured it; float16 and bfloat16 only. Returns the new
    entry, or None (nothing measured, or the measurement failed: one RuntimeWarning)."""
    e = entry(device, dtype, M, N, K, activation)
    if dtype not in _DTYPES or e is not None and "prior" not in e:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = tuned.entry_key(dtype, M, N, K, layout_tag(activation))
    with first_sight._lock:
        if first_sight.tried(index, key):  # (another thread may have measured it meanwhile)
            return None
        return first_sight.measure_and_record(index, key, lambda: measure(
            torch.device("cuda", index), dtype, M, N, K, activation, bias))


def _decision(e: dict | None, kernel: str):
    if e is None:
        return None
    if e["backend"] == "torch":
        faster = e.get("triton_us") is not None and e["triton_us"] < e["torch_us"]
        return None if "prior" in e and faster else "torch"  # (another release's narrow kernel win: autotune)
    return dict(e["config"]) if e.get("kernel") == kernel else None


def measure(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, activation: str,
            bias: bool = False, keep: int = 8) -> dict:
    """One table entry for the geometry, measured now (module docstring); :func:`tuned.choose` decides."""
    from ..kernels import gated_launchers as gl  # (imports Triton: on use)

    t0 = first_sight._clock()
    gen = torch.Generator(device=device).manual_seed(0)  # the caller's random state stays untouched
    x = torch.randn(M, K, device=device, dtype=dtype, generator=gen)
    wg, wu = (torch.randn(N, K, device=device, dtype=dtype, generator=gen) / K**0.5 for _ in range(2))
    bg, bu = (torch.randn(N, device=device, dtype=dtype, generator=gen) for _ in range(2)) if bias else (None, None)

    def eager():
        return activations.apply(F.linear(x, wg, bg), activation) * F.linear(x, wu, bu)

    (torch_us,) = first_sight._times([eager], first_sight.SWEEP_MS / 2)
    res = {"tag": "first-sight", "M": M, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch."),
           "layout": layout_tag(activation), "torch_us": torch_us, "configs": []}
    pool = gl.prune("pointer", list(gl._candidates("pointer")), M, N, K, dtype.itemsize, smem_limit(device),
                    num_sms(device), keep=keep)
    pool.sort(key=lambda c: c["BLOCK_M"])  # rows past M are padding: the least first (the list's order otherwise)

    def contender(config):
        def build():
            launch = gl.gated_launcher("pointer", M, N, K, K, K, K, dtype, device, None if bg is None else (1, 1),
                                       False, activation, config)

            def run():
                h = torch.empty(M, N, device=device, dtype=dtype)
                launch(x, wg, wu, bg, bu, h, None, None)
                return h
            return run
        return {"kernel": "pointer", "config": config}, build

    # the fused result rounds once where eager rounds gate, activation and product: a few units more
    first_sight.race(res, eager, [contender(c) for c in pool], t0, ulps=8, budget=COMPILE_BUDGET_S)
    return tuned.choose([res], MIN_GAIN)
