"""Candidate kernel configurations, their pruning, and the autotune key.

The candidates are data (``configs/candidates.json``), read on first use, never
at import. Pruning happens before anything is benchmarked:

* shared memory: ``num_stages * (BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * itemsize``
  (plus the epilogue staging buffer of the TMA kernel) must fit the GPU's
  per-block limit (Inductor's max-autotune was seen benchmarking 256 KiB configs
  on a 227 KiB H200);
* tile quantization: a tile much larger than the problem (BLOCK_M > 2 x the
  bucketed M, same for N and K) only computes padding;
* wave quantization: among the configs left, those whose tile count fills the
  SMs in fewer, fuller waves are ranked first (NVIDIA, *Matrix Multiplication
  Background*, "Wave Quantization").
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
from typing import Any

KERNELS = ("pointer", "splitk", "tma")


def config_dir() -> pathlib.Path:
    """The ``configs/`` directory, from ``$TRITONMM_CONFIG_DIR``, an installed wheel or a source checkout.

    Raises:
        FileNotFoundError: no directory holding ``candidates.json`` was found.
    """
    env = os.environ.get("TRITONMM_CONFIG_DIR")
    if env:
        if not (pathlib.Path(env) / "candidates.json").is_file():
            raise FileNotFoundError(f"environment variable TRITONMM_CONFIG_DIR={env!r} holds no candidates.json")
        return pathlib.Path(env)
    here = pathlib.Path(__file__).resolve().parent.parent  # tritonmm/
    places = [here / "configs", here.parent / "configs"]  # installed wheel (force-included), source checkout
    for place in places:
        if (place / "candidates.json").is_file():
            return place
    raise FileNotFoundError(f"tritonmm: no configs/candidates.json in {[str(p) for p in places]}")


@functools.cache
def _candidates_file() -> dict[str, Any]:
    """``candidates.json``, checked: for each kernel, ``fields`` and ``configs`` rows of ints Triton can launch
    (:func:`check_fields`, :func:`check_launchable`), and one ``interpreter`` config.

    Raises:
        ValueError: the file is not such a list of candidates (named, with what is wrong).
    """
    path = config_dir() / "candidates.json"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("interpreter"), dict):
            raise ValueError("not an object with an 'interpreter' object")
        for kernel in KERNELS:
            table = data.get(kernel)
            if not (isinstance(table, dict) and isinstance(table.get("fields"), list) and table["fields"]
                    and isinstance(table.get("configs"), list) and table["configs"]
                    and all(isinstance(r, list) and len(r) == len(table["fields"]) for r in table["configs"])):
                raise ValueError(f"{kernel}: not a non-empty 'fields' list and 'configs' rows of as many values")
            fields, optional = set(table["fields"]), set(OPTIONAL.get(kernel, ()))
            for config in [dict(zip(table["fields"], r)) for r in table["configs"]] + [data["interpreter"].get(kernel)]:
                if not isinstance(config, dict) or not fields - optional <= set(config) <= fields:  # (as validate's)
                    raise ValueError(f"{kernel}: config {config!r} does not have the fields {table['fields']}")
                check_fields(kernel, config)
                check_launchable(kernel, config)
    except (OSError, ValueError, RecursionError, TypeError) as exc:
        raise ValueError(f"tritonmm: {path} is not a valid candidate list: {exc}") from None
    return data


_dependents: list = []  # caches built from the candidates (clear() clears them too)


def clear() -> None:
    """Forget the candidates read (a new ``TRITONMM_CONFIG_DIR`` takes effect at the next use)."""
    _candidates_file.cache_clear()
    for cache in _dependents:
        cache.cache_clear()


def candidates(kernel: str) -> list[dict[str, int]]:
    """The candidate configs of ``kernel`` ("pointer", "splitk" or "tma") as dicts of field -> value,
    optional fields a row leaves out filled in (:func:`complete`)."""
    table = _candidates_file()[kernel]
    return [complete(kernel, dict(zip(table["fields"], row))) for row in table["configs"]]


OPTIONAL = {"tma": {"SPLIT_K": 1}}
"""Fields a config of a kernel may leave out, with their values (tma configs from before split-K)."""


def validate(kernel: str, config) -> None:
    """Check that ``config`` is a config of ``kernel``: the fields of its candidates, each an int
    (>= 1; ``EPILOGUE_SUBTILE`` may be 0; the "splitk" kernel's ``SPLIT_K`` >= 2, one split being the
    pointer kernel; a "tma" config may leave ``SPLIT_K`` out, meaning 1). Whether Triton can compile
    it is another matter.

    Raises:
        ValueError: unknown kernel, missing or extra fields, or a value of the wrong type or range.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    fields = set(candidates(kernel)[0])
    optional = set(OPTIONAL.get(kernel, ()))
    if not isinstance(config, dict) or not (fields - optional <= set(config) <= fields):
        got = sorted(config) if isinstance(config, dict) else type(config).__name__
        some = f" ({sorted(optional)} optional)" if optional else ""
        raise ValueError(f"a {kernel} config needs exactly the fields {sorted(fields)}{some}, got {got}")
    check_fields(kernel, config)


