"""A fused attention's q, k and v projections as one GEMM under ``torch.compile``: while Dynamo traces a fused
attention's forward (:mod:`tritonmm.modules.qkv`) in an inference call, the first projection's ``F.linear`` of the
forward's input traces ``tritonmm::stacked_linear`` (:mod:`tritonmm.ops.stacked`) of that input and the three weights,
and each projection's first ``F.linear`` of that input with its own weight and bias, until anything is written in
place, returns its column slice of the op's output, as ``torch.split`` returns (a ``.view`` that merges rows with
columns needs ``.reshape``); the projections' ``__call__`` and ``forward`` are traced as they are. In a CUDA graph
(``mode="reduce-overhead"``) that is one launch and one weight read instead of three, as in a captured eager forward
(``benchmarks/diagnostics/static_decode_kernels.py`` times the compiled decode).

Traced this way: inference calls (gradients not recorded, autocast off) on a plain tensor of up to
:data:`tritonmm.modules.qkv.MAX_FLOPS`, where the three projections are nn.Linear modules running torch's forward
without hooks or an instance ``forward`` and with one ``in_features``, and biases on all three or none. Anything
else traces the projections as they are. On with :data:`SERVE_COMPILED`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..ops.stacked import stacked_linear
from .linear import _original_forward as _torch_forward
from .plain import any_hooked, linear_type

SERVE_COMPILED = False
"""Whether traced inference forwards run q, k and v as one GEMM. Off by default: not yet timed on a GPU against the
three GEMMs it replaces."""
_F_linear = F.linear


def _in_place(func) -> bool:
    """Whether ``func`` is an in-place method or function (``mul_``, ``__setitem__``, ``__iadd__``). (Slices and
    compares, not ``str.endswith``, which Dynamo does not trace on a function's name.)"""
    name = getattr(func, "__name__", "")
    return name[-1:] == "_" and name[-2:] != "__" or name[:3] == "__i" or name == "__setitem__"


def _mutates(func, kwargs: dict) -> bool:
    """Whether a call of ``func`` may write a tensor in place: in-place, an ``out=`` or ``inplace=True``."""
    return _in_place(func) or "out" in kwargs or kwargs.get("inplace") is True


class _Slices(TorchFunctionMode):
    """For one traced attention forward on ``x``: the first projection's ``F.linear`` of ``x`` with its own weight and
    bias traces the one GEMM (reading ``x`` as it is then), and each projection's first such call returns its slice
    of it until anything is written in place; every other call runs as it is. (A torch function mode, which Dynamo
    traces, where setting and removing an instance ``forward`` on the projections is not traceable, and where
    version counters are not known.)"""

    def __init__(self, x, weights, biases):
        super().__init__()
        self.x, self.weights, self.biases = x, weights, biases
        self.outs, self.stale = None, False
        self.served = [False] * len(weights)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_linear and len(args) >= 2 and args[0] is self.x and not self.stale:
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            for i, (w, bias) in enumerate(zip(self.weights, self.biases)):
                if args[1] is w and b is bias and not self.served[i]:
                    if self.outs is None:
                        ws, bs = self.weights, self.biases
                        out = stacked_linear(self.x, ws, [] if bs[0] is None else bs)
                        self.outs = out.split_with_sizes([t.shape[0] for t in ws], -1)
                    self.served[i] = True
                    return self.outs[i]
        elif self.outs is not None and _mutates(func, kwargs):
            self.stale = True  # (x or a weight may have changed since the GEMM read them)
        return func(*args, **kwargs)


def _slices(attention, x, max_flops: int):
    """The :class:`_Slices` of one traced forward on ``x``, or None where the call traces the projections as they
    are."""
    if not SERVE_COMPILED or type(x) is not torch.Tensor or torch.is_grad_enabled() \
            or torch.is_autocast_enabled(x.device.type) or not x.dim():
        return None
    mods = attention._modules
    projs = mods.get("q_proj"), mods.get("k_proj"), mods.get("v_proj")
    if not all(type(m).forward is _torch_forward and linear_type(m) for m in projs) or any_hooked(*projs):
        return None  # (tritonmm's swapped or patched forwards call tritonmm.linear, not F.linear)
    params = [m._parameters for m in projs]
    ws = [p.get("weight") for p in params]
    bs = [p.get("bias") for p in params]
    if any(w is None or type(w) is not torch.nn.Parameter and type(w) is not torch.Tensor for w in ws) \
            or len({w.shape[-1] for w in ws}) != 1 or any(b is None for b in bs) and any(b is not None for b in bs):
        return None
    rows = sum(w.shape[0] for w in ws)
    if 2 * x.numel() * rows > max_flops:
        return None
    return _Slices(x, ws, bs)


def forward(attention, base_forward, name: str, max_flops: int, args: tuple, kwargs: dict):
    """``base_forward(attention, *args, **kwargs)`` traced with q, k and v as one GEMM on its input ``name`` where
    the call qualifies (module docstring)."""
    x = args[0] if args else kwargs.get(name)
    slices = _slices(attention, x, max_flops)
    if slices is None:
        return base_forward(attention, *args, **kwargs)
    with slices:
        return base_forward(attention, *args, **kwargs)
