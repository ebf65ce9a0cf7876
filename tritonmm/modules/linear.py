"""nn.Linear integration: a TritonLinear module, global patching that can be undone, and in-place swapping.

``swap_linear`` changes the class of matching modules in place (to a subclass of their own
class whose forward calls :func:`tritonmm.linear`), so parameters stay the same objects
(weight tying survives), ``state_dict`` keys and values, hooks, device, dtype,
``requires_grad`` and the meta device are untouched, and ``isinstance(m, nn.Linear)``
still holds. ``unswap_linear`` restores the original class. No weight is copied.

A swapped module whose weight has a plan sending every GEMM to torch (:mod:`tritonmm.api`) is
*settled* on its next call: its class becomes a subclass of the swapped one whose forward is
nn.Linear's own, so its calls cost nothing over ``nn.Linear``. It goes back to the swapped class when
its weights move or are replaced through the module (``.to()``, ``.cuda()``, ``.half()``, assigning
``weight`` or ``bias``), on :func:`tritonmm.force_backend` and on :func:`tritonmm.clear_cache`. Modules
settle in eager calls only: not while torch.compile or jit traces them, not while any thread is inside
``force_backend``, not when a parametrization has changed their class since the swap. A module's class
is part of torch.compile's guards, so a compiled model whose layers then settle in eager calls
recompiles once. A weight changed in place (``weight.data = ...``) keeps a settled module on nn.Linear's
forward: its result is right, a Triton route it might now take is missed until ``clear_cache``.
Under :func:`patch_linear` a module whose class inherits nn.Linear's forward settles the same way, into
a subclass of its own class (pickled and copied as its own class); :func:`unpatch_linear` gives every
such module its class back. :func:`settled_class` and :func:`settle` serve fused Sequentials
(:mod:`tritonmm.modules.fusion`) the same way.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from .. import api as _api
from ..api import (_BACKEND, _KERNEL, _PLAIN, _F_linear, _any_autocast, _dynamo_compiling, _forced,  # the fast
                   _grad_enabled, _plans_get, _tracing_state, linear)  # path's bound callables
from ..core.activations import check as check_activation
from ..core.env import raw_env
from ..dispatch import decide


class TritonLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`tritonmm.linear`, with an optional fused activation.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        activation (str): "none", "relu", "gelu", "gelu_tanh" or "silu", fused into the GEMM epilogue.

    Shapes: input (*, in_features) -> output (*, out_features), as nn.Linear.

    Raises:
        ValueError: unknown activation.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, activation="none"):
        check_activation(activation, "TritonLinear")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


_original_forward = nn.Linear.forward
_swap_classes: dict[type, type] = {}
_settled_classes: dict[type, type] = {}
_settled: weakref.WeakSet = weakref.WeakSet()
_never_settle: weakref.WeakSet = weakref.WeakSet()  # patched classes :func:`_patched_settled_class` refused
_settled_lock = threading.Lock()


def settle(module) -> None:
    """Give ``module`` its settled class (:func:`settled_class`): not for classes made after the swap or the
    fusion (parametrizations), under jit tracing (a trace and its check run must agree) or while any
    thread forces a backend. A patched module (its class inherits the patched forward) settles into a
    subclass of its own class while :func:`patch_linear` is in effect."""
    cls = type(module)
    settled = _settled_classes.get(cls)
    if settled is None and cls.forward is _patched_forward and cls not in _never_settle:
        settled = _patched_settled_class(module)
    if settled is None or _tracing_state() is not None or decide.forcing_blocks():
        return
    with _settled_lock:
        if "_tritonmm_patched" in settled.__dict__ and nn.Linear.forward is not _patched_forward:
            return  # unpatched meanwhile
        object.__setattr__(module, "__class__", settled)  # (not through a subclass's __setattr__)
        _settled.add(module)


def _settled_reduce_ex(self, protocol):
    # pickle / torch.save / deepcopy of a patched, settled module: it goes back to its own class (it settles
    # again on its next call) and is pickled as that class pickles its instances, without tritonmm
    _unsettle(self)
    return type(self).__reduce_ex__(self, protocol)


def subclassable(cls: type) -> bool:
    """Whether tritonmm may make a subclass of ``cls`` (swapped, fused and settled classes): not where a class of
    its MRO defines an ``__init_subclass__`` of its own (it may need arguments, or register subclasses)."""
    return not any("__init_subclass__" in c.__dict__ for c in cls.__mro__[:-1])


def _patched_settled_class(module) -> Optional[type]:
    """The settled class of a patched module's class, made on first use; None for lazy and parametrized
    modules (they change their own class) and for classes that are not :func:`subclassable`."""
    cls = type(module)
    if isinstance(module, LazyModuleMixin) or parametrize.is_parametrized(module) or not subclassable(cls):
        _never_settle.add(cls)  # (each a fact of the class: lazy and parametrized modules change their class)
        return None
    with _settled_lock:
        settled = _settled_classes.get(cls)
        if settled is None:
            settled = settled_class(cls, _settled_forward, lambda name, value: name in ("weight", "bias"),
                                    {"_tritonmm_patched": True, "__reduce_ex__": _settled_reduce_ex})
    return settled


def settled_class(unsettled: type, forward, unsettles: Callable[[str, object], bool],
                  attrs: Optional[dict] = None) -> type:
    """The settled subclass of ``unsettled`` (a swapped or fused class), whose forward is ``forward``: its
    instances go back to ``unsettled`` when their tensors move (``_apply``: ``.to()``, ``.cuda()``,
    ``.half()``), when ``unsettles(name, value)`` says so for an attribute assigned, and on
    :func:`decide.state_changed`. The class's own ``_apply`` and ``__setattr__`` run as well."""
    marks = {k: v for k, v in unsettled.__dict__.items() if k.startswith("_tritonmm_")}  # e.g. the base class
    settled = _settled_classes[unsettled] = type(
        unsettled.__name__, (unsettled,),
        {**marks, **(attrs or {}), "forward": forward, "_tritonmm_unsettled": unsettled,
         "__module__": unsettled.__module__, "__qualname__": unsettled.__qualname__})

    def _apply(self, fn, *args, **kwargs):
        out = super(settled, self)._apply(fn, *args, **kwargs)
        _unsettle(self)  # the weights may have a new dtype or device
        return out

    def __setattr__(self, name, value):
        if type(self) is settled and (unsettles(name, value) or name == "__class__" and _derived(value, settled)):
            _unsettle(self)
            if name == "__class__":  # a class made on the settled one (a parametrization): made on the unsettled
                value = _rebased(value, unsettled)
            return type(self).__setattr__(self, name, value)  # the unsettled class's (a subclass's own)
        super(settled, self).__setattr__(name, value)

    def __init__(self, *args, **kwargs):  # a settled class called (Sequential slicing builds type(self)(...))
        super(settled, self).__init__(*args, **kwargs)
        object.__setattr__(self, "__class__", unsettled)  # makes an unsettled module

    settled._apply, settled.__setattr__, settled.__init__ = _apply, __setattr__, __init__
    return settled


