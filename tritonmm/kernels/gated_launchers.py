"""Launchers of the gated GEMM kernels (:mod:`.gated`) bound to one geometry:
``launch(x, wg, wu, bg, bu, h, g, u) -> None``.

Configs are the plain GEMM's candidates (``configs/candidates.json``, split-K ones left out) with
``BLOCK_N`` halved: a gated tile holds two (BLOCK_M, BLOCK_N) accumulators, so a plain config's
register and shared-memory budget covers the same width of gate plus up. Pruning is the plain
GEMM's (:func:`configs.prune`) on that plain-equivalent problem (M x 2N x K). The first launch of
a geometry runs ``@triton.autotune`` over the pruned pool (results kept in Triton's on-disk cache);
inside CUDA graph capture, with ``TRITONMM_AUTOTUNE=0`` or several ranks, the heuristic's config.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..core import device as _device
from ..core.env import autotune_enabled, deterministic_configs, interpreting
from ..core.layout import needs_int64
from . import configs as _cfg
from .gated import _gated_kernel, _gated_tma_kernel
from .launch import DirectLaunch, capturing, ensure_allocator, input_precision

KERNELS = ("pointer", "tma")


def _plain_equivalent(cfg: dict) -> dict:
    return {**cfg, "BLOCK_N": 2 * cfg["BLOCK_N"]}


@functools.cache
def _candidates(kernel: str) -> tuple:
    """The gated configs of ``kernel``: plain candidates without split-K, BLOCK_N halved, deduplicated."""
    out = []
    for c in _cfg.candidates(kernel):
        if c.get("SPLIT_K", 1) != 1 or c["BLOCK_N"] < 32:
            continue
        g = {k: v for k, v in c.items() if k not in ("SPLIT_K", "EPILOGUE_SUBTILE")}
        g["BLOCK_N"] //= 2
        if g not in out:
            out.append(g)
    return tuple(out)


def validate(kernel: str, config) -> None:
    """Raise ValueError unless ``config`` is a gated config of ``kernel``: the fields of its candidates, ints >= 1
    (whether Triton can launch it: :func:`configs.check_launchable`)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown gated kernel {kernel!r}; expected one of {KERNELS}")
    fields = set(_candidates(kernel)[0])
    if not isinstance(config, dict) or set(config) != fields or any(type(v) is not int or v < 1 for v in config.values()):
        raise ValueError(f"a gated {kernel} config needs exactly the int fields {sorted(fields)} (>= 1), got {config!r}")


def prune(kernel: str, cfgs, M: int, N: int, K: int, itemsize: int, smem_limit, num_sms, keep: int = 8) -> list:
    """:func:`configs.prune` of the plain-equivalent problem (M x 2N x K), in gated configs."""
    plain = [_plain_equivalent(c) for c in cfgs]
    kept = _cfg.prune(plain, M=M, N=2 * N, K=K, itemsize=itemsize, out_itemsize=itemsize, kernel="pointer",
                      smem_limit=smem_limit, num_sms=num_sms, keep=keep)
    return [cfgs[plain.index(k)] for k in kept]


def heuristic(kernel: str, M, N, K, dtype: torch.dtype, device: torch.device) -> dict:
    """The first candidate pruning keeps, in ``candidates.json`` order."""
    pool = list(_candidates(kernel))
    return prune(kernel, pool, M, N, K, dtype.itemsize, _device.smem_limit(device), _device.num_sms(device),
                 keep=len(pool))[0]


def _early_prune(kernel: str, configs, named_args, **kwargs):
    x = named_args["x_ptr"]
    dicts = [_cfg.from_triton(c) for c in configs]
    kept = prune(kernel, dicts, named_args["M"], named_args["N"], named_args["K"], x.element_size(),
                 _device.smem_limit(x.device), _device.num_sms(x.device))
    return [configs[dicts.index(k)] for k in kept]


@functools.cache
def autotuned(kernel: str):
    """The ``@triton.autotune`` wrapper of one gated kernel (key: bucketed M, N, K and the pointer kernel's NORM; Triton
    adds dtypes)."""
    configs = [_cfg.to_triton(c) for c in _candidates(kernel)]
    prune_by = {"early_config_prune": functools.partial(_early_prune, kernel)}
    if kernel == "tma":
        fn = _gated_tma_kernel
    else:
        fn = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_gated_kernel)
    key = ["M_BUCKET", "N_BUCKET", "K_BUCKET"] + (["NORM"] if kernel == "pointer" else [])  # (NORM tunes apart)
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune_by, cache_results=True)(fn)


