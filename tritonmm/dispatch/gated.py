"""The gated linear: ``act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)`` in fewer kernels.

This is the first half of a Llama-family MLP (gate and up projections, SiLU, product). Without autograd, on packed
weights (``w_up`` directly after ``w_gate``, as :func:`tritonmm.fuse` stores them) above :data:`GATED_MAX_M` rows and
from :data:`tritonmm.dispatch.gated_cublas.PACKED_KERNEL_MIN_FLOPS` per projection, the gated GEMM on the packed
weights (:mod:`tritonmm.kernels.gated_packed`, Hopper GPUs) serves. Otherwise up to :data:`GATED_MAX_M`
rows, and without autograd up to :data:`KERNEL_MAX_FLOPS_NO_GRAD` per projection, the Triton GEMM kernels
(:mod:`tritonmm.kernels.gated`) read x once for both projections and write only the product, instead of two
projections, the activation and the product as four tensors. Above, from
:data:`PRODUCT_MIN_FLOPS` (:data:`PRODUCT_MIN_FLOPS_NO_GRAD` without autograd), cuBLAS runs the two projections and
one Triton pass (:mod:`tritonmm.dispatch.gated_cublas`) the activation and the product, where eager runs two;
smaller calls run the torch expression. With packed weights (``w_up`` directly after ``w_gate`` in one storage, as
:func:`tritonmm.fuse` stores them; no biases) that path runs both projections as one GEMM.

The op ``tritonmm::gated_linear``, its autograd and the entry point :func:`tritonmm.gated_linear`, in every mode:
:mod:`tritonmm.ops.gated`. This module decides the path by size and launches it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import activations
from ..core import device as _device
from ..core import modes
from . import gated_cublas, gated_tuning, runners

GATED_MAX_M = 16
"""Rows (M) up to which the gated GEMM kernel on separate weights serves a call: decode-sized GEMMs, memory- and
launch-bound, where one kernel instead of four saves launches and a pass over the projections. Above it that kernel
ran slower than eager wherever the GPU set the pace (``benchmarks/h200_mlp.json``, ``kernel_ratio``)."""
PRODUCT_MIN_FLOPS = 2**35
"""FLOP per projection (2·M·N·K, 3.4e10) from which calls with autograd of more than :data:`GATED_MAX_M` rows
take the cuBLAS + product path; smaller ones run the torch expression (eager's kernels): the host sets the pace
there and the path costs more host time than its pass saves (``benchmarks/h200_mlp.json``)."""
PRODUCT_MIN_FLOPS_NO_GRAD = 2**37
"""FLOP per projection (1.4e11) from which calls without autograd on weights that are not packed take the product
path: an inference forward stays paced by the host to larger sizes than a training step, and the product pass's
launch costs host time (``benchmarks/h200_model.json``, ``diagnostics/h200_mlp_host_in_model.json``). Calls on
packed weights take the gated GEMM on them from :data:`tritonmm.dispatch.gated_cublas.PACKED_KERNEL_MIN_FLOPS`."""
KERNEL_MAX_FLOPS_NO_GRAD = 2**34
"""FLOP per projection (2·M·N·K, 1.7e10) up to which calls without autograd of more than :data:`GATED_MAX_M` rows
run the gated GEMM kernel too, where this GPU's table or a first-sight measurement
(:mod:`tritonmm.dispatch.gated_tuning`) picks it over the torch expression: faster there, slower above
(``benchmarks/diagnostics/h200_gated_band.json``)."""
TMA_MIN_M = 64
"""Rows above which the persistent TMA kernel serves (on sm_90+, aligned operands; reached by
:func:`forward` callers that pass larger M); the pointer kernel's small-M tiles serve the rest."""
_LAUNCHERS_MAX = 1024
_launchers: dict = {}
_empty = torch.empty  # the kernels' output allocator (tests swap in a NaN-filling one)
_precision = torch.get_float32_matmul_precision  # (float32 launchers: TF32 or not, fixed when built)
_F32 = torch.float32
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_cublas_forward = gated_cublas.forward


def reference(x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Optional[Tensor] = None,
              b_up: Optional[Tensor] = None, activation: str = "silu") -> Tensor:
    """The torch expression the gated linear computes (also its fallback)."""
    return activations.apply(F.linear(x, w_gate, b_gate), activation) * F.linear(x, w_up, b_up)


def kernel_serves(x: Tensor) -> bool:
    """Whether the Triton kernels serve this problem (any number of rows, :func:`forward`): dtype, device,
    a nonempty problem."""
    return x.numel() != 0 and gated_cublas.serves(x)


def _tma_ok(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def choose_kernel(x2: Tensor, w_gate: Tensor, w_up: Tensor) -> str:
    """"tma" for more than :data:`TMA_MIN_M` rows on sm_90+ with aligned operands, else "pointer"."""
    if x2.shape[0] > TMA_MIN_M and _device.has_tma(x2.device) and _tma_ok(x2, w_gate, w_up):
        return "tma"
    return "pointer"


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def forward(x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate, b_up, activation: str, save: bool,
            kernel: Optional[str] = None, config: Optional[dict] = None, pack: bool = True):
    """Run a :func:`~tritonmm.ops.gated_args.kernel_shaped` call: (h, g, u), h of shape (*x.shape[:-1], N); g and u
    (M, N) when ``save``, else None. The gated GEMM ``kernel`` ("pointer" or "tma"; default: the pointer kernel) where
    :func:`kernel_rows` holds or ``kernel`` is given; else cuBLAS
    projections (one GEMM where the weights are packed and ``pack``; g and u are then the halves of its
    output) and the one-pass product."""
    from ..kernels.launch import LAUNCH_FAILURES

    N, K = w_gate.shape
    lead = x.shape[:-1]
    M = lead.numel()
    if kernel is None and (not kernel_rows(M, N, K, save) or M > GATED_MAX_M and b_gate is None
                           and gated_cublas.packed_takes(x, w_gate, w_up, save)):
        return gated_cublas.forward(x, w_gate, w_up, b_gate, b_up, activation, save, pack)
    x2 = _unit_last(x.reshape(-1, K))
    w_gate, w_up = _unit_last(w_gate), _unit_last(w_up)
    auto = kernel is None and config is None
    if kernel is None:
        kernel = "pointer"  # (the kernel gated_tuning measures)
    elif kernel == "tma" and not _tma_ok(x2, w_gate, w_up):
        kernel = choose_kernel(x2, w_gate, w_up)
    key = _launcher_key(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config)
    launch = _launchers.get(key)
    if launch is None:
        launch, keep = _new_launcher(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config, auto)
        if keep:
            if len(_launchers) >= _LAUNCHERS_MAX:
                _launchers.clear()
            _launchers[key] = launch
    if launch is _TORCH:  # measured faster than the kernel here (gated_tuning)
        return torch_forward(x, w_gate, w_up, b_gate, b_up, activation, save)
    out = _empty((*lead, N), dtype=x.dtype, device=x.device)  # not a view: in-place use stays allowed
    h = out.view(M, N)
    g = u = None
    if save:
        g = _empty((M, N), dtype=x.dtype, device=x.device)
        u = _empty((M, N), dtype=x.dtype, device=x.device)
    try:
        launch(x2, w_gate, w_up, b_gate, b_up, h, g, u)
    except LAUNCH_FAILURES as e:  # a config that does not compile or fit here: torch serves, once warned
        failed = functools.partial(_failed, activation=activation)
        if _launchers.get(key) is launch:  # (a launcher not kept, a decision deferred, stays undecided)
            _launchers[key] = failed
        warnings.warn(f"tritonmm.gated_linear: the {kernel} kernel failed ({type(e).__name__}: {e}); "
                      "torch serves this geometry", runners.KernelFailedWarning, stacklevel=3)
        failed(x2, w_gate, w_up, b_gate, b_up, h, g, u)
    return out, g, u


_TORCH = "torch"  # a launcher slot's value where the torch expression serves the geometry (gated_tuning)


def torch_forward(x, w_gate, w_up, b_gate, b_up, activation, save):
    """:func:`forward`'s (h, g, u) from the torch expression: g and u the projections (M, N) with ``save``."""
    gate, up = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    h = activations.apply(gate, activation) * up
    M, N = x.shape[:-1].numel(), w_gate.shape[0]
    return (h, gate.reshape(M, N), up.reshape(M, N)) if save else (h, None, None)


def _new_launcher(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config, auto):
    """(launcher or :data:`_TORCH`, keep). Auto calls (no kernel or config given) take the config or torch
    decision of this GPU's table or a first-sight measurement (:func:`gated_tuning.choose`); ``keep``: False
    where that measurement is due at the next eager call."""
    from ..kernels.gated_launchers import gated_launcher

    keep = True
    if auto:
        config, keep = gated_tuning.choose(kernel, x2, w_gate, b_gate is not None, activation)
        if config == _TORCH:
            return _TORCH, keep
    (M, K), N = x2.shape, w_gate.shape[0]
    bias_strides = None if b_gate is None else (b_gate.stride(0), b_up.stride(0))
    return gated_launcher(kernel, M, N, K, x2.stride(0), w_gate.stride(0), w_up.stride(0), x2.dtype, x2.device,
                          bias_strides, save, activation, config), keep


def _launcher_key(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config) -> tuple:
    """What a gated launcher is built for: kernel, sizes, strides, dtype, device, epilogue, config, the
    operands' 16-byte alignment (Triton specializes every pointer on it) and, for float32, the matmul precision
    setting (TF32 or not, fixed when it is built)."""
    (M, K), N = x2.shape, w_gate.shape[0]
    bias_strides = None if b_gate is None else (b_gate.stride(0), b_up.stride(0))
    bias_aligned = b_gate is None or b_gate.data_ptr() % 16 == 0 and b_up.data_ptr() % 16 == 0
    return (kernel, M, N, K, x2.stride(0), w_gate.stride(0), w_up.stride(0), x2.dtype, x2.device, bias_strides, save,
            activation, None if config is None else tuple(sorted(config.items())),
            x2.data_ptr() % 16 == 0 and w_gate.data_ptr() % 16 == 0 and w_up.data_ptr() % 16 == 0, bias_aligned,
            x2.dtype is _F32 and _precision())


def _failed(x2, w_gate, w_up, b_gate, b_up, h, g, u, activation):
    """The torch expression written into the kernel's outputs (a geometry whose kernel failed)."""
    gate, up = F.linear(x2, w_gate, b_gate), F.linear(x2, w_up, b_up)
    h.copy_(activations.apply(gate.float(), activation) * up.float())
    if g is not None:
        g.copy_(gate)
        u.copy_(up)


def kernel_rows(M: int, N: int, K: int, grad: bool) -> bool:
    """Whether an M x N x K gated linear (per projection) is one the gated GEMM kernel may serve: up to
    :data:`GATED_MAX_M` rows, or up to :data:`KERNEL_MAX_FLOPS_NO_GRAD` for a call without autograd (``grad``
    False)."""
    return M <= GATED_MAX_M or not grad and 2 * M * N * K <= KERNEL_MAX_FLOPS_NO_GRAD


def below_product_flops(x, w_gate, grad: bool, w_up=None, b_gate=None) -> bool:
    """More than :data:`GATED_MAX_M` rows, under :data:`PRODUCT_MIN_FLOPS` per projection for a call with autograd
    (``grad``), under :data:`PRODUCT_MIN_FLOPS_NO_GRAD` for one without, not :func:`kernel_rows` (static sizes) and
    not a call the gated GEMM on packed weights takes (:func:`gated_cublas.packed_takes`): the torch expression's
    calls."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    N = w_gate.shape[0]
    return 2 * rows * N * K < (PRODUCT_MIN_FLOPS if grad else PRODUCT_MIN_FLOPS_NO_GRAD) \
        and not kernel_rows(rows, N, K, grad) \
        and not (b_gate is None and rows > GATED_MAX_M and gated_cublas.packed_takes(x, w_gate, w_up, grad))


def torch_serves(x, w_gate, w_up=None) -> bool:
    """Whether an eager call is served by the torch expression (:data:`PRODUCT_MIN_FLOPS`,
    :data:`PRODUCT_MIN_FLOPS_NO_GRAD` where neither ``x`` nor ``w_gate`` needs a gradient, unless the gated GEMM on
    packed weights takes it), for callers that can run it more cheaply themselves (a fused module: its own
    forward; its gate has no bias where ``w_up`` is given)."""
    try:
        return below_product_flops(x, w_gate, _grad_enabled() and (x.requires_grad or w_gate.requires_grad), w_up)
    except (AttributeError, IndexError, TypeError, RuntimeError):  # invalid operands: gated_linear raises
        return False


def replay(x, wg, wu, bg, bu, activation):
    """A replay of the call just served, ``(x, wg, wu, bg, bu) -> h``, for later calls of its geometry without
    autograd (shapes, strides, dtypes, devices and alignments, which the caller's key fixes): the geometry's launcher,
    built by that call, bound; or the cuBLAS projections and the one-pass product (one GEMM and one bound launch where
    the weights are packed); None where nothing can be bound (a launcher not built or failed, an empty problem)."""
    N, K = wg.shape
    lead, M = x.shape[:-1], x.numel() // K if K else 0
    product = not kernel_rows(M, N, K, False) or M > GATED_MAX_M and bg is None \
        and gated_cublas.packed_takes(x, wg, wu, False)  # (replays serve calls without autograd)
    if product and bg is None and bu is None and wg.is_contiguous() and wu.is_contiguous():
        # (the key fixes the weights' strides) one GEMM where packed, one bound product launch
        run = gated_cublas.replay(x, wg, activation)
    elif product:
        def run(x, wg, wu, bg, bu):  # cuBLAS projections, one-pass product
            return _cublas_forward(x, wg, wu, bg, bu, activation, False)[0]
    else:
        x2 = x.reshape(-1, K)
        view = x2.data_ptr() == x.data_ptr()  # x is read in place: the launcher takes its pointer, strides bound
        contiguous = x2.stride(-1) != 1 and x2.shape[-1] != 1
        if contiguous:
            x2 = x2.contiguous()
        dtype, device, out_shape = x.dtype, x.device, (*lead, N)
        launch = _launchers.get(_launcher_key("pointer", x2, wg, wu, bg, bu, False, activation, None))
        if launch is None or isinstance(launch, functools.partial) or M == 0:  # not built, failed, or empty
            return None
        if launch is _TORCH:  # measured faster than the kernel (gated_tuning)
            run = functools.partial(reference, activation=activation)
        elif view and not contiguous:  # (the key fixes x's shape and strides, so every call's x is such a view)
            def run(x, wg, wu, bg, bu):
                h = _empty(out_shape, dtype=dtype, device=device)  # contiguous: (M, N) in memory
                launch(x, wg, wu, bg, bu, h, None, None)
                return h
        else:
            def run(x, wg, wu, bg, bu):
                x2 = x.reshape(M, K)
                if contiguous:
                    x2 = x2.contiguous()
                h = _empty(out_shape, dtype=dtype, device=device)
                launch(x2, wg, wu, bg, bu, h, None, None)
                return h
    return run


def _norm_key(key: tuple, eps: float, norm_weight: Tensor) -> tuple:
    """A folded launcher's key: the plain gated launcher's, the norm's epsilon and its weight's alignment."""
    return key, eps, norm_weight.data_ptr() % 16 == 0


def norm_forward(x: Tensor, norm_weight: Tensor, eps: float, w_gate: Tensor, w_up: Tensor, b_gate, b_up,
                 activation: str) -> Optional[Tensor]:
    """``gated_linear(norm(x), ...)`` without autograd for the RMSNorm ``norm`` (transformers' ``LlamaRMSNorm``:
    ``norm_weight``, ``eps``) as one launch of the pointer kernel with the norm in its loads, for a geometry whose
    gated linear that kernel already serves (its launcher built and decided, on up to :data:`GATED_MAX_M` rows),
    with a config of its own (autotuned on its first launch, which is never in CUDA graph capture). Operands as
    :func:`~tritonmm.ops.gated_args.kernel_shaped` takes them (the caller checks).
    None where it does not serve (not built yet, the torch expression, another path, autocast, a mode, a failed
    launch): the caller normalizes ``x`` and calls the gated linear."""
    from ..kernels.gated_launchers import gated_launcher
    from ..kernels.launch import LAUNCH_FAILURES, capturing

    tensors = (x, w_gate, w_up, b_gate, b_up, norm_weight)
    if _any_autocast() or not modes.eager() or not modes.plain(*tensors) or modes.torch_only(*tensors) \
            or _grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    K, N = x.shape[-1], w_gate.shape[0]
    M = x.numel() // K if K else 0
    if not 0 < M <= GATED_MAX_M or norm_weight.dtype != x.dtype or norm_weight.shape != (K,) \
            or norm_weight.stride(0) != 1 or norm_weight.device != x.device:
        return None
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1 and K != 1:
        return None
    w_gate, w_up = _unit_last(w_gate), _unit_last(w_up)
    key = _launcher_key("pointer", x2, w_gate, w_up, b_gate, b_up, False, activation, None)
    nkey = _norm_key(key, eps, norm_weight)
    launch = _norm_launchers.get(nkey)
    if launch is None:
        plain = _launchers.get(key)  # (its config None: not built, torch, failed, or not yet tuned)
        if getattr(plain, "state", {}).get("config") is None or capturing(x.device):  # (no compiling in capture)
            return None
        bias_strides = None if b_gate is None else (b_gate.stride(0), b_up.stride(0))
        launch = gated_launcher("pointer", M, N, K, x2.stride(0), w_gate.stride(0), w_up.stride(0), x.dtype, x.device,
                                bias_strides, False, activation, norm_eps=eps)  # (its own config: autotuned)
        if len(_norm_launchers) >= _LAUNCHERS_MAX:
            _norm_launchers.clear()
        _norm_launchers[nkey] = launch
    elif launch is _TORCH:
        return None
    out = _empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    try:
        launch(x2, w_gate, w_up, b_gate, b_up, out.view(M, N), None, None, norm_weight)
    except LAUNCH_FAILURES as e:
        _norm_launchers[nkey] = _TORCH
        warnings.warn(f"tritonmm: the gated kernel with the RMSNorm in its loads failed ({type(e).__name__}: {e}); "
                      "the norm runs as its module for this geometry", runners.KernelFailedWarning, stacklevel=3)
        return None
    return out


def norm_replay(x: Tensor, norm_weight: Tensor, eps: float, w_gate: Tensor, w_up: Tensor, b_gate, b_up,
                activation: str):
    """A replay of the :func:`norm_forward` call just served, ``(x, wg, wu, bg, bu, nw) -> h``, for later calls of
    its geometry (shapes, strides, dtypes, devices and alignments, which the caller's key fixes): its launcher bound,
    x and h read in place; None where none was built or the operands are not read in place."""
    K, N = x.shape[-1], w_gate.shape[0]
    M = x.numel() // K if K else 0
    x2 = x.reshape(M, K)
    if x2.data_ptr() != x.data_ptr() or x2.stride(-1) != 1 or w_gate.stride(-1) != 1 or w_up.stride(-1) != 1:
        return None
    key = _launcher_key("pointer", x2, w_gate, w_up, b_gate, b_up, False, activation, None)
    launch = _norm_launchers.get(_norm_key(key, eps, norm_weight))
    if launch is None or launch is _TORCH:
        return None
    shape, dtype, device = (*x.shape[:-1], N), x.dtype, x.device

    def run(x, wg, wu, bg, bu, nw):
        h = _empty(shape, dtype=dtype, device=device)  # contiguous: (M, N) in memory; x (M, K) rows at its stride
        launch(x, wg, wu, bg, bu, h, None, None, nw)
        return h
    return run


_norm_launchers: dict = {}
norm_runs: dict = {}
"""A caller's fast-path key -> :func:`norm_replay` of its geometry (kept by the caller, cleared with the launchers)."""


def clear_cache() -> None:
    """Forget the gated launchers (with the RMSNorm too) and the product kernels' launchers."""
    _launchers.clear()
    _norm_launchers.clear()
    norm_runs.clear()
    gated_cublas.clear_cache()