def _derived(cls, settled: type) -> bool:
    """Whether ``cls`` is a class made directly on the settled class ``settled``."""
    return isinstance(cls, type) and cls.__bases__ == (settled,)


def _rebased(cls: type, unsettled: type, renamed: tuple = ("", "")) -> type:
    """``cls`` (made on a settled class) made again on ``unsettled``, with the same namespace (and name, but for
    ``renamed``: (old, new) part of it)."""
    namespace = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    name, qualname = (n.replace(*renamed) for n in (cls.__name__, cls.__qualname__))
    return type(cls)(name, (unsettled,), {**namespace, "__qualname__": qualname})


def _swapped_forward(self, input):
    """nn.Linear.forward through tritonmm: the weight plan checked inline as :func:`tritonmm.linear` checks
    it; a module whose weight has a plan sending every GEMM to torch is settled (module docstring)."""
    weight, bias = self.weight, self.bias
    if not _dynamo_compiling():
        plan = _plans_get(id(weight))
        if plan is not None and (plan[0] or type(input) in _PLAIN) and _forced() is None \
                and _BACKEND not in raw_env and _KERNEL not in raw_env:
            try:
                if plan[1] == weight.data_ptr():
                    if plan[0] == 2:
                        settle(self)
                        return _F_linear(input, weight, bias)
                    if not (_grad_enabled() and (input.requires_grad or weight.requires_grad
                                                 or bias is not None and bias.requires_grad)) and (
                            plan[0] or input.numel() in plan[3] and input.dtype is plan[4] and not _any_autocast()
                            and plan[2] == weight.shape):  # (the forward resolved to torch at this input's size)
                        return _F_linear(input, weight, bias)
            except (AttributeError, RuntimeError):  # not a tensor, no storage
                pass
    return _api.linear(input, weight, bias)


