"""Per-GPU tables of measured winners (``configs/tuned/*.json``), written by ``python -m tritonmm.tune``.

A table belongs to one GPU kind and one Triton release: it records the compute capability, the SM count and the
Triton version it was measured with. It is used where all three match; a table of the same GPU kind measured with
another Triton release is a prior (:func:`prior_entry`): its cuBLAS and padded entries hold, its Triton winners only
with a margin. Each entry names, for a dtype, a bucketed M (M = 1 has its own key, :func:`m_key`), an exact N and K
and the operand layouts: the backend chosen (a Triton kernel and its config, cuBLAS on zero-padded aligned copies
(backend "torch", kernel "padded"), or torch.matmul/cuBLAS), which is the fastest measured except that a Triton
kernel or the padded path must beat cuBLAS by the tuner's ``--min-gain`` and ``--min-gain-us``, and both times in µs
(``triton_us``: the entry's kernel). A table that cannot be read or parsed is skipped with one warning.

This machine's table (:func:`user_dir`) also holds the entries of first-sight tuning
(:mod:`tritonmm.dispatch.first_sight`, marked ``first_sight_s``: the seconds they took), merged in under a file lock
(:func:`tritonmm.dispatch.tables.merge_entries`). The files themselves (format, validation, locking, merging):
:mod:`tritonmm.dispatch.tables`.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

import torch

from ..core import layout
from ..core.shapes import Plan
from ..kernels.configs import bucket, config_dir
from . import tables

_SIBLING = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}


def m_key(M: int) -> int:
    """The M part of a table key: 1 for M = 1 (a GEMV, where cuBLAS and the Triton kernels rank
    differently than at M = 2-16), else the autotune bucket (:func:`configs.bucket`)."""
    return 1 if M == 1 else bucket(M)


def _key(dtype: torch.dtype, m: int, N: int, K: int, layout: str) -> str:
    return f"{str(dtype).removeprefix('torch.')}:{m}:{N}:{K}:{layout}"


def entry_key(dtype: torch.dtype, M: int, N: int, K: int, layout: str) -> str:
    return _key(dtype, m_key(M), N, K, layout)


def lookup_keys(dtype: torch.dtype, M: int, N: int, K: int, layout: str) -> list[str]:
    """Keys tried for a problem, in order: its own M key, then (M = 1) the bucket M = 1 shared with
    2-16 in tables written before M = 1 had its own key; each in ``dtype``, then in its sibling
    (float16 and bfloat16 run the same kernels at the same speed)."""
    ms = [m_key(M)] + ([bucket(M)] if bucket(M) != m_key(M) else [])
    dtypes = [dtype] + ([_SIBLING[dtype]] if dtype in _SIBLING else [])
    return [_key(d, m, N, K, layout) for m in ms for d in dtypes]


def device_signature(device: torch.device) -> dict:
    """What a table must match: compute capability, SM count, Triton version."""
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"capability": [props.major, props.minor], "sms": props.multi_processor_count, "triton": triton.__version__}


def tuned_dir() -> pathlib.Path:
    return config_dir() / "tuned"


def user_dir() -> pathlib.Path:
    """Where this machine's own tables go (:func:`tritonmm.tune_model`, ``python -m tritonmm.tune --user``):
    ``$TRITONMM_TUNED_DIR``, else ``$XDG_CACHE_HOME/tritonmm/tuned`` (default ``~/.cache/tritonmm/tuned``).
    Its entries take precedence over the shipped tables' for the same key."""
    env = os.environ.get("TRITONMM_TUNED_DIR")
    if env:
        return pathlib.Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "tritonmm" / "tuned"


def record(device: torch.device, entries: dict, update=None) -> pathlib.Path:
    """Add ``entries`` to the entries this process decides with and to this machine's table of ``device``
    (:func:`user_dir`, :func:`tables.merge_entries` with ``update``); returns the table's path.

    Raises:
        OSError: the table could not be written (the entries hold in this process all the same).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    _tables[index] = {**_table_for(index), **entries}  # a new dict: other threads may be reading the old one
    weight_used.cache_clear()
    sig = device_signature(device)
    name = torch.cuda.get_device_name(device)
    path = user_dir() / tables.table_name(sig, name)
    tables.merge_entries(path, sig, name, entries, update)
    return path


def _table_paths() -> list[pathlib.Path]:
    """The shipped tables, then this machine's (:func:`user_dir`), which override them key by key."""
    dirs = []
    try:
        dirs.append(tuned_dir())
    except FileNotFoundError:  # no configs dir: no shipped table
        pass
    dirs.append(user_dir())
    return [path for d in dirs if d.is_dir() for path in sorted(d.glob("*.json"))]


