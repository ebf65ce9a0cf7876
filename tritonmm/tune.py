"""Measure every candidate config (and cuBLAS) per shape and write this GPU's tuned table.

    python -m tritonmm.tune --dtype bfloat16 --out configs/tuned/   # the public suite
    python -m tritonmm.tune --tags llama8b --layout nt               # nn.Linear weights
    python -m tritonmm.tune --redecide --min-gain 1.02 --out configs/tuned/TABLE.json   # no GPU
    python -m tritonmm.tune --shapes my_model.json --user    # geometries saved from tritonmm.capture

:func:`tune_model` records the GEMMs of one forward and backward pass of a model
(:mod:`tritonmm.capture`) and measures those no table of this GPU and Triton release holds yet, into
this machine's table (:func:`tuned.user_dir`).

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

import argparse
import datetime
import json
import os
import pathlib
import sys
import time
import warnings

import torch

from .bench import DTYPES, default_suite, load_suite
from .dispatch import TRITON_MIN_SAVING_US


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tritonmm.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=pathlib.Path, default=None,
                   help="shape suite JSON (the format of configs/shapes.json; default: the public suite)")
    p.add_argument("--tags", nargs="+", default=None,
                   help="only shapes whose tag starts with one of these (e.g. llama8b odd)")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["bfloat16"])
    p.add_argument("--layout", nargs="+", choices=["nn", "nt"], default=["nn"])
    p.add_argument("--kernels", nargs="+", choices=["tma", "pointer", "splitk", "padded"],
                   default=["tma", "pointer", "splitk", "padded"],
                   help="what to measure besides torch.matmul; 'padded' is cuBLAS on zero-padded aligned copies, "
                        "measured where a leading dimension is unaligned")
    p.add_argument("--rep", type=int, default=25, help="do_bench rep time per config in ms")
    p.add_argument("--pair-rounds", type=int, default=6,
                   help="turns of the final alternating timing of the fastest candidate against torch.matmul, "
                        "which decides the backend (0: decide on the sweep's own times; default %(default)s)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output file, or a directory for the default name (default: configs/tuned/)")
    p.add_argument("--merge", action="store_true", help="keep entries of an existing table that this run does not measure")
    p.add_argument("--user", action="store_true",
                   help="write into this machine's table (TRITONMM_TUNED_DIR, default ~/.cache/tritonmm/tuned), "
                        "merging, and measure only problems no table of this GPU and Triton release holds")
    p.add_argument("--time-limit", type=float, default=None, help="stop measuring new shapes after this many seconds")
    p.add_argument("--min-gain", type=float, default=1.01,
                   help="a Triton kernel (or the padded path) wins a key only when torch.matmul time / its time is at "
                        "least this on every shape of the key (default %(default)s: a gain inside the timing's "
                        "noise is not worth a different code path)")
    p.add_argument("--min-gain-us", type=float, default=1.0,
                   help="and only when it saves at least this many µs per call on every shape of the key (default "
                        "%(default)s: identical cuBLAS calls read up to about 0.6 µs apart between processes on the "
                        "H200, so smaller savings on short GEMMs are not reproducible); the dispatcher uses a Triton winner "
                        f"only where it also saves {TRITON_MIN_SAVING_US:g} µs (dispatch.TRITON_MIN_SAVING_US), "
                        "more than its route costs the host")
    p.add_argument("--redecide", action="store_true",
                   help="measure nothing: re-decide the entries of the table at --out from the measurements stored "
                        "in it (e.g. with another --min-gain); needs no GPU")
    return p.parse_args(argv)


SPLITK_MAX_M = 256  # the largest M whose split-K configs are measured


def applicable(kernel: str, M: int, N: int, device) -> bool:
    from .device import has_tma

    if kernel == "tma":
        return has_tma(device)
    if kernel == "splitk":  # also past SMALL_M: at M = 128 a 4096-wide N is only 32-64 tiles for 132 SMs
        return M <= SPLITK_MAX_M
    return True


def padded_applicable(a, b) -> bool:
    """Whether the padded path (cuBLAS on zero-padded copies) differs from torch.matmul for a @ b."""
    from . import padded, shapes

    return padded.padded_shape(shapes.plan(a, b), a.dtype) is not None


def measure_shape(shape: dict, dtype, layout: str, args, gen) -> dict:
    """Times (µs) of torch.matmul and of every (kernel, config) on one shape; failing configs are marked."""
    import tritonmm
    from triton.testing import do_bench

    from .kernels import configs as cfg

    M, N, K = shape["M"], shape["N"], shape["K"]
    a = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
    b = (torch.randn(N, K, device="cuda", generator=gen).to(dtype).t() if layout == "nt"
         else torch.randn(K, N, device="cuda", generator=gen).to(dtype))
    ref = torch.matmul(a.double(), b.double())
    torch_out = torch.matmul(a, b)
    torch_err = (torch_out.double() - ref).abs().max().item()
    from .testing import rounding_unit

    bound = 2 * torch_err + rounding_unit(dtype, a.device) * ref.abs().max().item()
    del torch_out
    res = {"tag": shape["tag"], "M": M, "N": N, "K": K, "dtype": str(dtype)[6:], "layout": layout,
           "torch_us": do_bench(lambda: torch.matmul(a, b), warmup=5, rep=args.rep, return_mode="median") * 1e3,
           "configs": []}
    from .device import limits

    smem, sms = limits(a.device.index or 0)

    def check_and_time(entry: dict) -> None:
        """Under the caller's forcing: the error against float64, then the time if within the bound."""
        err = (tritonmm.matmul(a, b).double() - ref).abs().max().item()
        entry["err"] = err
        if not err <= bound:
            entry["failed"] = f"error {err:.3e} > bound {bound:.3e}"
        else:
            entry["us"] = do_bench(lambda: tritonmm.matmul(a, b), warmup=5, rep=args.rep,
                                   return_mode="median") * 1e3

    for kernel in args.kernels:
        if kernel == "padded":
            if padded_applicable(a, b):
                entry = {"kernel": "padded", "config": None}
                with tritonmm.force_backend("torch", "padded"):
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
                with tritonmm.force_backend("triton", kernel, config):
                    check_and_time(entry)
            except Exception as exc:  # a config that does not compile or run is recorded, not fatal
                entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            res["configs"].append(entry)
    timed = [c for c in res["configs"] if "us" in c]
    if timed and args.pair_rounds:
        # the decision against cuBLAS: the fastest candidate and torch.matmul again, in alternation, so
        # clock drift over the sweep (an H200 slows as it heats) does not favour whichever ran first
        from .bench import _bench_pair

        best = min(timed, key=lambda c: c["us"])
        force = ("torch", "padded") if best["kernel"] == "padded" else ("triton", best["kernel"], best["config"])
        with tritonmm.force_backend(*force):
            t_torch, t_best = _bench_pair(lambda: torch.matmul(a, b), lambda: tritonmm.matmul(a, b),
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
    """What :func:`tuned.merge_entries` calls on the table it writes: the tuner's fields set, ``measured`` merged in."""
    def update(table: dict) -> None:
        kept = table.get("measurements")
        table.update(device=name, torch=torch.__version__, rep_ms=args.rep, min_gain=args.min_gain,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     min_gain_us=args.min_gain_us,
                     measurements=merge_measurements(kept if isinstance(kept, list) else [], measured))
    return update


def decide_entries(measured: list[dict], min_gain: float, min_gain_us: float) -> dict:
    """Table entries from measurements: grouped by table key (:func:`tuned.entry_key`), one :func:`tuned.choose` each."""
    from . import tuned

    groups: dict[str, list] = {}
    for r in measured:
        key = tuned.entry_key(DTYPES[r["dtype"]], r["M"], r["N"], r["K"], r.get("layout", "nn"))
        groups.setdefault(key, []).append(r)
    return {key: tuned.choose(group, min_gain, min_gain_us) for key, group in groups.items()}


def redecide(path: pathlib.Path, min_gain: float, min_gain_us: float) -> int:
    """Rewrite the entries of the table at ``path`` from its stored measurements (no GPU needed)."""
    from . import tuned

    def unreadable() -> int:
        print(f"{path}: no readable table with stored measurements", file=sys.stderr)
        return 2

    if not path.is_file():  # (before the lock, which would make its directory)
        return unreadable()
    with tuned.locked(path):  # (first-sight tuning in other processes merges into the same table)
        table = tuned.read_table(path)
        if not table or not isinstance(table.get("measurements"), list) or not table["measurements"]:
            return unreadable()
        try:  # measurements as measure_shape writes them, deciding entries the table's reader takes
            entries = decide_entries(table["measurements"], min_gain, min_gain_us)
            for key, entry in entries.items():
                tuned._check_entry(key, entry)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            print(f"{path}: its measurements do not make a valid table ({type(exc).__name__}: {exc}); "
                  "nothing written", file=sys.stderr)
            return 2
        changed = sorted(k for k in entries if table["entries"].get(k, {}).get("backend") != entries[k]["backend"]
                         or table["entries"].get(k, {}).get("kernel") != entries[k]["kernel"])
        table["entries"] = {**table["entries"], **entries}
        table["min_gain"], table["min_gain_us"] = min_gain, min_gain_us
        tuned.atomic_write_text(path, json.dumps(table, indent=1))
    print(f"re-decided {len(entries)} entries of {path} with --min-gain {min_gain} --min-gain-us {min_gain_us}; "
          f"changed: {', '.join(changed) or 'none'}")
    return 0


def _work(shapes: list[dict], args) -> list[tuple]:
    """(shape, dtype, layout) to measure: a shape row's own ``dtype`` and ``layout`` where it has them
    (rows saved by :func:`tritonmm.capture.geometries`), else every ``--dtype`` and ``--layout``."""
    work = []
    for s in shapes:
        for d in ([s["dtype"]] if "dtype" in s else args.dtype):
            for lay in ([s["layout"]] if "layout" in s else args.layout):
                work.append((s, DTYPES[d], lay))
    return work


def _unmeasured(work: list[tuple], device) -> list[tuple]:
    from . import tuned

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
    (:func:`tuned.merge_entries`); OSError where it could not be written."""
    from . import tuned

    t0 = time.time()
    measured = _measure(work, args)
    entries = decide_entries(measured, args.min_gain, args.min_gain_us)
    device = torch.device("cuda", torch.cuda.current_device())
    sig = tuned.device_signature(device)
    name = torch.cuda.get_device_name(device)
    if merge:
        entries = tuned.merge_entries(path, sig, name, entries, _adding(measured, args, name))
    else:
        with tuned.locked(path):  # (first-sight tuning in other processes merges into the same table)
            table = {"format": tuned.FORMAT, "device": name, **sig, "entries": entries}
            _adding(measured, args, name)(table)
            tuned.atomic_write_text(path, json.dumps(table, indent=1))  # readers never see half a table
    wins = sum(e["backend"] == "triton" for e in entries.values())
    print(f"wrote {path}: {len(entries)} entries, Triton wins {wins}, cuBLAS {len(entries) - wins}; "
          f"{time.time() - t0:.0f} s")
    return {"table": path, "measured": len(measured), "entries": len(entries), "triton": wins}


def _writable(path: pathlib.Path) -> str | None:
    """Why the table at ``path`` cannot be written (its directory cannot be made or written to), or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return str(exc)
    return None if os.access(path.parent, os.W_OK) else f"{path.parent} is not writable"


def _table_path(out: pathlib.Path) -> pathlib.Path:
    from . import tuned

    device = torch.device("cuda", torch.cuda.current_device())
    name = tuned.table_name(tuned.device_signature(device), torch.cuda.get_device_name(device))
    return out if out.suffix == ".json" else out / name


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.redecide:
        if args.out is None or args.out.suffix != ".json":
            print("--redecide needs --out TABLE.json", file=sys.stderr)
            return 2
        return redecide(args.out, args.min_gain, args.min_gain_us)
    if not torch.cuda.is_available():
        print("python -m tritonmm.tune measures kernels on a CUDA GPU; none is available here.", file=sys.stderr)
        return 2
    from . import tuned

    try:
        shapes, _ = load_suite(args.shapes or default_suite(), args.tags)
    except ValueError as exc:
        print(f"python -m tritonmm.tune: error: {exc}", file=sys.stderr)
        return 2
    work = _work(shapes, args)
    if args.user:
        work = _unmeasured(work, torch.device("cuda", torch.cuda.current_device()))
        print(f"{len(work)} problems not yet in a table of this GPU and Triton release", file=sys.stderr)
    path = _table_path(args.out or (tuned.user_dir() if args.user else tuned.tuned_dir()))
    why_not = _writable(path)
    if why_not:  # (before measuring for minutes)
        print(f"python -m tritonmm.tune: error: cannot write {path}: {why_not}", file=sys.stderr)
        return 2
    try:
        _measure_and_write(work, args, path, merge=args.merge or args.user)
    except OSError as exc:
        print(f"python -m tritonmm.tune: error: could not write {path}: {exc}", file=sys.stderr)
        return 1
    return 0


def tune_model(model, *example_args, **example_kwargs) -> dict:
    """Tune every GEMM ``model(*example_args, **example_kwargs)`` runs, forward and backward, ahead of time.

    Records the geometries of one pass (:func:`tritonmm.capture.geometries`: in the model's current mode, its
    buffers and torch's random state restored, no ``.grad`` written), measures those that no table of this GPU and
    Triton release holds (every candidate config of each kernel against cuBLAS, as ``python -m tritonmm.tune``;
    seconds per geometry; fused MLPs' gated linears the gated kernel may serve as first-sight tuning measures them,
    :mod:`tritonmm.gated_tuning`) and merges the winners into this machine's table (:func:`tritonmm.tuned.record`),
    which later processes read; where it cannot be written, a RuntimeWarning says so and they hold in this process.
    Then forgets the decisions made before, so they take effect. A second call measures nothing.

    Returns:
        dict: ``geometries`` (recorded GEMMs), ``measured`` (new ones, ``gated`` of them gated linears),
        ``table`` (its path, or None when nothing was measured or it could not be written), ``entries`` and
        ``triton`` (entries of that table, and how many choose Triton).

    Raises:
        RuntimeError: no CUDA GPU (there is nothing to measure).
    """
    from . import api, capture, gated, gated_tuning, tuned

    if not torch.cuda.is_available():
        raise RuntimeError("tritonmm.tune_model measures kernels on a CUDA GPU; none is available")
    suite = capture.geometries(model, *example_args, **example_kwargs)
    args = parse_args([])
    device = torch.device("cuda", torch.cuda.current_device())
    work = _unmeasured(_work(suite["shapes"], args), device)
    result = {"geometries": len(suite["shapes"]), "measured": 0, "table": None, "entries": 0, "triton": 0, "gated": 0}
    if work:
        measured = _measure(work, args)
        result["measured"] = len(measured)
        entries = decide_entries(measured, args.min_gain, args.min_gain_us)
        try:
            tuned.record(device, entries, _adding(measured, args, torch.cuda.get_device_name(device)))
        except OSError as exc:  # as first-sight tuning: the entries hold in this process
            warnings.warn(f"tritonmm.tune_model: could not write this machine's tuned table ({exc}); the "
                          f"{len(entries)} entries measured hold in this process only", RuntimeWarning, stacklevel=2)
    for g in suite["gated"]:  # fused MLPs' gated linears the gated kernel may serve: measured as at first sight
        M, N, K = g["M"], g["N"], g["K"]
        if gated.kernel_rows(M, N, K, False) and gated_tuning.tune(device, DTYPES[g["dtype"]], M, N, K,
                                                                   g["activation"], g["bias"]) is not None:
            result["gated"] += 1
    result["measured"] += result["gated"]
    if result["measured"]:
        path = _table_path(tuned.user_dir())
        table = tuned.read_table(path) if path.is_file() else None
        if table is not None:
            result.update(table=path, entries=len(table["entries"]),
                          triton=sum(e["backend"] == "triton" for e in table["entries"].values()))
        api.forget_decisions()
    return result


if __name__ == "__main__":
    sys.exit(main())