def _settled_forward(self, input):
    """A settled module's forward: nn.Linear's (defined here so that torch.compile traces it as it
    traces the swapped forward)."""
    return _F_linear(input, self.weight, self.bias)


def _unsettle(module) -> None:
    with _settled_lock:
        cls = type(module).__dict__.get("_tritonmm_unsettled")
        if cls is not None:
            object.__setattr__(module, "__class__", cls)
        _settled.discard(module)


def _unsettle_all(patched_only: bool = False) -> None:
    """Every settled module back to its swapped or patched class (tritonmm's state changed), or only the
    patched ones (:func:`unpatch_linear`)."""
    with _settled_lock:
        modules = [m for m in _settled if not patched_only or "_tritonmm_patched" in type(m).__dict__]
    for module in modules:
        _unsettle(module)


decide.STATE_HOOKS.append(_unsettle_all)


def _new_swapped(base: type) -> nn.Module:
    """Unpickling helper of earlier releases: an uninitialised instance of the swapped class of ``base``."""
    return object.__new__(_swapped_class(base))


def reduce_as_base(module, protocol: int, mark: str, rebuild) -> tuple | str:
    """``module``'s reduction (pickle, ``copy``, ``torch.save``) as its class before tritonmm's (``type(module)``'s
    ``mark`` attribute) reduces its instances, through that class's own ``__reduce_ex__`` or ``__reduce__`` if it
    has one: tritonmm's classes in its callable and arguments replaced by that class, and the callable wrapped as
    ``rebuild(base, callable, args)``, which gives the object tritonmm's class again (the generated classes need not
    be importable). State and items follow as the class's reduction gives them."""
    base = next(c.__dict__[mark] for c in type(module).__mro__ if mark in c.__dict__)  # (a parametrization's class)
    reduced = base.__reduce_ex__(module, protocol)
    if not isinstance(reduced, tuple):  # the name of a global: pickled by reference, as the class pickles it
        return reduced

    def own(c):
        return c.__dict__[mark] if isinstance(c, type) and mark in c.__dict__ else c

    args = tuple(own(a) for a in reduced[1]) if isinstance(reduced[1], tuple) else reduced[1]
    return (rebuild, (base, own(reduced[0]), args), *reduced[2:])


def _rebuilt_swapped(base: type, fn, args) -> nn.Module:
    """Unpickling helper: ``fn(*args)`` (its class's reduction), given the swapped class of ``base``."""
    module = fn(*args)
    if type(module) is base:
        object.__setattr__(module, "__class__", _swapped_class(base))
    return module


def _swapped_reduce_ex(self, protocol):
    return reduce_as_base(self, protocol, "_tritonmm_base", _rebuilt_swapped)


def _swapped_class(cls: type) -> type:
    """A subclass of ``cls`` (an nn.Linear subclass) whose forward runs through tritonmm, and its settled
    subclass, whose forward is nn.Linear's own."""
    if cls not in _swap_classes:
        swapped = type(
            f"TritonSwapped{cls.__name__}", (cls,),
            {"forward": _swapped_forward, "_tritonmm_base": cls, "__module__": __name__,
             "__reduce_ex__": _swapped_reduce_ex},
        )
        settled_class(swapped, _settled_forward, lambda name, value: name in ("weight", "bias"))
        _swap_classes[cls] = swapped
    return _swap_classes[cls]


