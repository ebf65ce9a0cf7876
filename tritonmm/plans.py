"""Weight plans: whether a weight, read as an (N, K) linear weight, never reaches a Triton kernel.

:mod:`tritonmm.api` serves a call on a weight whose plan is current (same storage) as ``F.linear`` /
``torch.matmul`` itself after one lookup; :mod:`tritonmm.routes` makes the plans where a call resolved to
torch. A plan only ever chooses torch's own call, so a stale one costs a missed Triton route, never a wrong
result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch, modes
from ._env import raw_get, raw_name

_forced = dispatch._forced.get
_BACKEND, _KERNEL = raw_name("TRITONMM_BACKEND"), raw_name("TRITONMM_KERNEL")
_PLAIN = modes.PLAIN
_tracing_state = torch._C._get_tracing_state

PLANS_MAX = 1 << 16
plans: dict = {}
"""Weight plans: id(weight) -> (free, data_ptr, shape); ``free`` is 2 where :func:`dispatch.weight_free`
holds for every GEMM of the weight, 1 where only for its forward (calls without autograd), else 0."""
free_ptrs: dict = {}
"""id(weight) -> data_ptr of the weights whose plan is 2: the first lookup of :mod:`tritonmm.api`'s calls."""


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
        plans.clear()
        free_ptrs.clear()
    dtype, device = weight.dtype, weight.device
    free = 2 if dispatch.weight_free(N, K, dtype, device) else int(dispatch.weight_free(N, K, dtype, device, False))
    ptr = weight.data_ptr()
    plans[id(weight)] = (free, ptr, weight.shape)
    if free == 2:
        free_ptrs[id(weight)] = ptr
    else:
        free_ptrs.pop(id(weight), None)


def planned(weight: Tensor) -> bool:
    """Whether ``weight`` has a current plan (free or not): :func:`plan` would return at once."""
    current = plans.get(id(weight))
    try:
        return current is not None and current[1] == weight.data_ptr() and current[2] == weight.shape
    except RuntimeError:  # no storage (functorch's batched tensors): plan() decides
        return False
