"""Which modules the fusions may look through: nn.Linear modules running torch's forward (or tritonmm's),
called as modules are called, activation modules the kernels' epilogues apply, and whether hooks are registered
where a fusion would skip a call."""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from .linear import _original_forward, _patched_forward

MODULE_CALL = nn.Module.__call__
MISSING = object()


def plain_linear(m) -> bool:
    """An nn.Linear running torch's forward (as torch defines it, or tritonmm's patched or swapped one),
    called as modules are called."""
    t = type(m)
    if not isinstance(m, nn.Linear) or t.__call__ is not MODULE_CALL or t._call_impl is not nn.Module._call_impl:
        return False
    return t.forward in (_original_forward, _patched_forward) or "_tritonmm_base" in t.__dict__ \
        or "_tritonmm_patched" in t.__dict__


_linear_types: dict = {}  # type -> (whether plain_linear holds for its instances, the type's forward then)


def linear_type(m) -> bool:
    """:func:`plain_linear`, remembered by type (again where the type's forward has changed since)."""
    t = type(m)
    hit = _linear_types.get(t)
    forward = t.forward
    if hit is None or hit[1] is not forward:
        if len(_linear_types) >= 1024:  # (parametrizations make a class per module)
            _linear_types.clear()
        hit = _linear_types[t] = (plain_linear(m), forward)
    return hit[0]


def any_hooked(*modules) -> bool:
    """Forward or backward hooks on any of ``modules`` or globally, or a forward set on an instance (as
    accelerate's hooks do)."""
    for m in modules:
        d = m.__dict__
        if d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"] \
                or "forward" in d:
            return True
    return global_hooks()


def hooks_on(m) -> bool:
    """Forward or backward hooks on ``m`` itself (global hooks and an instance ``forward`` aside)."""
    d = m.__dict__
    return bool(d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"])


class Stale:
    """What a module's temporary instance ``forward`` (a folding layer's :class:`~.norm_fold.Pending`, a fused
    attention's projection server) copies and pickles as: the module's class forward, which removes itself from
    the module on its first call."""

    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        if self.module.__dict__.get("forward") is self:
            del self.module.__dict__["forward"]
        return type(self.module).forward(self.module, *args, **kwargs)


def global_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks)


def param(m, name, default=MISSING):
    """``m.<name>`` read from ``_parameters`` directly (nn.Module.__getattr__ where it is not there);
    ``default`` where ``m`` has no such attribute, if given."""
    p = m._parameters.get(name, MISSING)
    if p is not MISSING:
        return p
    return getattr(m, name) if default is MISSING else getattr(m, name, default)


def code_form(fn) -> Optional[tuple]:
    """What two functions written alike share: bytecode, names, constants (the docstring aside), argument count."""
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_code, code.co_names, code.co_consts[1:], code.co_argcount)


_SIMPLE = {nn.SiLU: "silu", nn.ReLU: "relu"}
_FORWARDS = {t: t.forward for t in (nn.SiLU, nn.ReLU, nn.GELU)}  # an activation's forward when first seen


def _activation_kind(act, t) -> Optional[str]:
    simple = _SIMPLE.get(t)
    if simple is not None:
        return simple
    if t is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    if t.__module__ == "transformers.activations":
        inner = getattr(act, "act", None)
        if t.__name__ == "SiLUActivation":
            _SIMPLE[t] = "silu"  # stateless: remembered by type
            return "silu"
        if t.__name__ == "GELUActivation" and inner is F.gelu:
            return "gelu"
        if t.__name__ in ("GELUTanh", "PytorchGELUTanh") and getattr(inner, "func", None) is F.gelu \
                and getattr(inner, "keywords", None) == {"approximate": "tanh"}:
            return "gelu_tanh"
    return None


def activation_name(act) -> Optional[str]:
    """The epilogue name of an activation module, or None when the fused kernels cannot apply it (an
    unknown module, or a known class whose ``forward`` or ``__call__`` was replaced since first seen)."""
    t = type(act)
    name = _activation_kind(act, t)
    if name is None or t.forward is not _FORWARDS.setdefault(t, t.forward) or t.__call__ is not MODULE_CALL:
        return None
    return name
