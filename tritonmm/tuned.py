"""Per-GPU tables of measured winners (``configs/tuned/*.json``), written by ``python -m tritonmm.tune``.

A table belongs to one GPU kind and one Triton release: it records the compute
capability, the SM count and the Triton version it was measured with. It is used where all three
match; a table of the same GPU kind measured with another Triton release is a prior
(:func:`prior_entry`): its cuBLAS and padded entries hold, its Triton winners only with a margin. Each entry names, for a dtype, a bucketed M (M = 1 has its own
key, :func:`m_key`), an exact N and K and the operand layouts: the backend chosen (a Triton kernel
and its config, cuBLAS on zero-padded aligned copies (backend "torch", kernel "padded"), or
torch.matmul/cuBLAS), which is the fastest measured except that a Triton kernel or the padded path
must beat cuBLAS by the tuner's ``--min-gain`` and ``--min-gain-us``, and both times in µs
(``triton_us``: the entry's kernel). A table that cannot be read or
parsed is skipped with one warning.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import tempfile
import warnings

import torch

from . import layout
from .kernels.configs import bucket, config_dir, validate
from .shapes import Plan

FORMAT = 1
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


def table_name(sig: dict, name: str) -> str:
    slug = name.lower().replace("nvidia ", "").replace(" ", "-")
    return f"{slug}-sm{sig['capability'][0]}{sig['capability'][1]}-{sig['sms']}sms-triton{sig['triton']}.json"


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


def _check_entry(key, e) -> None:
    """Raise ValueError unless ``e`` is a well-formed table entry (configs are data: ints under known names)."""
    if not isinstance(e, dict) or e.get("backend") not in ("torch", "triton"):
        raise ValueError(f"entry {key!r}: backend must be 'torch' or 'triton'")
    for timing in ("torch_us", "triton_us"):
        if e.get(timing) is not None and not isinstance(e[timing], (int, float)):
            raise ValueError(f"entry {key!r}: {timing} is not a number")
    if e["backend"] == "triton" or e.get("config") is not None:  # a torch entry names its fastest Triton config
        try:
            validate(e.get("kernel"), e.get("config"))
        except ValueError as exc:
            raise ValueError(f"entry {key!r}: {exc}") from None


def read_table(path: pathlib.Path) -> dict | None:
    """Parse and validate one table; None (with one warning) when it is unreadable, truncated,
    of another format or holds a malformed entry. Tables are JSON data, never executed."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError(f"format {data.get('format')!r} is not {FORMAT}")
        for key, entry in data["entries"].items():
            _check_entry(key, entry)
        return data
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        warnings.warn(f"tritonmm: ignoring tuned table {path}: {exc}", RuntimeWarning, stacklevel=3)
        return None


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Write ``path`` through a uniquely named temporary file and ``os.replace``: concurrent
    readers see the old or the new file, never part of one, and concurrent writers never
    share a temporary file (the last replace wins)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


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
        data = read_table(path)
        if not data or any(data.get(k) != sig[k] for k in ("capability", "sms")):
            continue
        if data.get("triton") == sig["triton"]:
            entries.update(data["entries"])
        else:
            priors.update({k: prior_entry(e, str(data.get("triton"))) for k, e in data["entries"].items()})
    return {**priors, **entries}


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


def saves(e: dict, min_saving_us: float) -> bool:
    """Whether a Triton entry measured at least ``min_saving_us`` µs faster than cuBLAS."""
    return e.get("triton_us") is not None and e["torch_us"] - e["triton_us"] >= min_saving_us


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
        dtype, m, n, k, _ = key.split(":")
        if dtype not in names or not (e.get("kernel") == "padded" or e.get("backend") == "triton" and saves(e, min_saving_us)):
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
