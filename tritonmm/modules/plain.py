"""Which modules the fusions may look through: nn.Linear modules running torch's forward (or tritonmm's),
called as modules are called, and whether hooks are registered where a fusion would skip a call."""

from __future__ import annotations

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
