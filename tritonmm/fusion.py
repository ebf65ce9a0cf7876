"""``fuse`` / ``unfuse``: gated MLPs (Llama, Mistral, Qwen2, Gemma) run gate and up as one GEMM.

An MLP module qualifies when its forward is transformers' Llama-family forward,
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (compared as bytecode, so copies of it in other
model files and user classes written the same way qualify), its three projections are nn.Linear
modules running nn.Linear's forward (or tritonmm's swapped one), and ``act_fn`` is a known
activation (SiLU, GELU, tanh-GELU, ReLU; torch's or transformers' modules). Like
:func:`tritonmm.swap_linear`, ``fuse`` changes the module's class in place to a subclass, so
parameters, ``state_dict``, hooks, tied weights and ``isinstance`` are untouched. At call time the
fused forward runs :func:`tritonmm.gated_linear` on the gate and up weights where they are, then
``down_proj`` as a module, for calls of up to :data:`tritonmm.gated.GATED_MAX_M` rows (decode);
larger calls, and calls where a forward or backward hook is registered on ``gate_proj``, ``up_proj``
or ``act_fn`` (or globally), an instance's ``forward`` is replaced (accelerate's hooks do that) or a
projection is no longer such a Linear, run the recognised forward itself.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Proxy as _Proxy
from torch.nn.modules import module as _module

from .gated import GATED_MAX_M, gated_linear
from .nn import _runs_linear_forward


def _llama_mlp_forward(self, x):  # transformers' LlamaMLP.forward, verbatim: the form fuse recognizes
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _llama_mlp_forward_return(self, x):  # the same without the local variable
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _code_form(fn) -> tuple | None:
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_code, code.co_names, code.co_consts[1:], code.co_argcount)


_FORMS = {_code_form(_llama_mlp_forward), _code_form(_llama_mlp_forward_return)}


_SIMPLE = {nn.SiLU: "silu", nn.ReLU: "relu"}


def activation_name(act) -> Optional[str]:
    """The epilogue name of an activation module, or None when the gated kernel cannot apply it."""
    t = type(act)
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


def _plain_linear(m) -> bool:
    return isinstance(m, nn.Linear) and _runs_linear_forward(m) or "_tritonmm_base" in type(m).__dict__


def fusable(module: nn.Module) -> bool:
    """Whether :func:`fuse` would fuse ``module`` (see the module docstring)."""
    if _code_form(type(module).forward) not in _FORMS or "_tritonmm_fused_base" in type(module).__dict__:
        return False
    gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not all(_plain_linear(m) for m in (gate, up, down)):
        return False
    return gate.weight.shape == up.weight.shape and (gate.bias is None) == (up.bias is None) \
        and activation_name(getattr(module, "act_fn", None)) is not None


_is_compiling = torch.compiler.is_compiling
_linear_types: dict = {}  # type -> whether its instances run nn.Linear's forward (or tritonmm's swapped one)


def _hooked(m) -> bool:
    """Forward or backward hooks, or a forward set on the instance (as accelerate's hooks do)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or "forward" in m.__dict__)


def _fused_forward(self, x):
    if _is_compiling():
        small = True  # gated_linear decides at trace time
    else:
        try:
            small = type(x) is not _Proxy and x.numel() <= GATED_MAX_M * x.shape[-1]
        except (AttributeError, IndexError, TypeError, RuntimeError):
            small = False
    gate, up, act = self.gate_proj, self.up_proj, self.act_fn
    if small:  # larger calls: the module's own forward (cuBLAS)
        name = activation_name(act)
        gt, ut = type(gate), type(up)
        if gt not in _linear_types:
            _linear_types[gt] = _plain_linear(gate)
        if ut not in _linear_types:
            _linear_types[ut] = _plain_linear(up)
        if name is not None and _linear_types[gt] and _linear_types[ut] and not (
                _hooked(gate) or _hooked(up) or _hooked(act) or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks):
            return self.down_proj(gated_linear(x, gate.weight, up.weight, gate.bias, up.bias, name))
    return self.down_proj(act(gate(x)) * up(x))  # the recognised forward, written out


_fused_classes: dict[type, type] = {}


def _new_fused(base: type) -> nn.Module:
    """Unpickling helper: an uninitialised instance of the fused class of ``base`` (state follows)."""
    return object.__new__(_fused_class(base))


def _fused_reduce_ex(self, protocol):
    reduced = nn.Module.__reduce_ex__(self, protocol)
    return (_new_fused, (type(self).__dict__["_tritonmm_fused_base"],), *reduced[2:])


def _fused_class(cls: type) -> type:
    if cls not in _fused_classes:
        _fused_classes[cls] = type(f"TritonFused{cls.__name__}", (cls,),
                                   {"forward": _fused_forward, "_tritonmm_fused_base": cls, "__module__": __name__,
                                    "__reduce_ex__": _fused_reduce_ex})
    return _fused_classes[cls]


def fuse(model: nn.Module, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Run the gate and up projections of every gated MLP in ``model`` as one GEMM, in place.

    Args:
        model: any module tree (the root included).
        filter_fn: ``(module, fully_qualified_name) -> bool``, asked for each MLP that qualifies
            (:func:`fusable`); default: all of them.

    The projections stay nn.Linear modules: :func:`tritonmm.swap_linear` may route ``down_proj``
    (and unfused layers) through tritonmm as well. Fused models pickle and deep-copy as fused models.

    Returns:
        The same ``model`` object.
    """
    for fqn, module in model.named_modules():
        if fusable(module) and (filter_fn is None or filter_fn(module, fqn)):
            module.__class__ = _fused_class(type(module))
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse`: every fused module gets its original class back, in place.

    Returns:
        The same ``model`` object.
    """
    for module in model.modules():
        base = type(module).__dict__.get("_tritonmm_fused_base")
        if base is not None:
            module.__class__ = base
    return model