def require_module(model, fn: str) -> None:
    """Raise TypeError unless ``model``, the argument of ``tritonmm.<fn>``, is an nn.Module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tritonmm.{fn}(): argument 'model' must be an nn.Module, not {type(model).__name__}")


def _runs_linear_forward(module: nn.Module) -> bool:
    # a subclass with a forward of its own is left alone: replacing it would change what it computes
    return type(module).forward in (nn.Linear.forward, _original_forward, _patched_forward) \
        or "_tritonmm_patched" in type(module).__dict__


def swap_linear(model: nn.Module, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Route matching ``nn.Linear`` modules of ``model`` (the root included) through tritonmm, in place.

    In the style of torchao's ``quantize_(model, config, filter_fn)``.

    Args:
        model: any module tree.
        filter_fn: ``(module, fully_qualified_name) -> bool``, asked for each nn.Linear that uses
            nn.Linear's own forward (subclasses with a forward of their own are never swapped, nor
            are lazy or parametrized modules, which change their own class, nor classes with an
            ``__init_subclass__`` of their own); default: all of them.

    Swapped models pickle (``torch.save(model)``) and deep-copy as swapped models; a class's own ``__reduce__`` or
    ``__reduce_ex__`` still makes the copy.

    Returns:
        The same ``model`` object.

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    require_module(model, "swap_linear")
    for fqn, module in model.named_modules():
        if "_tritonmm_patched" in type(module).__dict__:
            _unsettle(module)  # a patched, settled module: swapped from its own class
        cls = type(module)
        if not isinstance(module, nn.Linear) or isinstance(module, TritonLinear) or "_tritonmm_base" in cls.__dict__:
            continue
        if isinstance(module, LazyModuleMixin) or parametrize.is_parametrized(module) or not subclassable(cls):
            continue  # these replace their own class (on first call / on removal): a swap would be lost or break;
            # (or their class's __init_subclass__ may need arguments or register the swapped class)
        if _runs_linear_forward(module) and (filter_fn is None or filter_fn(module, fqn)):
            module.__class__ = _swapped_class(cls)
    return model


def unswap_linear(model: nn.Module) -> nn.Module:
    """Undo :func:`swap_linear`: every swapped module gets its original class back, in place (a module parametrized
    since, whose class torch's parametrizations made on the swapped one, a class made the same way on the original).

    Returns:
        The same ``model`` object.

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    require_module(model, "unswap_linear")
    for module in model.modules():
        cls = type(module)
        base = cls.__dict__.get("_tritonmm_base")
        if base is not None:
            module.__class__ = base
            _settled.discard(module)
        elif parametrize.is_parametrized(module) and len(cls.__bases__) == 1 \
                and "_tritonmm_base" in cls.__bases__[0].__dict__:
            swapped = cls.__bases__[0]
            base = swapped.__dict__["_tritonmm_base"]
            module.__class__ = _rebased(cls, base, (swapped.__name__, base.__name__))
    return model


_patch_lock = threading.Lock()
_forward_before_patch = None  # what nn.Linear.forward was when patch_linear() took over


def _patched_forward(self, input):
    """``nn.Linear.forward`` while :func:`patch_linear` is in effect: a swapped module's forward, so a
    patched module whose weight every GEMM sends to torch settles, into a subclass of its own class whose
    forward is nn.Linear's (:func:`unpatch_linear` gives it its class back)."""
    return _swapped_forward(self, input)


class _Patch:
    """Returned by :func:`patch_linear`; as a context manager it restores the state found on entry."""

    def __init__(self, was_patched: bool):
        self._was_patched = was_patched

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._was_patched:
            unpatch_linear()
        return False


def patch_linear() -> _Patch:
    """Make every ``nn.Linear`` forward (and subclasses that inherit it) run through :func:`tritonmm.linear`.

    Usable as a plain call (undo with :func:`unpatch_linear`) or as ``with tritonmm.patch_linear():``,
    which restores the previous state on exit. Nothing is copied. A module whose weight the dispatcher
    sends to cuBLAS in every GEMM settles on its next call, as a swapped one does (:mod:`tritonmm.modules.linear`):
    while patched, its class is a subclass of its own class (``isinstance`` holds; pickling and
    ``deepcopy`` give its own class) running nn.Linear's forward at no cost per call. So code that matches
    classes exactly (``type(m) is nn.Linear``, e.g. ``torch.ao.quantization.quantize_dynamic``) sees such
    modules as nn.Linear after :func:`unpatch_linear`, and a ``forward`` assigned later to ``nn.Linear`` or
    to the module's class reaches them after ``unpatch_linear``, ``force_backend`` or ``clear_cache``.
    Classes with an ``__init_subclass__`` of their own, lazy and parametrized modules do not settle.
    """
    global _forward_before_patch
    with _patch_lock:
        was = nn.Linear.forward is _patched_forward
        if not was:
            _forward_before_patch = nn.Linear.forward  # another library's patch, if any, comes back on unpatch
            nn.Linear.forward = _patched_forward
    return _Patch(was)


def unpatch_linear() -> None:
    """Restore the ``nn.Linear.forward`` that :func:`patch_linear` replaced (a no-op when not patched)."""
    global _forward_before_patch
    with _patch_lock:
        if nn.Linear.forward is _patched_forward:
            nn.Linear.forward = _forward_before_patch or _original_forward
            _forward_before_patch = None
    _unsettle_all(patched_only=True)


def is_linear_patched() -> bool:
    """Whether :func:`patch_linear` is in effect."""
    return nn.Linear.forward is _patched_forward
