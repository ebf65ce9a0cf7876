"""Routes: the keyed part of the fast path, for calls the weight plans of :mod:`tritonmm.api` do not serve.

A call builds a small key (shapes, dtypes, device, autocast dtype, forcing state, environment) and
looks up a callable resolved on the first call with that key:

* where the dispatcher sends the forward GEMM and both backward GEMMs to cuBLAS whatever the
  operands' strides (:func:`decide.torch_everywhere`), the callable *is* ``F.linear`` /
  ``torch.matmul``: torch's own autograd, autocast (with its weight-cast cache), functorch and
  mode handling apply;
* otherwise a :class:`Route` runs the runner (:mod:`tritonmm.dispatch.runners`) directly for plain eager
  tensors, a ``torch.autograd.Function`` over the same runner where autograd is needed, and the
  ``torch.library`` op for everything else (tensor subclasses, modes, tracing).

A plain eager call without autograd or autocast that a cached Route served once is served from then on
by one key over its whole geometry and state (:func:`_direct_key`) and one lookup of its runner
(:data:`direct`), without the Route's two keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import activations, modes, shapes
from ..core.env import raw_get, raw_name
from ..core.layout import tag as layout_tag
from ..dispatch import decide, first_sight, runners
from ..dispatch.plans import clear as _clear_plans
from ..dispatch.plans import free_ptrs, plan, planned, plans, torch_rows  # noqa: F401 (free_ptrs, plans: read by tests)
from .eager import autocast_dtype, cast, fx_proxy, linear_slow, matmul_slow, needs_grad, require_tensor

CACHE_MAX = 4096
_cache: dict = {}
_forced = decide._forced.get
_any_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch.is_grad_enabled
_fp32_precision = getattr(torch._C, "_get_float32_matmul_precision", torch.get_float32_matmul_precision)
_F32 = torch.float32
_BACKEND, _KERNEL = raw_name("TRITONMM_BACKEND"), raw_name("TRITONMM_KERNEL")  # decide routes; the rest: per runner
_AUTOTUNE = raw_name("TRITONMM_AUTOTUNE")
_RUNS_MAX = 64  # runners per route (operand layouts and alignments), then cleared
_PLAIN = modes.PLAIN
_functorch_active = modes._functorch_active
_fw_ad = modes._fw_ad
_tracing_state = modes._tracing_state
_function_modes = modes._function_modes
_dispatch_modes = modes._dispatch_modes


class Route:
    """A geometry that may reach a Triton kernel: ``(a, b, bias) -> Tensor``.

    Plain eager calls without autograd or autocast look their runner up by their direct key
    (:func:`_direct_key`: strides, alignments and the remaining dtypes and devices) and run it; every other
    call takes :func:`linear_slow` / :func:`matmul_slow`. Where only the backward GEMMs may reach
    Triton (``forward_torch``), calls that need no gradient go to torch directly.
    """

    __slots__ = ("torch_call", "forward_torch", "op", "activation", "runs", "cached")

    def __init__(self, torch_call, forward_torch: bool, op: str, activation: str):
        self.torch_call, self.forward_torch, self.op, self.activation = torch_call, forward_torch, op, activation
        self.runs: dict = {}
        self.cached = False  # kept in the route cache (not a first-sight deferred one): its runners enter `direct`

    def __call__(self, a, b, bias=None):
        try:
            if _grad_enabled() and (a.requires_grad or b.requires_grad or bias is not None and bias.requires_grad):
                return self.slow(a, b, bias)
            if self.forward_torch:
                return self.torch_call(a, b, bias) if self.op == "linear" else self.torch_call(a, b)
            key = _direct_key(self.op, a, b, bias, self.activation)
        except (AttributeError, RuntimeError, TypeError):  # a non-tensor, sparse or storage-less operand
            return self.slow(a, b, bias)
        if key is None:
            return self.slow(a, b, bias)
        prepared = self.runs.get(key)
        if prepared is None:
            if not modes.plain(a, b, bias) or modes.torch_only(a, b, bias):
                return self.slow(a, b, bias)
            if len(self.runs) >= _RUNS_MAX:
                self.runs.clear()
            prepared = self.runs[key] = runners.lookup(a, b, bias, self.activation, self.op)  # shared with explain
        if self.cached:
            if len(direct) >= CACHE_MAX:
                direct.clear()
            direct[key] = prepared
        return prepared.run(a, b, bias)

    def slow(self, a, b, bias):
        if self.op == "linear":
            return linear_slow(a, b, bias, self.activation)
        return matmul_slow(a, b)


def _torch_activation_call(activation: str):
    def call(x, w, b):
        return runners.torch_linear(x, w, b, activation, inplace=not needs_grad(x, w, b))
    return call


_TORCH_LINEAR_CALLS = {a: F.linear if a == "none" else _torch_activation_call(a) for a in activations.ACTIVATIONS}
_TORCH_LINEAR = frozenset(_TORCH_LINEAR_CALLS.values())


def _torch_linear_call(activation: str):
    return _TORCH_LINEAR_CALLS[activation]


def _torch_matmul_call(a: Tensor, b: Tensor):
    if b.dim() <= 2 or a.dim() >= b.dim():
        return torch.matmul
    return lambda x, y: torch.matmul(x, y).contiguous()  # the result is contiguous, as documented


def _effective_dtype(t: Tensor, autocast) -> torch.dtype:
    if autocast and t.is_floating_point() and t.dtype != torch.float64:
        return autocast
    return t.dtype


def _remember(key, entry):
    if len(_cache) >= CACHE_MAX:
        _cache.clear()
    _cache[key] = entry
    if type(entry) is Route:
        entry.cached = True
    return entry


direct: dict = {}
"""Plain eager calls without autograd or autocast: :func:`_direct_key` -> the :class:`runners.Prepared` a
cached :class:`Route` found for them (the runner's own fallback to torch included)."""


def _direct_key(op, a, b, bias, activation):
    """The key of a call that :data:`direct` may serve, or None: no gradient, no autocast, plain tensors,
    no functorch transform, forward-mode AD, torch function or dispatch mode, pending negation or
    storage-less zero tensor (the caller checked torch.compile and jit tracing); its op ("matmul" reads b
    as (K, N), "linear" as (N, K)), shapes, strides, dtypes, devices, 16-byte alignments, activation,
    forcing state, environment and float32 precision.

    Raises:
        AttributeError, RuntimeError, TypeError: an operand is not a strided tensor with storage.
    """
    if type(a) not in _PLAIN or type(b) not in _PLAIN or bias is not None and type(bias) not in _PLAIN:
        return None  # (first: torch.fx's Proxies, whose truth value raises, and subclasses)
    if _grad_enabled() and (a.requires_grad or b.requires_grad or bias is not None and bias.requires_grad):
        return None
    if (_any_autocast() or _functorch_active() or _fw_ad._current_level >= 0 or _function_modes()
            or _dispatch_modes()):
        return None
    pa, pb = a.data_ptr(), b.data_ptr()
    if not pa or not pb or a.is_neg() or b.is_neg():
        return None
    bias_key = None
    if bias is not None:
        pc = bias.data_ptr()
        if not pc or bias.is_neg():
            return None
        bias_key = (bias.shape, bias.stride(), bias.dtype, bias.device, pc & 15)
    dtype = a.dtype
    return (op, a.shape, a.stride(), b.shape, b.stride(), dtype, b.dtype, a.device, b.device, pa & 15, pb & 15,
            bias_key, activation, _forced(), raw_get(_BACKEND), raw_get(_KERNEL), raw_get(_AUTOTUNE),
            _fp32_precision() if dtype is _F32 else None)


def _linear_entry(key, x: Tensor, weight: Tensor, bias, activation: str, autocast):
    """Resolve a linear geometry (cache miss): validate, then decide its forward and backward GEMMs."""
    if autocast:  # validate as F.linear would see the operands: cast
        shapes.check_linear(cast(x, autocast), cast(weight, autocast), cast(bias, autocast), activation)
    else:
        shapes.check_linear(x, weight, bias, activation)
    N, K = weight.shape
    M = math.prod(x.shape[:-1])
    dtype = _effective_dtype(x, autocast)
    later = False
    if x.is_cuda and first_sight.worth_tuning(M, N, K, dtype):
        p = shapes.plan(x, weight.t())
        if p.batch == 1:
            later = _first_sight(first_sight.linear_problems(p.M, N, K, layout_tag(p), needs_grad(x, weight, bias)),
                                 dtype, x.device)
    fwd = decide.torch_everywhere([(M, N, K, 1)], dtype, x.device)
    bwd = fwd and decide.torch_everywhere([(M, K, N, 1), (N, K, M, 1)], dtype, x.device)
    call = _torch_linear_call(activation)
    fn = call if bwd else Route(call, fwd, "linear", activation)
    return _deferred(fn) if later else _remember(key, fn)


def _first_sight(todo: list, dtype: torch.dtype, device: torch.device) -> bool:
    """Measure the problems of ``todo`` that no table holds (:mod:`tritonmm.dispatch.first_sight`); where one
    chose a Triton kernel, forget the routes, runners and plans decided before. True where they must
    wait for an eager call (CUDA-graph capture): the caller then keeps no route for the geometry."""
    backend, kernel, _ = decide.forced()
    if backend != "auto" or kernel != "auto":
        return False  # forced: the table is not consulted
    if first_sight.pending(device, dtype, todo):
        measured, changed = first_sight.tune(device, dtype, todo)
        if measured:  # runners (explain's too) decided before the entries existed
            runners.clear_cache()
        if changed:
            clear()
            decide.state_changed()
        return False
    return first_sight.deferred(device, dtype, todo)


def _deferred(call):
    """``call`` for one call only: neither cached nor planned (linear_keyed plans only torch's own calls
    and Routes), so the geometry's next call decides again."""
    return lambda *args: call(*args)


def _matmul_problems(a: Tensor, b: Tensor) -> list:
    """Every (M, N, K, batch) the forward and backward GEMMs of ``a @ b`` can become (folded or batched)."""
    a_shape = (1, *a.shape) if a.dim() == 1 else tuple(a.shape)
    b_shape = (*b.shape, 1) if b.dim() == 1 else tuple(b.shape)
    M, K = a_shape[-2:]
    N = b_shape[-1]
    batch = math.prod(torch.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    fwd = [(M, N, K, batch), (M * batch, N, K, 1)]
    bwd = [(M, K, N, batch), (M * batch, K, N, 1), (K, N, M, batch), (K, N, M * batch, 1)]
    return fwd, bwd


def _matmul_entry(key, a: Tensor, b: Tensor, autocast):
    """Resolve a matmul geometry (cache miss), as :func:`_linear_entry`."""
    shapes.check_inputs(cast(a, autocast), cast(b, autocast)) if autocast else shapes.check_inputs(a, b)
    fwd_problems, bwd_problems = _matmul_problems(a, b)
    dtype = _effective_dtype(a, autocast)
    M, N, K, batch = fwd_problems[0]
    later = False
    if a.is_cuda and first_sight.worth_tuning(M * batch, N, K, dtype):
        p = shapes.plan(a, b)
        if p.batch == 1:
            later = _first_sight(first_sight.problems(p.M, p.N, p.K, layout_tag(p), needs_grad(a, b)), dtype,
                                 a.device)
    fwd = decide.torch_everywhere(fwd_problems, dtype, a.device)
    bwd = fwd and decide.torch_everywhere(bwd_problems, dtype, a.device)
    call = _torch_matmul_call(a, b)
    fn = call if bwd else Route(call, fwd, "matmul", "none")
    return _deferred(fn) if later else _remember(key, fn)


def matmul_keyed(input: Tensor, other: Tensor) -> Tensor:
    """``tritonmm.matmul`` through the keyed cache."""
    if direct:
        try:
            prepared = direct.get(_direct_key("matmul", input, other, None, "none"))
        except (AttributeError, RuntimeError, TypeError):
            prepared = None
        if prepared is not None:
            return prepared.run(input, other, None)
    try:
        dtype = input.dtype
        key = (input.shape, other.shape, dtype, input.device, _any_autocast() and autocast_dtype(input),
               _forced(), raw_get(_BACKEND), raw_get(_KERNEL), _fp32_precision() if dtype is _F32 else None)
    except (AttributeError, RuntimeError, TypeError):  # not tensors, nested tensors: every check
        return matmul_slow(input, other)
    fn = _cache.get(key)
    if fn is None:
        if fx_proxy(input, other):
            return matmul_slow(input, other)
        require_tensor("input", input, "matmul")
        require_tensor("other", other, "matmul")
        if modes.torch_only(input, other) or not modes.plain(input, other):
            return matmul_slow(input, other)
        fn = _matmul_entry(key, input, other, key[4])
    if (fn is torch.matmul or type(fn) is Route and fn.forward_torch) and other.dim() == 2 \
            and not planned(other):
        plan(other, other.shape[1], other.shape[0])
    return fn(input, other)


def linear_keyed(input: Tensor, weight: Tensor, bias, activation: str) -> Tensor:
    """``tritonmm.linear`` through the keyed cache."""
    if direct:
        try:
            prepared = direct.get(_direct_key("linear", input, weight, bias, activation))
        except (AttributeError, RuntimeError, TypeError):
            prepared = None
        if prepared is not None:
            return prepared.run(input, weight, bias)
    try:  # x enters by its element count: with weight (N, K) that fixes M (a wrong K is caught by F.linear)
        dtype = input.dtype
        key = (input.numel(), weight.shape, dtype, input.device, activation,
               _any_autocast() and autocast_dtype(input), _forced(), raw_get(_BACKEND), raw_get(_KERNEL),
               _fp32_precision() if dtype is _F32 else None)
    except (AttributeError, RuntimeError, TypeError):  # not tensors, nested tensors: every check
        return linear_slow(input, weight, bias, activation)
    try:
        fn = _cache.get(key)
    except TypeError:  # an unhashable activation: the full checks raise the ValueError
        return linear_slow(input, weight, bias, activation)
    if fn is None:
        if fx_proxy(input, weight, bias):
            return linear_slow(input, weight, bias, activation)
        require_tensor("input", input, "linear")
        require_tensor("weight", weight, "linear")
        if bias is not None:
            require_tensor("bias", bias, "linear")
        if modes.torch_only(input, weight, bias) or not modes.plain(input, weight, bias):
            return linear_slow(input, weight, bias, activation)
        if shapes.torch_form(input, weight, bias):  # F.linear's own checks, autograd and autocast: nothing to decide
            return runners.torch_linear(input, weight, bias, activation, inplace=False)
        fn = _linear_entry(key, input, weight, bias, activation, key[5])
    if fn in _TORCH_LINEAR or type(fn) is Route and fn.forward_torch:
        if not planned(weight):
            plan(weight, *weight.shape)
        torch_rows(weight, input, activation)
    return fn(input, weight, bias)


def clear() -> None:
    """Forget every route and weight plan."""
    _cache.clear()
    direct.clear()
    _clear_plans()