_tables: dict = {}  # GPU index -> its merged entries, read once (until clear())


def clear() -> None:
    """Forget the tables read (a new or re-tuned table takes effect at the next decision)."""
    _tables.clear()
    weight_used.cache_clear()


def _table_for(index: int) -> dict:
    if index not in _tables:
        _tables[index] = _read_tables(index)
    return _tables[index]


def _read_tables(index: int) -> dict:
    device = torch.device("cuda", index)
    try:
        sig = device_signature(device)
    except Exception:  # no GPU to describe: behave as if no table
        return {}
    entries: dict = {}
    priors: dict = {}
    for path in _table_paths():
        data = tables.read_table(path)
        if not data or any(data.get(k) != sig[k] for k in ("capability", "sms")):
            continue
        if data.get("triton") == sig["triton"]:
            entries.update(data["entries"])
        else:
            priors.update({k: prior_entry(e, str(data.get("triton"))) for k, e in data["entries"].items()})
    return {**priors, **entries}


def covered(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, layout: str) -> bool:
    """Whether the entry the dispatcher would look up for this problem (:func:`lookup_keys` order) is a
    measurement of this GPU and Triton release, or a prior naming the padded path (which does not
    depend on Triton): what first-sight tuning leaves alone."""
    entries = _entries(device)
    for key in lookup_keys(dtype, M, N, K, layout):
        e = entries.get(key)
        if e is not None:
            return "prior" not in e or e.get("kernel") == "padded"
    return False


def measured(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, layout: str) -> bool:
    """Whether a table of this GPU and Triton release (not a prior) holds this problem's own key."""
    e = _entries(device).get(entry_key(dtype, M, N, K, layout))
    return e is not None and "prior" not in e


PRIOR_MIN_GAIN = 0.15
"""A Triton winner of a table measured with another Triton release is kept only where it beat cuBLAS
by at least this fraction of cuBLAS's time: a margin for code generation that changed between
releases. cuBLAS and padded-cuBLAS entries do not depend on Triton and are kept as they are."""


def prior_entry(e: dict, triton_version: str) -> dict:
    """An entry of a table measured on this GPU with Triton ``triton_version`` (not the running one),
    marked ``prior``: Triton winners saving less than :data:`PRIOR_MIN_GAIN` become cuBLAS entries
    (their kernel and config stay as the hint forced runs use)."""
    out = {**e, "prior": triton_version}
    if e.get("backend") == "triton" and not (e.get("triton_us") and e["torch_us"] - e["triton_us"]
                                             >= PRIOR_MIN_GAIN * e["torch_us"]):
        out["backend"] = "torch"
    return out


def _entries(device: torch.device) -> dict:
    return _table_for(device.index if device.index is not None else torch.cuda.current_device())


FIRST_SIGHT_MIN_GAIN = 1.05
"""cuBLAS time / Triton time from which a first-sight measurement keeps a Triton kernel
(:data:`tritonmm.dispatch.first_sight.MIN_GAIN`); entries written with a smaller margin are held to it when read."""


def under_first_sight_margin(e: dict) -> bool:
    """Whether a Triton entry measured at first sight is under :data:`FIRST_SIGHT_MIN_GAIN` (written with an
    earlier, smaller margin)."""
    return "first_sight_s" in e and e["torch_us"] < FIRST_SIGHT_MIN_GAIN * e["triton_us"]


def saves(e: dict, min_saving_us: float) -> bool:
    """Whether a Triton entry measured at least ``min_saving_us`` µs faster than cuBLAS (and, measured at
    first sight, at least :data:`FIRST_SIGHT_MIN_GAIN` times as fast)."""
    t = e.get("triton_us")
    return t is not None and e["torch_us"] - t >= min_saving_us and not under_first_sight_margin(e)


def has_kernel(device: torch.device, dtype: torch.dtype, M: int, N: int, K: int, min_saving_us: float) -> bool:
    """Whether this GPU's table sends an M x N x K problem, in any operand layout, to the padded path or to
    a Triton kernel that saves at least ``min_saving_us``."""
    entries = _entries(device)
    if not entries:
        return False
    for lay in ("nn", "nt", "tn", "tt"):
        for k in lookup_keys(dtype, M, N, K, lay):
            e = entries.get(k)
            if e is not None:  # the first key found is the one lookup uses
                if e.get("kernel") == "padded" or e.get("backend") == "triton" and saves(e, min_saving_us):
                    return True
                break
    return False


