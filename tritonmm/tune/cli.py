"""Measure every candidate config (and cuBLAS) per shape and write this GPU's tuned table.

    python -m tritonmm.tune --dtype bfloat16 --out configs/tuned/   # the public suite
    python -m tritonmm.tune --tags llama8b --layout nt               # nn.Linear weights
    python -m tritonmm.tune --redecide --min-gain 1.02 --out configs/tuned/TABLE.json   # no GPU
    python -m tritonmm.tune --shapes my_model.json --user    # geometries saved from tritonmm.tune.capture

How each shape is measured and decided: :mod:`tritonmm.tune.measure`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

from ..dispatch import tables, tuned
from ..dispatch.decide import TRITON_MIN_SAVING_US
from .measure import _measure_and_write, _unmeasured, _work, decide_entries
from .suite import DTYPES, default_suite, load_suite


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
                   help="output file, or a directory for the default name (default: configs/tuned/); --redecide's table "
                        "file (no default)")
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
                        f"only where it also saves {TRITON_MIN_SAVING_US:g} µs (dispatch.decide.TRITON_MIN_SAVING_US), "
                        "more than its route costs the host")
    p.add_argument("--redecide", action="store_true",
                   help="measure nothing: re-decide the entries of the table at --out from the measurements stored "
                        "in it (e.g. with another --min-gain); needs --out TABLE.json, no GPU")
    return p.parse_args(argv)


def redecide(path: pathlib.Path, min_gain: float, min_gain_us: float) -> int:
    """Rewrite the entries of the table at ``path`` from its stored measurements (no GPU needed)."""
    def unreadable() -> int:
        print(f"{path}: no readable table with stored measurements", file=sys.stderr)
        return 2

    if not path.is_file():  # (before the lock, which would make its directory)
        return unreadable()
    with tables.locked(path):  # (first-sight tuning in other processes merges into the same table)
        table = tables.read_table(path)
        if not table or not isinstance(table.get("measurements"), list) or not table["measurements"]:
            return unreadable()
        try:  # measurements as measure_shape writes them, deciding entries the table's reader takes
            entries = decide_entries(table["measurements"], min_gain, min_gain_us)
            for key, entry in entries.items():
                tables._check_entry(key, entry)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            print(f"{path}: its measurements do not make a valid table ({type(exc).__name__}: {exc}); "
                  "nothing written", file=sys.stderr)
            return 2
        changed = sorted(k for k in entries if table["entries"].get(k, {}).get("backend") != entries[k]["backend"]
                         or table["entries"].get(k, {}).get("kernel") != entries[k]["kernel"])
        table["entries"] = {**table["entries"], **entries}
        table["min_gain"], table["min_gain_us"] = min_gain, min_gain_us
        tables.atomic_write_text(path, json.dumps(table, indent=1))
    print(f"re-decided {len(entries)} entries of {path} with --min-gain {min_gain} --min-gain-us {min_gain_us}; "
          f"changed: {', '.join(changed) or 'none'}")
    return 0


def _writable(path: pathlib.Path) -> str | None:
    """Why the table at ``path`` cannot be written (its directory cannot be made or written to), or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return str(exc)
    return None if os.access(path.parent, os.W_OK) else f"{path.parent} is not writable"


def _table_path(out: pathlib.Path) -> pathlib.Path:
    device = torch.device("cuda", torch.cuda.current_device())
    name = tables.table_name(tuned.device_signature(device), torch.cuda.get_device_name(device))
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


if __name__ == "__main__":
    sys.exit(main())
