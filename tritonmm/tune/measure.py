"""Measuring shapes for a tuned table, and deciding its entries.

For each shape (bucketed M with M = 1 apart, exact N and K, operand layout) and dtype it times torch.matmul and
every candidate config of each applicable kernel (persistent TMA, pointer, split-K for small M)
and, where a leading dimension is unaligned, cuBLAS on zero-padded copies ("padded"),
through the full ``tritonmm.matmul`` call (copies and Python overhead included), checks each
result against a float64 reference, and records the winner: a Triton kernel and config, or
cuBLAS when it was faster. The fastest candidate is then timed against torch.matmul once more, in
alternation (``--pair-rounds`` turns each), and that head-to-head decides the backend (Triton only
when at least ``--min-gain`` times faster, default 1.01, and ``--min-gain-us`` µs, default 1): the sweep
runs for minutes and the GPU's clock drifts as it heats. The table (``configs/tuned/<gpu>-sm<cc>-<sms>sms-triton<v>.json``) is
used by the dispatcher on a GPU of the same compute capability, SM count and Triton version, so a
fresh process benchmarks nothing for tabled shapes. Shapes that share a key (e.g. M = 2 and 16; M = 1 has its own)
get the config with the best total normalized time over them. Times in µs (median of
``triton.testing.do_bench``). float32 is measured with TF32 allowed, as the benchmark measures it;
the dispatcher uses its entries only where TF32 is allowed (elsewhere float32 goes to cuBLAS).
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
import time

import torch

from .. import api
from ..core import shapes
from ..core.device import has_tma, limits
from ..core.layout import padded_shape
from ..core.reference import rounding_unit
from ..core.timing import _bench_pair
from ..dispatch import tables, tuned
from ..dispatch.decide import force_backend
from ..kernels import configs as cfg
from .suite import DTYPES

SPLITK_MAX_M = 256  # the largest M whose split-K configs are measured


def applicable(kernel: str, M: int, N: int, device) -> bool:
    if kernel == "tma":
        return has_tma(device)
    if kernel == "splitk":  # also past SMALL_M: at M = 128 a 4096-wide N is only 32-64 tiles for 132 SMs
        return M <= SPLITK_MAX_M
    return True


def padded_applicable(a, b) -> bool:
    """Whether the padded path (cuBLAS on zero-padded copies) differs from torch.matmul for a @ b."""
    return padded_shape(shapes.plan(a, b), a.dtype) is not None


def measure_shape(shape: dict, dtype, layout: str, args, gen) -> dict:
    """Times (µs) of torch.matmul and of every (kernel, config) on one shape; failing configs are marked."""
    from triton.testing import do_bench

    M, N, K = shape["M"], shape["N"], shape["K"]
    a = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
    b = (torch.randn(N, K, device="cuda", generator=gen).to(dtype).t() if layout == "nt"
         else torch.randn(K, N, device="cuda", generator=gen).to(dtype))
    ref = torch.matmul(a.double(), b.double())
    torch_out = torch.matmul(a, b)
    torch_err = (torch_out.double() - ref).abs().max().item()
    bound = 2 * torch_err + rounding_unit(dtype, a.device) * ref.abs().max().item()
    del torch_out
    res = {"tag": shape["tag"], "M": M, "N": N, "K": K, "dtype": str(dtype)[6:], "layout": layout,
           "torch_us": do_bench(lambda: torch.matmul(a, b), warmup=5, rep=args.rep, return_mode="median") * 1e3,
           "configs": []}
    smem, sms = limits(a.device.index or 0)

    def check_and_time(entry: dict) -> None:
        """Under the caller's forcing: the error against float64, then the time if within the bound."""
        err = (api.matmul(a, b).double() - ref).abs().max().item()
        entry["err"] = err
        if not err <= bound:
            entry["failed"] = f"error {err:.3e} > bound {bound:.3e}"
        else:
            entry["us"] = do_bench(lambda: api.matmul(a, b), warmup=5, rep=args.rep,
                                   return_mode="median") * 1e3

    for kernel in args.kernels:
        if kernel == "padded":
            if padded_applicable(a, b):
                entry = {"kernel": "padded", "config": None}
                with force_backend("torch", "padded"):
                    check_and_time(entry)
                res["configs"].append(entry)
            continue
        if not applicable(kernel, M, N, a.device):
            continue
        for config in cfg.candidates(kernel):
            if cfg.smem_bytes(config, a.element_size(), a.element_size(), kernel) > smem:
                continue
            if config["BLOCK_M"] > 2 * cfg.bucket(M) or config["BLOCK_N"] > 2 * cfg.bucket(N):
                continue
            if kernel == "tma" and not cfg.split_useful(M, N, K, config, sms):
                continue
            entry = {"kernel": kernel, "config": config}
            try:
                with force_backend("triton", kernel, config):
                    check_and_time(entry)
            except Exception as exc:  # a config that does not compile or run is recorded, not fatal
                entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            res["configs"].append(entry)
    timed = [c for c in res["configs"] if "us" in c]
    if timed and args.pair_rounds:
        # the decision against cuBLAS: the fastest candidate and torch.matmul again, in alternation, so
        # clock drift over the sweep (an H200 slows as it heats) does not favour whichever ran first
        best = min(timed, key=lambda c: c["us"])
        force = ("torch", "padded") if best["kernel"] == "padded" else ("triton", best["kernel"], best["config"])
        with force_backend(*force):
            t_torch, t_best = _bench_pair(lambda: torch.matmul(a, b), lambda: api.matmul(a, b),
                                          rep=args.rep * args.pair_rounds, rounds=args.pair_rounds)
        res["paired"] = {"kernel": best["kernel"], "config": best["config"], "torch_us": t_torch, "us": t_best}
    return res