_cfg._dependents += [_candidates, autotuned]


def fixed_config(kernel: str, config, M, N, K, dtype, device):
    """An explicit config, the interpreter's, the heuristic's (no autotuning allowed), or None (autotune)."""
    if config is not None:
        return dict(config)
    if interpreting():
        c = _cfg.interpreter_config(kernel)
        return {k: v for k, v in c.items() if k not in ("SPLIT_K", "EPILOGUE_SUBTILE")} | {"BLOCK_N": 16}
    if not autotune_enabled() or deterministic_configs():
        return heuristic(kernel, M, N, K, dtype, device)
    return None


def gated_launcher(kernel: str, M: int, N: int, K: int, stride_x: int, stride_wg: int, stride_wu: int,
                   dtype: torch.dtype, device: torch.device, bias_strides=None, save: bool = False,
                   activation: str = "silu", config=None, norm_eps=None):
    """A launcher ``(x, wg, wu, bg, bu, h, g, u, nw=None) -> None`` of one gated kernel for one geometry.

    Args:
        kernel: "pointer" or "tma" (16-byte aligned bases and row strides, sm_90+).
        M, N, K: X is (M, K) with row stride ``stride_x``; Wg and Wu are (N, K) with row strides
            ``stride_wg``, ``stride_wu``; all with unit column stride.
        bias_strides: (stride of bg, stride of bu), or None: no biases.
        save: also store G and U (for the backward).
        activation: one of :data:`tritonmm.core.activations.ACTIVATIONS` but "none".
        config: a gated config (see the module docstring); default: autotuned on first launch.
        norm_eps: the pointer kernel only: X is an RMSNorm's input, normalized in the kernel with this epsilon and
            the (K,) weight ``nw`` each launch takes (``NORM`` in :mod:`.gated`); None: X as it is.
    """
    if norm_eps is not None and kernel != "pointer":
        raise ValueError(f"the {kernel} gated kernel takes no RMSNorm; the pointer kernel does")
    state = {"config": fixed_config(kernel, config, M, N, K, dtype, device)}
    sms = _device.num_sms(device)
    strides = (M, N, K, stride_x, stride_wg, stride_wu, *(bias_strides or (0, 0)))
    buckets = (_cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K))
    eps = 0.0 if norm_eps is None else float(norm_eps)
    tail = (*strides, *buckets) if kernel == "tma" else (*strides, eps, *buckets)  # (every launch's last arguments)
    meta = dict(HAS_BIAS=bias_strides is not None, SAVE=save, ACTIVATION=activation,
                INPUT_PRECISION=input_precision(dtype, device), UPCAST=interpreting() and dtype == torch.bfloat16)
    if kernel == "tma":
        meta["NUM_SMS"] = sms
        fn = _gated_tma_kernel
    else:
        meta["INT64"] = needs_int64((M, K, stride_x, 1), (N, K, max(stride_wg, stride_wu), 1), (M, N, N, 1))
        meta["NORM"] = norm_eps is not None
        meta["NORM_ONE_PASS"] = norm_eps is not None and dtype != torch.float16  # (the kernel's docstring)
        fn = _gated_kernel

    def grid(META):
        tiles = triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"])
        return (min(sms, tiles),) if kernel == "tma" else (tiles,)

    direct = None

    def launch(x, wg, wu, bg, bu, h, g, u, nw=None):
        nonlocal direct
        if kernel == "tma":
            ensure_allocator()
            args = (x, wg, wu, h if bg is None else bg, h if bu is None else bu, h, h if g is None else g,
                    h if u is None else u, *tail)
        else:
            args = (x, wg, wu, h if bg is None else bg, h if bu is None else bu, h, h if g is None else g,
                    h if u is None else u, h if nw is None else nw, *tail)
        if direct is not None:
            direct(args)
            return
        cfg = state["config"]
        if cfg is None and capturing(device):
            cfg = state["config"] = heuristic(kernel, M, N, K, dtype, device)
        if cfg is None:
            tuner = autotuned(kernel)
            tuner[grid](*args, **meta)
            state["config"] = _cfg.from_triton(tuner.best_config)
            return
        extra = {} if kernel == "tma" else {"EVEN_K": K % cfg["BLOCK_K"] == 0}
        direct = DirectLaunch(fn, grid(cfg), {**meta, **cfg, **extra})
        direct(args)

    launch.state = state
    return launch