def check_fields(kernel: str, config: dict) -> None:
    """Raise ValueError unless each value of ``config`` is an int in its field's range (:func:`validate`)."""
    for k, v in config.items():
        low = {"EPILOGUE_SUBTILE": 0, "SPLIT_K": 2 if kernel == "splitk" else 1}.get(k, 1)
        if type(v) is not int or v < low:
            raise ValueError(f"{kernel} config field {k} must be an int >= {low}, got {v!r}")


def check_launchable(kernel: str, config: dict) -> None:
    """Raise ValueError unless ``config`` (ints) holds values Triton can launch: block sizes and ``num_warps``
    (at most 32) powers of two, ``num_stages`` at most 8, ``EPILOGUE_SUBTILE`` 0 or 1. Tables are held to it
    when read; a forced config is not (one that fails falls back to torch with a warning)."""
    for k, v in config.items():
        if (k.startswith("BLOCK_") or k == "num_warps") and v & (v - 1) or k == "num_warps" and v > 32 \
                or k == "num_stages" and v > 8 or k == "EPILOGUE_SUBTILE" and v > 1:
            raise ValueError(f"{kernel} config field {k}: {v} cannot launch (block sizes and num_warps <= 32 are "
                             "powers of two, num_stages <= 8, EPILOGUE_SUBTILE 0 or 1)")


def complete(kernel: str, config: dict) -> dict[str, int]:
    """A copy of ``config`` with the optional fields it leaves out (:data:`OPTIONAL`) filled in."""
    return {**config, **{k: v for k, v in OPTIONAL.get(kernel, {}).items() if k not in config}}


def interpreter_config(kernel: str) -> dict[str, int]:
    """The one config used for ``kernel`` under ``TRITON_INTERPRET=1``."""
    return complete(kernel, _candidates_file()["interpreter"][kernel])


def to_triton(cfg: dict[str, int]):
    """A ``triton.Config`` from a config dict (``num_stages``/``num_warps`` become launch options)."""
    import triton

    meta = {k: v for k, v in cfg.items() if k not in ("num_stages", "num_warps")}
    return triton.Config(meta, num_stages=cfg["num_stages"], num_warps=cfg["num_warps"])


def from_triton(config) -> dict[str, int]:
    """The inverse of :func:`to_triton`."""
    return {**config.kwargs, "num_stages": config.num_stages, "num_warps": config.num_warps}


def bucket(x: int) -> int:
    """Autotune bucket of a GEMM dimension: 16 for x <= 16, else the next power of two.

    Nearby shapes share a bucket and therefore one autotuning result.
    """
    return 16 if x <= 16 else 1 << (int(x) - 1).bit_length()


