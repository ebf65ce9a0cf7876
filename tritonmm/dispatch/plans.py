"""Weight plans: whether a weight, read as an (N, K) linear weight, never reaches a Triton kernel.

:mod:`tritonmm.api` serves a call on a weight whose plan is current (same storage) as ``F.linear`` /
``torch.matmul`` itself after one lookup; :mod:`tritonmm.ops.routes` makes the plans where a call resolved to
torch. A plan only ever chooses torch's own call, so a stale one costs a missed Triton route, never a wrong
result.

A plan lives as long as its weight: a weak reference's callback removes it when the weight's Python object is
freed, so no other object that comes to have the same ``id`` (an fx Proxy, say) finds it. A parameter's plan follows
its storage instead (it goes when the storage is freed or the parameter takes another one), since
``torch.utils.swap_tensors`` refuses a tensor that has a weak reference: module conversions and
``load_state_dict`` swap parameters so under ``torch.__future__.set_swap_module_params_on_conversion(True)``.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from ..core import modes
from ..core.env import raw_get, raw_name
from . import decide

_forced = decide._forced.get
_any_autocast = torch._C._is_any_autocast_enabled
_ROW_DTYPES = (torch.float16, torch.bfloat16)
_BACKEND, _KERNEL = raw_name("TRITONMM_BACKEND"), raw_name("TRITONMM_KERNEL")
_PLAIN = modes.PLAIN
_tracing_state = torch._C._get_tracing_state
_Parameter = torch.nn.Parameter

PLANS_MAX = 1 << 16
ROWS_MAX = 64
"""Input element counts kept per weight plan (:func:`torch_rows`)."""
plans: dict = {}
"""Weight plans: id(weight) -> (free, data_ptr, shape, rows, dtype); ``free`` is 2 where
:func:`decide.weight_free` holds for every GEMM of the weight, 1 where only for its forward (calls without
autograd), else 0; ``rows`` (a set where ``free`` is 0, else None): the element counts of 16-bit inputs of the
weight's dtype (``dtype``, as planned) whose forward resolved to torch itself (:func:`torch_rows`)."""
free_ptrs: dict = {}
"""id(weight) -> data_ptr of the weights whose plan is 2: the first lookup of :mod:`tritonmm.api`'s calls."""
_refs: dict = {}  # id(weight) -> a weak reference to the weight (a parameter's storage) whose callback drops its plan


def _dropped(key: int, ref) -> None:
    """The weight of ``key``'s plan was freed: forget the plan (unless a later weight's reference took its place)."""
    if _refs.get(key) is ref:
        _refs.pop(key, None)
        plans.pop(key, None)
        free_ptrs.pop(key, None)


def clear() -> None:
    """Forget every plan."""
    plans.clear()
    free_ptrs.clear()
    _refs.clear()  # (a reference freed before its weight never calls back)


def plan(weight: Tensor, N: int, K: int) -> None:
    """Record whether ``weight``, read as an (N, K) linear weight, is free of tritonmm (never reaches a
    Triton kernel or the padded path under automatic dispatch). Called where a call of the weight resolved
    to torch itself and its plan is not current (:func:`planned`); plans are made in the default state
    only (nothing forced), for plain tensors."""
    if _forced() is not None or raw_get(_BACKEND) is not None or raw_get(_KERNEL) is not None:
        return
    if type(weight) not in _PLAIN or not modes.plain(weight) or modes.torch_only(weight) \
            or _tracing_state() is not None:
        return  # (functorch's batched tensors are plain tensors without storage; a jit trace makes none)
    if len(plans) >= PLANS_MAX:
        clear()
    dtype, device = weight.dtype, weight.device
    free = 2 if decide.weight_free(N, K, dtype, device) else int(decide.weight_free(N, K, dtype, device, False))
    ptr, key = weight.data_ptr(), id(weight)
    followed = weight.untyped_storage() if type(weight) is _Parameter else weight  # (module docstring)
    ref = _refs.get(key)
    if ref is None or ref() is not followed:
        _refs[key] = weakref.ref(followed, functools.partial(_dropped, key))
    plans[key] = (free, ptr, weight.shape, None if free else set(), dtype)
    if free == 2:
        free_ptrs[key] = ptr
    else:
        free_ptrs.pop(key, None)


def planned(weight: Tensor) -> bool:
    """Whether ``weight`` has a current plan (free or not): :func:`plan` would return at once."""
    current = plans.get(id(weight))
    try:
        return current is not None and current[1] == weight.data_ptr() and current[2] == weight.shape
    except RuntimeError:  # no storage (functorch's batched tensors): plan() decides
        return False


def torch_rows(weight: Tensor, input: Tensor, activation: str) -> None:
    """Record in ``weight``'s current plan, where some GEMM of the weight may reach Triton (``free`` 0), that
    the forward of a call on ``input`` resolved to torch itself: :mod:`tritonmm.ops.routes` decides a linear forward
    by the input's element count, dtype and device for a given weight (and the state :mod:`tritonmm.api` checks
    before reading the plan), so later calls without autograd or autocast on a 16-bit input of the weight's
    dtype with as many elements and no activation, the weight's shape and dtype as planned, are served as
    ``F.linear`` after the plan's lookup (a weight with some GEMMs on Triton, such as a large vocabulary head,
    in decode: ``benchmarks/diagnostics/h200_plan_rows.json``). Called where such a call resolved to torch."""
    current = plans.get(id(weight))
    if current is None or current[0] or activation != "none":
        return
    sizes, n = current[3], input.numel()
    if n in sizes or len(sizes) >= ROWS_MAX or _any_autocast() or _forced() is not None \
            or raw_get(_BACKEND) is not None or raw_get(_KERNEL) is not None:
        return  # (forced decisions are not the dispatcher's)
    dtype = input.dtype
    if dtype is current[4] and dtype is weight.dtype and dtype in _ROW_DTYPES and type(input) in _PLAIN \
            and current[2] == weight.shape and input.device == weight.device:
        sizes.add(n)
