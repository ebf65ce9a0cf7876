"""Launchers bound to one GEMM geometry: ``launch(a, b, c, bias) -> None``.

A launcher is built once per geometry (sizes, strides, dtype, epilogue) and then only receives
the tensors: the per-call cost is one launch. Before its first launch an autotuned launcher runs
``@triton.autotune`` (or, inside CUDA graph capture, takes the heuristic's config); afterwards it
launches the chosen config directly (:class:`launch.DirectLaunch`).
"""

from __future__ import annotations

import torch
import triton

from ..core import device as _device
from ..core import workspace
from ..core.env import interpreting
from ..core.layout import needs_int64, tma_layout
from . import configs as _cfg
from .launch import DirectLaunch, autotune, capturing, ensure_allocator, fixed_config, heuristic_config, input_precision
from .pointer import _matmul_kernel
from .tma import _matmul_tma_kernel


def _first_config(state: dict, kernel: str, M, N, K, dtype, device):
    """The config fixed so far; inside CUDA graph capture, where nothing can be benchmarked, the heuristic's."""
    cfg = state["config"]
    if cfg is None and capturing(device):
        cfg = state["config"] = heuristic_config(kernel, M, N, K, dtype, device)
    return cfg


def pointer_launcher(M, N, K, B0, B1, sa, sb, sc, dtype, device, bias_stride=None, activation="none",
                     config=None, split_k=False):
    """A launcher ``(a, b, c, bias) -> None`` of the pointer kernel for one problem geometry.

    Args:
        M, N, K, B0, B1 (int): GEMM sizes and the two batch levels.
        sa, sb, sc (tuple): 4 strides (batch0, batch1, row, col) in elements of A (B0, B1, M, K),
            B (B0, B1, K, N) and C (B0, B1, M, N); the tensors passed later point at element 0.
        dtype, device: of A, B and C.
        bias_stride (int, optional): the (N,) bias's stride; None: no bias.
        activation (str): one of :data:`tritonmm.core.activations.ACTIVATIONS`.
        config (dict, optional): explicit config; default: autotuned (GPU), the interpreter's, or the heuristic's.
        split_k (bool): split K over ``SPLIT_K`` programs; their fp32 partials go to the workspace and
            each tile's last split sums them and applies the epilogue; needs B0 = B1 = 1.
    """
    kernel = "splitk" if split_k else "pointer"
    state = {"config": fixed_config(kernel, config, M, N, K, dtype, device)}
    if split_k:
        assert B0 == 1 and B1 == 1, "split-K takes one GEMM"
        if config is not None and config.get("SPLIT_K", 1) < 2:  # the epilogue would run twice
            raise ValueError(f"a split-K config needs SPLIT_K >= 2 (one split is the pointer kernel), got {config}")
        sc = (0, 0, N, 1)
    int64 = needs_int64((M, K, sa[2], sa[3]), (K, N, sb[2], sb[3]), (M, N, sc[2], sc[3]))
    layout = int(sa[3] != 1) | (int(sb[3] != 1) << 1)
    ints = (M, N, K, B1, *sa, *sb, *sc, M * N if split_k else 0, bias_stride or 0,
            _cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K), layout)
    meta = dict(INT64=int64, HAS_BIAS=bias_stride is not None, ACTIVATION=activation,
                INPUT_PRECISION=input_precision(dtype, device), UPCAST=interpreting() and dtype == torch.bfloat16)
    if not split_k:
        meta["SPLIT_K"] = 1
    tiles = B0 * B1

    def tile_count(x) -> int:  # tiles of config x: one arrival counter each
        return triton.cdiv(M, x["BLOCK_M"]) * triton.cdiv(N, x["BLOCK_N"])

    def grid(META):
        return (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]) * tiles, META.get("SPLIT_K", 1))

    direct = None  # the fixed config's direct launch, once built

    def launch(a, b, c, bias):
        nonlocal direct
        if direct is not None and not split_k:
            direct((a, b, c, c if bias is None else bias, c, c, *ints))
            return
        cfg = _first_config(state, kernel, M, N, K, dtype, c.device)
        target = locks = c
        if split_k:  # fp32 partials live in the reused workspace (no per-call allocation)
            splits = cfg["SPLIT_K"] if cfg else max(x["SPLIT_K"] for x in _cfg.candidates("splitk"))
            (target,) = workspace.buffers(c.device, [((splits, M, N), torch.float32)], slot="splitk")
            if cfg is None:  # autotuning: any candidate may run
                n_locks = max(map(tile_count, _cfg.candidates("splitk")))
            else:  # the config is fixed from here on: counted once
                n_locks = state.get("n_locks")
                if n_locks is None:
                    n_locks = state["n_locks"] = tile_count(cfg)
            locks = workspace.counters(c.device, n_locks)
        args = (a, b, target, bias if bias is not None else target, c, locks, *ints)
        if cfg is None:
            state["config"] = autotune(kernel, grid, args, meta)
            return
        if direct is None:
            direct = DirectLaunch(_matmul_kernel, grid({**cfg, **meta}),
                                  {**meta, **cfg, "EVEN_K": K % cfg["BLOCK_K"] == 0})
        direct(args)

    launch.state = state
    return launch


