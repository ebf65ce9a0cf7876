"""Tuned tables as files: their format, validation, locking, merging and atomic writes (:mod:`tritonmm.dispatch.tuned`
reads this GPU's entries from them).

A table is JSON data, never executed: ``{"format": 1, "device", "capability", "sms", "triton", "torch", "entries":
{key: entry}, "measurements": [...]}``. A key reads ``dtype:M:N:K:layout`` (:func:`tritonmm.dispatch.tuned.entry_key`);
an entry names a backend, the fastest Triton kernel and config measured and both times in µs. Writers merge under a
file lock (:func:`merge_entries`) and replace the file atomically (:func:`atomic_write_text`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import tempfile
import warnings

import torch

from ..core.activations import ACTIVATIONS
from ..kernels.configs import check_launchable, validate

FORMAT = 1


def table_name(sig: dict, name: str) -> str:
    slug = name.lower().replace("nvidia ", "").replace(" ", "-")
    return f"{slug}-sm{sig['capability'][0]}{sig['capability'][1]}-{sig['sms']}sms-triton{sig['triton']}.json"


_KEY_DTYPES = ("float16", "bfloat16", "float32")
_KEY_LAYOUTS = ("nn", "nt", "tn", "tt")
GATED = tuple(f"gated_{a}" for a in ACTIVATIONS if a != "none")  # gated linears' keys (gated_tuning)


def _check_key(key) -> None:
    """Raise ValueError unless ``key`` reads ``dtype:M:N:K:layout`` (:func:`entry_key`; or a :data:`GATED` part)."""
    parts = key.split(":") if isinstance(key, str) else []
    if not (len(parts) == 5 and parts[0] in _KEY_DTYPES and all(x.isdigit() and int(x) > 0 for x in parts[1:4])
            and (parts[4] in _KEY_LAYOUTS or parts[4] in GATED)):
        raise ValueError(f"key {key!r} is not dtype:M:N:K:layout")


def _check_entry(key, e) -> None:
    """Raise ValueError unless ``key`` and ``e`` make a well-formed table entry (configs are data: ints
    under known names; every entry has its cuBLAS time)."""
    _check_key(key)
    if not isinstance(e, dict) or e.get("backend") not in ("torch", "triton"):
        raise ValueError(f"entry {key!r}: backend must be 'torch' or 'triton'")
    for timing in ("torch_us", "triton_us"):  # (a Triton entry has its kernel's time)
        t = e.get(timing)
        if (t is not None or timing == "torch_us" or e["backend"] == "triton") and not (
                type(t) in (int, float) and 0 <= t < 1e12):  # (< 1e12: a float, neither NaN nor inf)
            raise ValueError(f"entry {key!r}: {timing} is not a number of µs (finite, >= 0): {t!r}")
    if e["backend"] == "triton" or e.get("config") is not None:  # a torch entry names its fastest Triton config
        from ..kernels import gated_launchers  # (imports triton: on use)
        try:
            (gated_launchers.validate if key.endswith(GATED) else validate)(e.get("kernel"), e.get("config"))
            check_launchable(e["kernel"], e["config"])
        except ValueError as exc:
            raise ValueError(f"entry {key!r}: {exc}") from None


_BAD_TABLE = (OSError, ValueError, AttributeError, TypeError, RecursionError)  # (RecursionError: deep JSON)


def parse_table(path: pathlib.Path) -> dict:
    """Parse and validate one table. Tables are JSON data, never executed.

    Raises:
        OSError, ValueError, AttributeError, TypeError, RecursionError: unreadable, truncated, of another
            format, or holding a malformed entry.
    """
    data = _load(path)
    for key, entry in data["entries"].items():
        _check_entry(key, entry)
    return data


def _load(path: pathlib.Path) -> dict:
    """The JSON at ``path`` if it is a table of this format (entries not checked)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        raise ValueError(f"format {data.get('format') if isinstance(data, dict) else None!r} is not {FORMAT}")
    return data


def read_table(path: pathlib.Path) -> dict | None:
    """:func:`parse_table`, or None (with one warning) for a table it refuses."""
    try:
        return parse_table(path)
    except _BAD_TABLE as exc:
        warnings.warn(f"tritonmm: ignoring tuned table {path}: {exc}", RuntimeWarning, stacklevel=3)
        return None


@contextlib.contextmanager
def locked(path: pathlib.Path):
    """Hold an exclusive lock on a lock file beside ``path`` (where the platform has ``fcntl``), so that
    processes merging entries into the same table take turns and none loses another's entries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: writes stay atomic, a concurrent merge may drop entries
        yield
        return
    with open(path.parent / f".{path.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


MAX_FIRST_SIGHT = 4096
"""First-sight entries (:mod:`tritonmm.dispatch.first_sight`) a machine's table keeps; the oldest go first."""


def merge_entries(path: pathlib.Path, sig: dict, device_name: str, entries: dict, update=None) -> dict:
    """Add ``entries`` (table key -> entry) to the table at ``path``, then call ``update(table)`` if given, under
    :func:`locked`, written with :func:`atomic_write_text` (first-sight tuning, ``tune_model``, ``tune --user`` and
    ``--merge``). At most :data:`MAX_FIRST_SIGHT` first-sight entries are kept. A file there that is not a table of
    this GPU and Triton release (``sig``) is moved aside to ``<name>.bad`` with one warning; a table entry that does
    not validate (a config of another candidate list, say) is dropped with one warning. Returns the entries written.

    Raises:
        ValueError: an entry of ``entries`` is malformed (nothing is written).
        OSError: the file could not be written.
    """
    for key, entry in entries.items():
        _check_entry(key, entry)
    with locked(path):
        table = _mergeable(path, sig)
        if table is None:
            table = {"format": FORMAT, "device": device_name, **sig, "torch": torch.__version__,
                     "entries": {}, "measurements": []}
        old = table["entries"]
        for key in entries:
            old.pop(key, None)  # a re-measured key moves to the end: the newest
        old.update(entries)
        first_sight = [k for k, e in old.items() if "first_sight_s" in e]
        for key in first_sight[:max(0, len(first_sight) - MAX_FIRST_SIGHT)]:
            del old[key]
        if update is not None:
            update(table)
        atomic_write_text(path, json.dumps(table, indent=1))
    return old


def _mergeable(path: pathlib.Path, sig: dict) -> dict | None:
    """The table at ``path`` with its valid entries, or None (nothing there, or moved aside: see
    :func:`merge_entries`)."""
    if not path.exists():
        return None
    try:
        table = _load(path)
        if any(table.get(k) != sig[k] for k in ("capability", "sms", "triton")):
            raise ValueError("measured on another GPU or Triton release (" + ", ".join(
                f"{k} {table.get(k)}" for k in ("capability", "sms", "triton")) + ")")
    except _BAD_TABLE as exc:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        warnings.warn(f"tritonmm: moved tuned table {path} aside to {bad.name}: {exc}", RuntimeWarning, stacklevel=4)
        return None
    kept = {}
    for key, entry in table["entries"].items():
        try:
            _check_entry(key, entry)
            kept[key] = entry
        except ValueError as exc:
            warnings.warn(f"tritonmm: dropping from tuned table {path}: {exc}", RuntimeWarning, stacklevel=4)
    table["entries"] = kept
    return table


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
