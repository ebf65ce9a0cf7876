"""Shape suites: the GEMM geometries ``python -m tritonmm.tune`` measures and ``python -m tritonmm.bench`` times, as
JSON (``configs/shapes.json``, the public suite; :func:`tritonmm.tune.capture.geometries` records a model's)."""

from __future__ import annotations

import json
import pathlib

import torch

from ..kernels.configs import config_dir

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_suite() -> pathlib.Path:
    """The public suite shipped in ``configs/``."""
    return config_dir() / "shapes.json"


def load_suite(path: pathlib.Path, tags) -> tuple[list[dict], list[str]]:
    """The rows of a shape suite (``configs/shapes.json``'s format, which :func:`tritonmm.tune.capture.geometries`
    writes too) whose tag starts with one of ``tags`` (all rows without ``tags``), and the suite's dtypes.

    Raises:
        ValueError: the file cannot be read, or is not such a suite (the first bad row is named).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not a readable shape suite ({exc})") from None
    rows, dtypes = (data.get("shapes"), data.get("dtypes", ["bfloat16"])) if isinstance(data, dict) else (None, None)
    if not isinstance(rows, list) or not isinstance(dtypes, list) or not all(d in DTYPES for d in dtypes):
        raise ValueError(f"{path}: a shape suite is a JSON object with a 'shapes' list (and an optional 'dtypes' "
                         f"list of {', '.join(DTYPES)})")
    for i, s in enumerate(rows):
        if not (isinstance(s, dict) and isinstance(s.get("tag"), str) and all(type(s.get(k)) is int and s[k] > 0
                                                                              for k in "MNK")
                and s.get("dtype", "bfloat16") in DTYPES and s.get("layout", "nn") in ("nn", "nt")):
            raise ValueError(f"{path}: shape row {i}, {s!r}, is not {{'tag': str, 'M', 'N', 'K': int > 0}} with an "
                             f"optional 'dtype' ({', '.join(DTYPES)}) and 'layout' (nn, nt)")
    return [s for s in rows if not tags or any(s["tag"].startswith(t) for t in tags)], dtypes