def smem_bytes(cfg: dict[str, int], itemsize: int, out_itemsize: int, kernel: str) -> int:
    """Shared memory of one program in bytes: pipelined A/B tiles plus the TMA epilogue buffer (the
    split-K TMA kernel's fp32 partial tile reuses the pipeline's buffers: Triton 3.6 for sm_90 reports
    the same size with and without a split)."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    stages = max(cfg["num_stages"], 1)
    total = stages * (bm * bk + bk * bn) * itemsize
    if kernel == "tma":
        total += bm * bn * out_itemsize // (2 if cfg.get("EPILOGUE_SUBTILE") else 1)
    return total


SPLIT_MAX_M = 256
"""Split-K TMA configs are kept for M up to this and fewer output tiles than SMs: the memory-bound
rows (a weight streamed by few tiles) where splitting K puts more SMs to work; elsewhere it only
adds partial-sum traffic."""


def splits_all_busy(K: int, cfg: dict[str, int], kernel: str) -> bool:
    """Whether every one of a split-K config's ``SPLIT_K`` K slices holds work (an empty slice still
    stores and sums a zero partial). The pointer kernel gives each split ceil(ceil(K / S) / BLOCK_K)
    BLOCK_K steps, the TMA kernel ceil(ceil(K / BLOCK_K) / S); True without a split."""
    s, bk = cfg.get("SPLIT_K", 1), cfg["BLOCK_K"]
    if s == 1:
        return True
    if kernel == "tma":  # in BLOCK_K steps
        k_tiles = math.ceil(K / bk)
        return (s - 1) * math.ceil(k_tiles / s) < k_tiles
    return (s - 1) * math.ceil(math.ceil(K / s) / bk) * bk < K  # in elements


def split_useful(M: int, N: int, K: int, cfg: dict[str, int], num_sms: int | None) -> bool:
    """Whether a split-K TMA config is worth running on an M x N x K problem (see :data:`SPLIT_MAX_M`,
    :func:`splits_all_busy`); True for configs without a split."""
    if cfg.get("SPLIT_K", 1) == 1:
        return True
    tiles = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
    return (M <= SPLIT_MAX_M and num_sms is not None and tiles < num_sms
            and splits_all_busy(K, cfg, "tma"))


def wave_efficiency(M: int, N: int, cfg: dict[str, int], num_sms: int, batch: int = 1) -> float:
    """Useful fraction of the launched work: tile quantization times wave quantization (0..1]."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles_m, tiles_n = -(-M // bm), -(-N // bn)
    tiles = tiles_m * tiles_n * batch * cfg.get("SPLIT_K", 1)
    tile_eff = (M * N) / (tiles_m * bm * tiles_n * bn)
    waves = math.ceil(tiles / num_sms)
    wave_eff = tiles / (waves * num_sms)
    return tile_eff * wave_eff


def prune(
    cfgs: list[dict[str, int]],
    *,
    M: int,
    N: int,
    K: int,
    itemsize: int,
    out_itemsize: int,
    kernel: str,
    smem_limit: int | None,
    num_sms: int | None,
    batch: int = 1,
    keep: int = 8,
) -> list[dict[str, int]]:
    """Drop configs that cannot run or only compute padding; rank the rest by quantization efficiency.

    Always returns at least one config (the one with the smallest tiles).
    """
    bm_max, bn_max, bk_max = 2 * bucket(M), 2 * bucket(N), 2 * bucket(K)
    kept = []
    for cfg in cfgs:
        if smem_limit is not None and smem_bytes(cfg, itemsize, out_itemsize, kernel) > smem_limit:
            continue
        if cfg["BLOCK_M"] > bm_max or cfg["BLOCK_N"] > bn_max or cfg["BLOCK_K"] > bk_max:
            continue
        if kernel == "splitk" and not splits_all_busy(K, cfg, kernel):
            continue
        if kernel == "tma" and not split_useful(M, N, K, cfg, num_sms):
            continue
        kept.append(cfg)
    if not kept:
        fitting = [c for c in cfgs if (kernel == "splitk" or c.get("SPLIT_K", 1) == 1)
                   and (smem_limit is None or smem_bytes(c, itemsize, out_itemsize, kernel) <= smem_limit)]
        kept = [min(fitting or cfgs, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"])]
    if num_sms and len(kept) > keep:
        kept.sort(key=lambda c: -wave_efficiency(M, N, c, num_sms, batch))
        kept = kept[:keep]
    return kept


def split_pool_key(kernel: str, pool: list[dict[str, int]]) -> int:
    """Which of ``kernel``'s split-K candidates a pruned pool holds, as a bitmask over
    :func:`candidates` (0: none). Part of the TMA kernel's autotune key: shapes of one bucket can
    keep different split configs, and the workspace is sized for the pool."""
    return sum(1 << i for i, c in enumerate(candidates(kernel)) if c.get("SPLIT_K", 1) > 1 and c in pool)


def heuristic(kernel: str, M: int, N: int, K: int, itemsize: int, out_itemsize: int, smem_limit: int | None,
              num_sms: int | None) -> dict[str, int]:
    """One config without benchmarking: the first of the candidates that pruning keeps, in the order
    of ``candidates.json`` (preferred first; the wave-quantization ranking only orders pools larger
    than autotuning's ``keep``, which this passes as the whole list).

    Used when ``TRITONMM_AUTOTUNE=0``, under several ranks, inside CUDA graph capture and compile tracing.
    """
    return prune(candidates(kernel), M=M, N=N, K=K, itemsize=itemsize, out_itemsize=out_itemsize,
                 kernel=kernel, smem_limit=smem_limit, num_sms=num_sms, keep=len(candidates(kernel)))[0]
