"""The GEMM geometries a model runs, recorded from one forward (and backward) pass, to tune them ahead of time.

:func:`geometries` runs the model once under a ``TorchDispatchMode`` and records every 2-D GEMM it
sees (``aten.mm``, ``aten.addmm`` and tritonmm's own ops, so swapped, patched and plain models
record alike) as the shape-suite rows that ``python -m tritonmm.tune`` measures: M, N, K, dtype and
the operand layout ("nn": B row-major, "nt": B an ``nn.Linear`` weight read transposed); and the gated
linears of fused MLPs (``tritonmm::gated_linear``), which :func:`tritonmm.tune_model` measures as
first-sight tuning would (:mod:`tritonmm.dispatch.gated_tuning`). GEMMs
whose A is transposed (the weight gradient ``grad_out.T @ x``) are counted but not listed: the tuner
measures row-major A only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.layout import is_col_major

_aten = torch.ops.aten
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _b_layout(b: torch.Tensor) -> str:
    return "nt" if is_col_major(b) and b.shape[1] != 1 else "nn"


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows: dict = {}
        self.gated: dict = {}
        self.skipped = 0

    def _add(self, a: torch.Tensor, b: torch.Tensor, layout: str | None = None) -> None:
        """Record ``a @ b`` for a 2-D ``b`` (A's leading dims fold into M)."""
        if b.dim() != 2 or a.dim() < 1 or a.dtype not in _DTYPES or a.dtype != b.dtype:
            return
        K, N = b.shape
        M = math.prod(a.shape[:-1])
        if 0 in (M, N, K):
            return
        if a.dim() == 2 and a.stride(0) == 1 and a.shape[0] != 1 and a.stride(1) != 1:  # A transposed
            self.skipped += 1
            return
        layout = layout or _b_layout(b)
        key = (str(a.dtype).removeprefix("torch."), M, N, K, layout)
        self.rows[key] = self.rows.get(key, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is _aten.mm:
            self._add(args[0], args[1])
        elif packet is _aten.addmm:
            self._add(args[1], args[2])
        elif packet is torch.ops.tritonmm.linear:
            x, w = args[0], args[1]
            if w.dim() == 2 and x.dim() >= 1:
                self._add(x, w.t(), "nt")
        elif packet is torch.ops.tritonmm.matmul:
            self._add(args[0], args[1])
        elif packet is torch.ops.tritonmm.gated_linear:
            self._add_gated(*args[:6])
        return func(*args, **kwargs)

    def _add_gated(self, x, w_gate, w_up, b_gate, b_up, activation) -> None:
        """Record a gated linear (:func:`tritonmm.gated_linear`): its M, N, K, dtype, activation and biases."""
        if w_gate.dim() != 2 or x.dim() < 1 or x.dtype not in _DTYPES:
            return
        M, (N, K) = math.prod(x.shape[:-1]), w_gate.shape
        if 0 not in (M, N, K):
            key = (str(x.dtype).removeprefix("torch."), M, N, K, activation, b_gate is not None)
            self.gated[key] = self.gated.get(key, 0) + 1


def _scalar_output(out):
    """What the backward starts from: ``out.loss`` where the model returns one, else its first floating
    tensor that requires grad (summed)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    stack = [out]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if item.requires_grad and item.is_floating_point():
                return item.float().sum()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def _tensors(item) -> list:
    """The tensors in ``item``, looking into tuples, lists and mappings (a model's example inputs)."""
    found, stack = [], [item]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _buffers(model) -> list:
    """(module, name, buffer, copy of its value) for each buffer of ``model`` (none where it is not a module)."""
    if not isinstance(model, torch.nn.Module):
        return []
    with torch.no_grad():
        return [(m, name, b, b.clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None]


def _cuda_devices(model) -> list:
    """The CUDA devices whose random state the pass may change: the current one and those of the model's tensors
    (none before CUDA is initialized)."""
    if not torch.cuda.is_initialized():
        return []
    tensors = [*model.parameters(), *model.buffers()] if isinstance(model, torch.nn.Module) else []
    return sorted({torch.cuda.current_device(), *(t.device.index for t in tensors if t.is_cuda)})


def _restore(saved: list) -> None:
    """Put back each buffer :func:`_buffers` saved: the same tensor object, holding its saved value."""
    with torch.no_grad():
        for module, name, buffer, value in saved:
            module._buffers[name] = buffer
            if buffer.is_inference():
                with torch.inference_mode():
                    buffer.copy_(value)
            else:
                buffer.copy_(value)


def geometries(model, *args, **kwargs) -> dict:
    """The GEMM geometries of ``model(*args, **kwargs)``, forward and (where the output requires grad)
    backward, as a shape suite for ``python -m tritonmm.tune --shapes`` (``json.dump`` it to save it).

    The forward runs in the model's current mode (``train()`` or ``eval()``); the model's buffers (BatchNorm's
    running statistics, say) and torch's random number generators (the CPU's, the current GPU's and those of the
    model's GPUs) are as they were afterwards.
    The backward runs through ``torch.autograd.grad`` into the parameters and the example inputs that require
    grad (also inside tuples, lists and dicts), as ``loss.backward()`` would, but writes no ``.grad``.

    Returns:
        dict: ``{"shapes": [{"tag", "M", "N", "K", "dtype", "layout", "calls"}...], "skipped_transposed_a": n,
        "gated": [{"M", "N", "K", "dtype", "activation", "bias", "calls"}...]}`` (the gated linears of fused MLPs).
    """
    rec = _Recorder()
    saved = _buffers(model)
    try:
        with torch.random.fork_rng(devices=_cuda_devices(model)), rec:
            out = model(*args, **kwargs)
            scalar = _scalar_output(out) if torch.is_grad_enabled() else None
            if scalar is not None:
                params = [p for p in (model.parameters() if hasattr(model, "parameters") else ()) if p.requires_grad]
                leaves = [t for t in dict.fromkeys(_tensors((args, kwargs)))  # example inputs that want a gradient
                          if t.requires_grad and t.is_leaf]
                if params or leaves:
                    torch.autograd.grad(scalar, params + leaves, allow_unused=True)
    finally:
        _restore(saved)
    shapes = [{"tag": "model", "M": M, "N": N, "K": K, "dtype": dtype, "layout": layout, "calls": calls}
              for (dtype, M, N, K, layout), calls in rec.rows.items()]
    gated = [{"M": M, "N": N, "K": K, "dtype": dtype, "activation": act, "bias": bias, "calls": calls}
             for (dtype, M, N, K, act, bias), calls in rec.gated.items()]
    return {"shapes": shapes, "skipped_transposed_a": rec.skipped, "gated": gated}