def merge_measurements(old: list, new: list[dict]) -> list[dict]:
    """``old`` measurements except those of a (dtype, M, N, K, layout) that ``new`` measures again (and what is not a
    measurement), then ``new``: a table keeps one record per problem."""
    def ident(r):
        return r.get("dtype"), r.get("M"), r.get("N"), r.get("K"), r.get("layout", "nn")

    again = {ident(r) for r in new}
    return [r for r in old if isinstance(r, dict) and ident(r) not in again] + new


def _adding(measured: list[dict], args, name: str):
    """What :func:`tritonmm.dispatch.tables.merge_entries` calls on the table it writes: the tuner's fields set,
    ``measured`` merged in."""
    def update(table: dict) -> None:
        kept = table.get("measurements")
        table.update(device=name, torch=torch.__version__, rep_ms=args.rep, min_gain=args.min_gain,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     min_gain_us=args.min_gain_us,
                     measurements=merge_measurements(kept if isinstance(kept, list) else [], measured))
    return update


def decide_entries(measured: list[dict], min_gain: float, min_gain_us: float) -> dict:
    """Table entries from measurements: grouped by table key (:func:`tuned.entry_key`), one :func:`tuned.choose` each."""
    groups: dict[str, list] = {}
    for r in measured:
        key = tuned.entry_key(DTYPES[r["dtype"]], r["M"], r["N"], r["K"], r.get("layout", "nn"))
        groups.setdefault(key, []).append(r)
    return {key: tuned.choose(group, min_gain, min_gain_us) for key, group in groups.items()}


def _work(shapes: list[dict], args) -> list[tuple]:
    """(shape, dtype, layout) to measure: a shape row's own ``dtype`` and ``layout`` where it has them
    (rows saved by :func:`tritonmm.tune.capture.geometries`), else every ``--dtype`` and ``--layout``."""
    work = []
    for s in shapes:
        for d in ([s["dtype"]] if "dtype" in s else args.dtype):
            for lay in ([s["layout"]] if "layout" in s else args.layout):
                work.append((s, DTYPES[d], lay))
    return work


def _unmeasured(work: list[tuple], device) -> list[tuple]:
    return [(s, d, lay) for s, d, lay in work if not tuned.measured(device, d, s["M"], s["N"], s["K"], lay)]


def _measure(work: list[tuple], args) -> list[dict]:
    """Measure ``work`` (:func:`measure_shape` each, up to ``--time-limit``), printing a line per problem."""
    if any(d == torch.float32 for _, d, _ in work):  # as in the benchmark: float32 rows are TF32 rows (the
        torch.backends.cuda.matmul.allow_tf32 = True  # dispatcher sends float32 to cuBLAS whenever TF32 is off)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    measured = []
    for i, (shape, dtype, layout) in enumerate(work):
        if args.time_limit and time.time() - t0 > args.time_limit:
            print(f"time limit reached after {i} of {len(work)} shapes", file=sys.stderr)
            break
        r = measure_shape(shape, dtype, layout, args, gen)
        measured.append(r)
        ok = [c for c in r["configs"] if "us" in c]
        best = min(ok, key=lambda c: c["us"]) if ok else None
        failed = [c for c in r["configs"] if "failed" in c]
        print(f"[{time.time() - t0:6.0f}s] {r['dtype']:8} {layout} {r['tag']:16} {r['M']:>6} {r['N']:>6} {r['K']:>6} "
              f"torch {r['torch_us']:9.1f} us  best {best['kernel'] + ' ' if best else ''}"
              f"{best['us'] if best else float('nan'):9.1f} us  ratio "
              f"{r['torch_us'] / best['us'] if best else float('nan'):5.2f}  failed {len(failed)}", flush=True)
        torch.cuda.empty_cache()
    return measured


def _measure_and_write(work: list[tuple], args, path: pathlib.Path, merge: bool) -> dict:
    """Measure ``work``, decide the entries and write the table at ``path``, or with ``merge`` add them to it
    (:func:`tables.merge_entries`); OSError where it could not be written."""
    t0 = time.time()
    measured = _measure(work, args)
    entries = decide_entries(measured, args.min_gain, args.min_gain_us)
    device = torch.device("cuda", torch.cuda.current_device())
    sig = tuned.device_signature(device)
    name = torch.cuda.get_device_name(device)
    if merge:
        entries = tables.merge_entries(path, sig, name, entries, _adding(measured, args, name))
    else:
        with tables.locked(path):  # (first-sight tuning in other processes merges into the same table)
            table = {"format": tables.FORMAT, "device": name, **sig, "entries": entries}
            _adding(measured, args, name)(table)
            tables.atomic_write_text(path, json.dumps(table, indent=1))  # readers never see half a table
    wins = sum(e["backend"] == "triton" for e in entries.values())
    print(f"wrote {path}: {len(entries)} entries, Triton wins {wins}, cuBLAS {len(entries) - wins}; "
          f"{time.time() - t0:.0f} s")
    return {"table": path, "measured": len(measured), "entries": len(entries), "triton": wins}


