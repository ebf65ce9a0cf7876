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
    return json.loads((config_dir() / "candidates.json").read_text())


def candidates(kernel: str) -> list[dict[str, int]]:
    """The candidate configs of ``kernel`` ("pointer", "splitk" or "tma") as dicts of field -> value."""
    table = _candidates_file()[kernel]
    return [dict(zip(table["fields"], row)) for row in table["configs"]]


def validate(kernel: str, config) -> None:
    """Check that ``config`` is a config of ``kernel``: the fields of its candidates, each an int
    (>= 1; ``EPILOGUE_SUBTILE`` may be 0; ``SPLIT_K`` >= 2, one split being the pointer kernel).
    Whether Triton can compile it is another matter.

    Raises:
        ValueError: unknown kernel, missing or extra fields, or a value of the wrong type or range.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    fields = set(candidates(kernel)[0])
    if not isinstance(config, dict) or set(config) != fields:
        got = sorted(config) if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"a {kernel} config needs exactly the fields {sorted(fields)}, got {got}")
    for k, v in config.items():
        low = {"EPILOGUE_SUBTILE": 0, "SPLIT_K": 2}.get(k, 1)  # one split is the pointer kernel
        if type(v) is not int or v < low:
            raise ValueError(f"{kernel} config field {k} must be an int >= {low}, got {v!r}")


def interpreter_config(kernel: str) -> dict[str, int]:
    """The one config used for ``kernel`` under ``TRITON_INTERPRET=1``."""
    return dict(_candidates_file()["interpreter"][kernel])


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
    """Shared memory of one program in bytes: pipelined A/B tiles plus the TMA epilogue buffer."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    stages = max(cfg["num_stages"], 1)
    total = stages * (bm * bk + bk * bn) * itemsize
    if kernel == "tma":
        total += bm * bn * out_itemsize // (2 if cfg.get("EPILOGUE_SUBTILE") else 1)
    return total


@functools.cache
def device_limits(device_index: int) -> tuple[int, int]:
    """(shared memory per block in bytes, SM count) of a CUDA device, read once."""
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"]), int(props["multiprocessor_count"])


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
        if cfg.get("SPLIT_K", 1) > 1 and K < cfg["SPLIT_K"] * cfg["BLOCK_K"]:
            continue
        kept.append(cfg)
    if not kept:
        fitting = [c for c in cfgs if smem_limit is None or smem_bytes(c, itemsize, out_itemsize, kernel) <= smem_limit]
        kept = [min(fitting or cfgs, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"])]
    if num_sms and len(kept) > keep:
        kept.sort(key=lambda c: -wave_efficiency(M, N, c, num_sms, batch))
        kept = kept[:keep]
    return kept


def heuristic(kernel: str, M: int, N: int, K: int, itemsize: int, out_itemsize: int, device) -> dict[str, int]:
    """One config without benchmarking: the candidates pruned as for autotuning, best quantization first.

    Used when ``TRITONMM_AUTOTUNE=0``; ties keep the order of ``candidates.json`` (preferred first).
    """
    smem, sms = device_limits(device.index if device.index is not None else 0) if device.type == "cuda" else (None, 4)
    return prune(candidates(kernel), M=M, N=N, K=K, itemsize=itemsize, out_itemsize=out_itemsize,
                 kernel=kernel, smem_limit=smem, num_sms=sms, keep=len(candidates(kernel)))[0]
