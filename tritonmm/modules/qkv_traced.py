"""A fused attention's q, k and v projections as one GEMM under ``torch.compile``: while Dynamo traces a fused
attention's forward (:mod:`tritonmm.modules.qkv`) in an inference call, the first thing traced is
``tritonmm::stacked_linear`` (:mod:`tritonmm.ops.stacked`) of the forward's input and the three weights, and each
projection's ``F.linear`` of that input with its own weight and bias returns its column slice of the op's output, as
``torch.split`` returns; the projections' ``__call__`` and ``forward`` are traced as they are. In a CUDA graph
(``mode="reduce-overhead"``) that is one launch and one weight read instead of three, as in a captured eager forward
(``benchmarks/diagnostics/static_decode_kernels.py`` times the compiled decode).

Traced this way: inference calls (gradients not recorded, autocast off) on a plain tensor of up to
:data:`tritonmm.modules.qkv.MAX_FLOPS`, where the three projections are plain nn.Linear modules without hooks or an
instance ``forward`` and with one ``in_features``, and biases on all three or none. Anything else traces the
projections as they are. On with :data:`SERVE_COMPILED`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..ops.stacked import stacked_linear
from .plain import any_hooked, linear_type

SERVE_COMPILED = False
"""Whether traced inference forwards run q, k and v as one GEMM. Off by default: not yet timed on a GPU against the
three GEMMs it replaces."""
_F_linear = F.linear


class _Slices(TorchFunctionMode):
    """For one traced attention forward: a projection's ``F.linear`` of the forward's input with the weight and bias
    the one GEMM read returns its slice of that GEMM; every other call runs as it is. (A torch function mode, which
    Dynamo traces, where setting and removing an instance ``forward`` on the projections is not traceable.)"""

    def __init__(self, x, outs, weights, biases):
        super().__init__()
        self.x, self.outs, self.weights, self.biases = x, outs, weights, biases

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_linear and len(args) >= 2 and args[0] is self.x:
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            for out, w, bias in zip(self.outs, self.weights, self.biases):
                if args[1] is w and b is bias:
                    return out
        return func(*args, **kwargs)


def _slices(attention, x, max_flops: int):
    """The :class:`_Slices` of one traced forward on ``x``, or None where the call traces the projections as they
    are."""
    if not SERVE_COMPILED or type(x) is not torch.Tensor or torch.is_grad_enabled() \
            or torch.is_autocast_enabled(x.device.type) or not x.dim():
        return None
    mods = attention._modules
    projs = mods.get("q_proj"), mods.get("k_proj"), mods.get("v_proj")
    if not all(linear_type(m) for m in projs) or any_hooked(*projs):
        return None
    params = [m._parameters for m in projs]
    ws = [p.get("weight") for p in params]
    bs = [p.get("bias") for p in params]
    if any(w is None or type(w) is not torch.nn.Parameter and type(w) is not torch.Tensor for w in ws) \
            or len({w.shape[-1] for w in ws}) != 1 or any(b is None for b in bs) and any(b is not None for b in bs):
        return None
    rows = sum(w.shape[0] for w in ws)
    if 2 * x.numel() * rows > max_flops:
        return None
    outs = stacked_linear(x, ws, [] if bs[0] is None else bs).split_with_sizes([w.shape[0] for w in ws], -1)
    return _Slices(x, outs, ws, bs)


def forward(attention, base_forward, name: str, max_flops: int, args: tuple, kwargs: dict):
    """``base_forward(attention, *args, **kwargs)`` traced with q, k and v as one GEMM on its input ``name`` where
    the call qualifies (module docstring)."""
    x = args[0] if args else kwargs.get(name)
    slices = _slices(attention, x, max_flops)
    if slices is None:
        return base_forward(attention, *args, **kwargs)
    with slices:
        return base_forward(attention, *args, **kwargs)
