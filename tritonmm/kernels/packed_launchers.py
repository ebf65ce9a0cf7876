"""Launchers of the gated GEMM kernels on packed [Wg; Wu] weights (:mod:`.gated_packed`), bound to one geometry.

Configs are the plain TMA kernel's candidates (``configs/candidates.json``, split-K ones left out); a
config's ``BLOCK_N`` is the width of the GEMM tile, gate and up halves together, as in the plain GEMM on
[Wg; Wu], so a plain config's register budget carries over. Pruning makes a config's pipeline shallower where
its buffers and the epilogue's (larger than the plain kernel's where the projections are kept, and in the
backward) exceed the GPU's shared memory, and ranks the configs by the plain GEMM's quantization (:func:`configs.prune` on M x 2N x K). The first launch of a geometry runs ``@triton.autotune``
over them (results kept in Triton's on-disk cache); inside CUDA graph capture, with ``TRITONMM_AUTOTUNE=0``
or several ranks, the first config pruning keeps.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..core import device as _device
from ..core.env import autotune_enabled, deterministic_configs, interpreting
from . import configs as _cfg
from .gated_packed import _gated_packed_backward_kernel, _gated_packed_kernel
from .launch import DirectLaunch, capturing, ensure_allocator, input_precision

_DROPPED = ("SPLIT_K", "EPILOGUE_SUBTILE")
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_stages": 1, "num_warps": 4}


@functools.cache
def _candidates() -> tuple:
    """The plain TMA candidates without split-K or epilogue subtiling, deduplicated (BLOCK_N >= 64)."""
    out = []
    for c in _cfg.candidates("tma"):
        if c.get("SPLIT_K", 1) != 1 or c["BLOCK_N"] < 64:
            continue
        g = {k: v for k, v in c.items() if k not in _DROPPED}
        if g not in out:
            out.append(g)
    return tuple(out)


def smem_bytes(cfg: dict, itemsize: int, backward: bool, save: bool) -> int:
    """Shared memory of one program: the pipelined operand tiles and the epilogue's TMA buffers (forward: the
    (BLOCK_M, BLOCK_N // 2) tile of H, with ``save`` the (BLOCK_M, BLOCK_N) tile of [G | U]; backward: the
    (BLOCK_M, 2 * BLOCK_N) tiles of [G | U] read and [dG | dU] written), counted for at least 128 rows (Triton 3.6
    for sm_90 allots more than the tile for 64-row epilogues)."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    total = max(cfg["num_stages"], 1) * (bm + bn) * bk * itemsize
    rows = max(bm, 128)
    epilogue = 4 * rows * bn if backward else rows * bn // 2 + (rows * bn if save else 0)
    return total + epilogue * itemsize


def _fitted(cfg: dict, itemsize: int, backward: bool, save: bool, smem_limit) -> dict | None:
    """``cfg`` with its pipeline made shallower (down to 2 stages) until its buffers fit ``smem_limit``; None
    where even that does not fit."""
    c = dict(cfg)
    while smem_limit is not None and smem_bytes(c, itemsize, backward, save) > smem_limit:
        if c["num_stages"] <= 2:
            return None
        c["num_stages"] -= 1
    return c