@functools.lru_cache(maxsize=4096)
def weight_used(index: int, dtypes: tuple, N: int, K: int, min_saving_us: float, backward: bool = True) -> bool:
    """Whether any entry of GPU ``index``'s table that sends a problem to the padded path or to a Triton
    kernel saving at least ``min_saving_us`` could serve a GEMM with an (N, K) weight, in ``dtypes``:
    its forward (any M, N, K) and, with ``backward``, its input gradient (any M, K, N) or its weight
    gradient (N, K, any M; or K, N, any M for a matmul operand)."""
    names = {str(d).removeprefix("torch.") for d in dtypes}
    for key, e in _table_for(index).items():
        dtype, m, n, k, lay = key.split(":")
        if dtype not in names or lay in tables.GATED or not (
                e.get("kernel") == "padded" or e.get("backend") == "triton" and saves(e, min_saving_us)):
            continue
        n, k, m = int(n), int(k), int(m)
        if (n, k) == (N, K):
            return True
        if backward and ((n, k) == (K, N) or m in (m_key(N), bucket(N)) and n == K
                         or m in (m_key(K), bucket(K)) and n == N):
            return True
    return False


def entry(device: torch.device, dtype: torch.dtype, plan: Plan) -> dict | None:
    """This GPU's table entry for the problem (keys in :func:`lookup_keys` order: float16 and bfloat16
    stand in for each other, M = 1 falls back to the M <= 16 bucket), or None.
    Its ``kernel`` and ``config`` name the fastest Triton candidate measured even where cuBLAS won."""
    if plan.batch != 1:
        return None
    entries = _entries(device)
    if not entries:
        return None
    for key in lookup_keys(dtype, plan.M, plan.N, plan.K, layout.tag(plan)):
        e = entries.get(key)
        if e is not None:
            return e
    return None


def choose(group: list[dict], min_gain: float = 1.0, min_gain_us: float = 0.0) -> dict:
    """One entry for shapes sharing a key: the (kernel, config) with the least total normalized time;
    backend "triton" (or the padded path) only where torch.matmul time / its time >= ``min_gain`` and
    torch.matmul time - its time >= ``min_gain_us`` (µs) on every shape of the group."""
    def ident(c):
        return c["kernel"], json.dumps(c["config"], sort_keys=True)

    timed = [{ident(c): c["us"] for c in r["configs"] if "us" in c} for r in group]
    paired = [r.get("paired") for r in group]
    common = set.intersection(*(set(t) for t in timed)) if timed else set()
    best = {i: min(t.values()) for i, t in enumerate(timed) if t}
    if not common or len(best) < len(group):
        return {"backend": "torch", "kernel": None, "config": None, "triton_us": None,
                "torch_us": max(r["torch_us"] for r in group), "note": "no Triton config ran on every shape"}
    # candidates in measurement order, so a tie goes to the first measured, as in measure_shape's pairing
    # (do_bench medians step in 32 ns, so ties happen; a set's order would change with the hash seed)
    order = [k for k in dict.fromkeys(ident(c) for r in group for c in r["configs"] if "us" in c) if k in common]
    pick = min(order, key=lambda k: sum(t[k] / best[i] for i, t in enumerate(timed)))
    # per shape: the alternating head-to-head where it timed the pick, else the sweep's own times
    both = [(p["us"], p["torch_us"]) if p and ident(p) == pick else (t[pick], r["torch_us"])
            for p, t, r in zip(paired, timed, group)]
    tri = [x for x, _ in both]
    tor = [y for _, y in both]
    wins = all(y >= min_gain * x and y - x >= min_gain_us and x < y for x, y in zip(tri, tor))
    if pick[0] == "padded":  # cuBLAS on padded copies: a torch entry that names the padded path when it wins
        return {"backend": "torch", "kernel": "padded" if wins else None, "config": None,
                "triton_us": max(tri), "torch_us": max(tor),
                "shapes": [[r["M"], r["N"], r["K"], round(y / x, 3)] for r, x, y in zip(group, tri, tor)]}
    return {"backend": "triton" if wins else "torch", "kernel": pick[0], "config": json.loads(pick[1]),
            "triton_us": max(tri), "torch_us": max(tor),
            "shapes": [[r["M"], r["N"], r["K"], round(y / x, 3)] for r, x, y in zip(group, tri, tor)]}