def tma_launcher(M, N, K, a_trans, stride_a, b_trans, stride_b, dtype, device, bias_stride=None,
                 activation="none", config=None):
    """A launcher ``(a, b, c, bias) -> None`` of the persistent TMA kernel for one 2-D problem.

    Args:
        M, N, K (int): GEMM sizes.
        a_trans, stride_a: A is read as (M, K) row-major with row stride ``stride_a`` elements, or,
            when ``a_trans``, through its (K, M) row-major storage (see :func:`tritonmm.core.layout.tma_layout`).
        b_trans, stride_b: likewise for B (K, N); ``b_trans`` reads an (N, K) nn.Linear weight in place.
        dtype, device, bias_stride, activation, config: as in :func:`pointer_launcher`. A config with
            ``SPLIT_K`` >= 2 splits K: (SPLIT_K, M, N) fp32 partials in the workspace (slot
            "splitk"), summed with the epilogue by each tile's last split; without ``SPLIT_K``, 1.
        C is a contiguous (M, N) tensor; it is stored through TMA when its rows are 16-byte aligned.
    """
    state = {"config": fixed_config("tma", config, M, N, K, dtype, device)}
    sms = _device.num_sms(device)
    esize = dtype.itemsize
    pool, split_pool = [], 0
    if state["config"] is None:  # autotuning: the candidates pruning keeps, as @triton.autotune will
        pool = _cfg.prune(_cfg.candidates("tma"), M=M, N=N, K=K, itemsize=esize, out_itemsize=esize, kernel="tma",
                          smem_limit=_device.smem_limit(device), num_sms=sms)
        split_pool = _cfg.split_pool_key("tma", pool)
    ints = (M, N, K, stride_a, stride_b, N, bias_stride or 0, M * N, _cfg.bucket(M), _cfg.bucket(N), _cfg.bucket(K),
            split_pool)
    meta = dict(NUM_SMS=sms, A_TRANS=a_trans, B_TRANS=b_trans, C_TMA=(N * esize) % 16 == 0,
                HAS_BIAS=bias_stride is not None, ACTIVATION=activation,
                INPUT_PRECISION=input_precision(dtype, device), UPCAST=interpreting() and dtype == torch.bfloat16)

    has_split = True  # until the config is fixed: scratch may be needed

    def tiles(x) -> int:
        return triton.cdiv(M, x["BLOCK_M"]) * triton.cdiv(N, x["BLOCK_N"])

    def grid(META):
        return (min(sms, tiles(META) * META["SPLIT_K"]),)

    def scratch(cfg, device):
        """(partials, counters) for a launch of ``cfg`` (None: autotuning, any config of the pool may run)."""
        split = [x for x in ([cfg] if cfg is not None else pool) if x["SPLIT_K"] > 1]
        if not split:
            return None, None
        (partials,) = workspace.buffers(device, [((max(x["SPLIT_K"] for x in split), M, N), torch.float32)],
                                        slot="splitk")
        return partials, workspace.counters(device, max(map(tiles, split)))

    direct = None

    def launch(a, b, c, bias):
        nonlocal direct, has_split
        ensure_allocator()
        if direct is not None and not has_split:
            direct((a, b, c, c if bias is None else bias, c, c, *ints))
            return
        cfg = _first_config(state, "tma", M, N, K, dtype, c.device)
        partials, locks = scratch(cfg, c.device) if cfg is None or cfg["SPLIT_K"] > 1 else (None, None)
        args = (a, b, c, bias if bias is not None else c, c if partials is None else partials,
                c if locks is None else locks, *ints)
        if cfg is None:
            state["config"] = autotune("tma", grid, args, meta)
            return
        if direct is None:
            direct = DirectLaunch(_matmul_tma_kernel, grid(cfg), {**meta, **cfg})
            has_split = cfg["SPLIT_K"] > 1
        direct(args)

    launch.state = state
    return launch


def launch_pointer(a4, b4, c4, bias=None, activation="none", config=None, split_k=False):
    """C4 = act(A4 @ B4 + bias) with the pointer kernel, for (B0, B1, M, K) @ (B0, B1, K, N) views.

    Returns:
        dict: the config that ran (for autotuned launches, the autotuner's choice).
    """
    B0, B1, M, K = a4.shape
    launch = pointer_launcher(M, b4.shape[-1], K, B0, B1, a4.stride(), b4.stride(), c4.stride(), a4.dtype,
                              a4.device, None if bias is None else bias.stride(0), activation, config, split_k)
    launch(a4, b4, c4, bias)
    return launch.state["config"]


def launch_tma(a2, b2, c2, bias=None, activation="none", config=None):
    """C2 = act(A2 @ B2 + bias) with the TMA kernel; A2 (M, K) and B2 (K, N) accepted by
    :func:`tritonmm.core.layout.tma_compatible`, C2 a contiguous (M, N) tensor.

    Returns:
        dict: the config that ran.
    """
    (M, K), N = a2.shape, b2.shape[1]
    a_trans, stride_a = tma_layout(a2)
    b_trans, stride_b = tma_layout(b2)
    launch = tma_launcher(M, N, K, a_trans, stride_a, b_trans, stride_b, a2.dtype, a2.device,
                          None if bias is None else bias.stride(0), activation, config)
    launch(a2, b2, c2, bias)
    return launch.state["config"]