def prune(cfgs, M: int, N: int, K: int, itemsize: int, backward: bool, save: bool, smem_limit, num_sms,
          keep: int = 8) -> list:
    """The configs fitted to ``smem_limit`` (:func:`_fitted`), deduplicated, ranked by quantization on the
    plain-equivalent problem (forward: M x 2N x K; backward: M x N x K); at least one (the smallest tiles)."""
    fit = []
    for c in cfgs:
        f = _fitted(c, itemsize, backward, save, smem_limit)
        if f is not None and f not in fit:
            fit.append(f)
    if not fit:
        fit = [min(cfgs, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"] * c["num_stages"])]
    return _cfg.prune(fit, M=M, N=N if backward else 2 * N, K=K, itemsize=itemsize, out_itemsize=itemsize,
                      kernel="pointer", smem_limit=None, num_sms=num_sms, keep=keep)


def _early_prune(backward: bool, configs, named_args, **kwargs):
    t = named_args["dy_ptr" if backward else "x_ptr"]
    kept = prune([_cfg.from_triton(c) for c in configs], named_args["M"], named_args["N"], named_args["K"],
                 t.element_size(), backward, bool(kwargs.get("SAVE", False)), _device.smem_limit(t.device),
                 _device.num_sms(t.device))
    return [_cfg.to_triton(k) for k in kept]  # (fitted configs: some with fewer stages than their candidate)


@functools.cache
def autotuned(backward: bool):
    """The ``@triton.autotune`` wrapper of the forward or backward kernel (key: bucketed M, N, K and the
    epilogue; Triton adds dtypes)."""
    configs = [_cfg.to_triton(c) for c in _candidates()]
    fn = _gated_packed_backward_kernel if backward else _gated_packed_kernel
    key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "ACTIVATION"] + ([] if backward else ["SAVE"])
    return triton.autotune(configs=configs, key=key, cache_results=True,
                           prune_configs_by={"early_config_prune": functools.partial(_early_prune, backward)})(fn)


_cfg._dependents += [_candidates, autotuned]


def fixed_config(M, N, K, dtype, device, backward: bool, save: bool):
    """The interpreter's config, the first config pruning keeps where no autotuning is allowed, else None."""
    if interpreting():
        return dict(INTERPRETER_CONFIG)
    if not autotune_enabled() or deterministic_configs():
        return prune(list(_candidates()), M, N, K, dtype.itemsize, backward, save, _device.smem_limit(device),
                     _device.num_sms(device))[0]
    return None


def _launcher(backward: bool, M: int, N: int, K: int, ints: tuple, meta: dict, dtype, device, save: bool, config):
    state = {"config": dict(config) if config is not None else fixed_config(M, N, K, dtype, device, backward, save)}
    sms = meta["NUM_SMS"]
    fn = _gated_packed_backward_kernel if backward else _gated_packed_kernel

    def grid(META):
        n_tile = META["BLOCK_N"] if backward else META["BLOCK_N"] // 2
        return (min(sms, triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, n_tile)),)

    direct = None

    def launch(*tensors):
        nonlocal direct
        ensure_allocator()
        args = (*tensors, *ints)
        if direct is not None:
            direct(args)
            return
        cfg = state["config"]
        if cfg is None and capturing(device):
            cfg = state["config"] = prune(list(_candidates()), M, N, K, dtype.itemsize, backward, save,
                                          _device.smem_limit(device), sms)[0]
        if cfg is None:
            tuner = autotuned(backward)
            tuner[grid](*args, **meta)
            state["config"] = _cfg.from_triton(tuner.best_config)
            return
        direct = DirectLaunch(fn, grid(cfg), {**meta, **cfg})
        direct(args)

    launch.state = state
    return launch


def _meta(dtype, device, activation: str) -> dict:
    return dict(NUM_SMS=_device.num_sms(device), ACTIVATION=activation, INPUT_PRECISION=input_precision(dtype, device),
                UPCAST=interpreting() and dtype == torch.bfloat16)


def packed_launcher(M: int, N: int, K: int, stride_x: int, stride_w: int, dtype: torch.dtype, device: torch.device,
                    save: bool = False, activation: str = "silu", config=None):
    """A launcher ``(x, w, h, gu) -> None`` of the forward kernel for one geometry: x (M, K) with row stride
    ``stride_x``, w = [Wg; Wu] (2N, K) with row stride ``stride_w``, h (M, N) and, with ``save``, gu (M, 2N)
    contiguous (else pass None); unit column strides, 16-byte aligned bases and row strides, N % 8 == 0."""
    ints = (M, N, K, stride_x, stride_w, N, 2 * N, _cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K))
    meta = {**_meta(dtype, device, activation), "SAVE": save}
    inner = _launcher(False, M, N, K, ints, meta, dtype, device, save, config)

    def launch(x, w, h, gu):
        inner(x, w, h, h if gu is None else gu)

    launch.state = inner.state
    return launch


def packed_backward_launcher(M: int, N: int, K: int, stride_dy: int, stride_wd: int, dtype: torch.dtype,
                             device: torch.device, activation: str = "silu", config=None):
    """A launcher ``(dy, wd, gu, dgu) -> None`` of the backward kernel for one geometry: dy (M, K) with row
    stride ``stride_dy``, wd (K, N) with row stride ``stride_wd``, gu and dgu (M, 2N) contiguous."""
    ints = (M, N, K, stride_dy, stride_wd, 2 * N, 2 * N, _cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K))
    return _launcher(True, M, N, K, ints, _meta(dtype, device, activation), dtype, device, False, config)
