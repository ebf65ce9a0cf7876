"""Attention input projections as one GEMM: q, k and v read the same input, so while a CUDA graph of an
inference forward is captured a fused attention module runs them as x @ [Wq; Wk; Wv]^T, one cuBLAS GEMM on
weights :func:`tritonmm.fuse` packed into one allocation (:mod:`tritonmm.modules.packing`, biases too where all three
have one): one launch and one weight read instead of three in every replay of the graph. In eager mode the
three run as they are (:data:`SERVE_EAGER`), except in a folding decoder layer (:mod:`tritonmm.modules.norm_fold`),
whose input RMSNorm hands the attention its own input: then the one GEMM, in eager calls too, reads it through the
norm (:func:`_Shared.linear`), and every call that is not served (hooks on a projection) gets the norm's output.

An attention module qualifies (:func:`fusable`) when its children ``q_proj``, ``k_proj`` and ``v_proj`` are
nn.Linear modules running nn.Linear's forward (or tritonmm's) with one ``in_features``, and its forward
calls each of them on its first argument alone and reads that argument nowhere from the first of those calls
to the last, as transformers' Llama, Mistral, Qwen2 and Qwen3 attentions do. The attention's own forward
still runs (its class's current one), and so does each projection's ``__call__`` with its hooks: for the
duration of one forward, the first projection called with the forward's input runs the one GEMM on that
input as it is then, and each projection called with that same tensor object, not changed in place since and
with its own weight and bias unchanged since (the same tensors, at the same address, of the same version: a
change through ``.data`` in place, which autograd does not see either, is not seen), returns its slice of the
GEMM's output: a column slice of one tensor, as ``torch.split`` returns (so a ``.view`` that merges rows with
columns needs ``.reshape``).
Gradients are not recorded then, and the projection's parameters are still the ones the GEMM read. Any other
call computes its own output, and so do calls above :data:`MAX_FLOPS`. Calls with gradients recorded,
autocast on, traced (torch.compile: :mod:`.qkv_traced`), a torch function or dispatch mode or functorch, on a
tensor subclass, where a projection's ``forward`` is set on the instance (accelerate's hooks) or its weights
are not packed, run the three projections as they are; so do calls on inference tensors (under
``torch.inference_mode()``: they have no version counter to check the input against). An attention whose
forward once completed with a projection called on another input is not fused again (its forward computes
something else first).
"""

from __future__ import annotations

import dis
import functools
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from ..core import modes
from ..core.env import interpreting
from ..dispatch.norm_linear import norm_linear
from . import norm_fold, packing, qkv_traced
from .plain import Stale, any_hooked, linear_type, plain_linear

NAMES = ("q_proj", "k_proj", "v_proj")
_UNSERVED = "_tritonmm_qkv_unserved"  # set on a fused attention whose forward read another input
_F_linear = F.linear
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_is_compiling = torch.compiler.is_compiling
_PLAIN = modes.PLAIN
_MISSING = object()
SERVE_EAGER = False
"""Whether calls outside CUDA-graph capture are served too. Off: in host-paced eager forwards (decode, prefill)
the serving costs the host more than the two launches it saves (``benchmarks/diagnostics/h200_fuse_ab.json``);
captured forwards replay faster (``benchmarks/h200_model.json``, ``cuda-graph replay``)."""
_capturing = torch.cuda.is_current_stream_capturing
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _captured(x) -> bool:
    """Whether ``x`` is a CUDA tensor and this thread's current stream on its device is capturing a CUDA graph.
    The default stream, which cannot capture, is told apart first, without the driver's capture query, which
    costs more host time than the check (``benchmarks/diagnostics/h200_fuse_prefill_diag.json``)."""
    if not x.is_cuda or _raw_stream is not None and not _raw_stream(x.get_device()):
        return False
    return _capturing()


MAX_FLOPS = 2**37
"""Calls above this many FLOP run the three GEMMs: above it the one GEMM saves nothing over the three
(``benchmarks/h200_qkv.json``, Llama-3-8B's q/k/v sizes)."""


_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW")
_CALLS = ("PRECALL", "CALL", "CALL_FUNCTION", "CALL_METHOD")


def _names(ins) -> tuple:
    return ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)


def input_name(forward) -> Optional[str]:
    """The name of the hidden states' parameter of an attention ``forward`` (decorators unwrapped) that
    calls q_proj, k_proj and v_proj on that parameter, and reads it nowhere else from the first of those
    calls to the last (so nothing but the projections' own hooks can change it in between); else None."""
    fn = inspect.unwrap(forward)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount < 2 or not all(n in code.co_names for n in NAMES):
        return None
    name = code.co_varnames[1]
    ins = [i for i in dis.get_instructions(fn) if i.opname not in ("CACHE", "EXTENDED_ARG", "NOP")]
    called, first, last = set(), None, None
    for j, i in enumerate(ins[:-1]):
        if i.opname in ("LOAD_ATTR", "LOAD_METHOD") and i.argval in NAMES:
            if ins[j + 1].opname not in _LOADS or ins[j + 1].argval != name or j + 2 >= len(ins) \
                    or ins[j + 2].opname not in _CALLS:
                return None  # a projection called on something else or more, or read as an attribute
            called.add(i.argval)
            first, last = (j if first is None else first), j + 1
    if called != set(NAMES):
        return None
    for j in range(first, last + 1):
        if name in _names(ins[j]) and not (ins[j - 1].opname in ("LOAD_ATTR", "LOAD_METHOD")
                                           and ins[j - 1].argval in NAMES and ins[j].opname in _LOADS):
            return None
    return name


def reads_shape_only(forward, name: str) -> bool:
    """Whether ``forward`` (decorators unwrapped) reads its parameter ``name`` only as q_proj's, k_proj's and
    v_proj's argument (:func:`input_name`'s calls) and as ``name.shape``, and never rebinds it or closes over it: then
    it may be called with an RMSNorm's input in place of the norm's output, the projections computing the norm
    (:mod:`tritonmm.modules.norm_fold`)."""
    fn = inspect.unwrap(forward)
    code = getattr(fn, "__code__", None)
    if code is None or name in code.co_cellvars:
        return False
    ins = [i for i in dis.get_instructions(fn) if i.opname not in ("CACHE", "EXTENDED_ARG", "NOP")]
    for j, i in enumerate(ins):
        if "FAST" not in i.opname or name not in _names(i):
            continue
        if i.opname not in _LOADS or j + 1 >= len(ins):
            return False  # rebound, deleted, or loaded with another name
        prev, nxt = ins[j - 1], ins[j + 1]
        if not (prev.opname in ("LOAD_ATTR", "LOAD_METHOD") and prev.argval in NAMES and nxt.opname in _CALLS
                or nxt.opname == "LOAD_ATTR" and nxt.argval == "shape"):
            return False
    return True


def takes_norm(forward) -> bool:
    """Whether an attention with this ``forward`` may be called with an RMSNorm's input (:func:`input_name` and
    :func:`reads_shape_only`)."""
    name = input_name(forward)
    return name is not None and reads_shape_only(forward, name)


def projections(module) -> Optional[tuple]:
    """``module``'s (q_proj, k_proj, v_proj) where all three are plain nn.Linear modules (tritonmm's swapped
    or patched ones included) with one ``in_features``, else None."""
    mods = module._modules
    projs = tuple(mods.get(n) for n in NAMES)
    if not all(plain_linear(m) for m in projs) or len({m.in_features for m in projs}) != 1:
        return None
    return projs


def fusable(module) -> bool:
    """Whether ``module`` is an attention :func:`tritonmm.fuse` runs with one q/k/v GEMM (module docstring)."""
    return projections(module) is not None and input_name(type(module).forward) is not None


def _accept(w: torch.Tensor) -> bool:
    return w.is_floating_point() and (w.device.type == "cuda" or w.device.type == "cpu" and interpreting())


def pack(module) -> bool:
    """Pack ``module``'s q, k and v weights (and biases, where all three have one) into one allocation
    each, in that order (:func:`tritonmm.modules.packing.pack`): floating-point CUDA weights (CPU ones under Triton's
    interpreter); returns whether they are packed now."""
    projs = projections(module)
    return projs is not None and packing.pack(*projs, accept=_accept, biases=True)


def unpack(module) -> bool:
    """Give ``module``'s packed q, k and v weights (and biases) their own storage again."""
    projs = projections(module)
    return projs is not None and packing.unpack(*projs)


_CACHE = "_tritonmm_qkv_packed"  # a fused attention's packed views: (addresses, shapes, what _packed returns)


def _packed(self, q, k, v):
    """``[Wq; Wk; Wv]``, ``[bq; bk; bv]`` (or None: no biases) as views, the three output sizes and the six
    parameters, or None where the parameters are not packed: kept on the module between calls for as long
    as the same parameters sit at the same addresses with the same shapes (dropped by any call that runs
    unfused, by moving the module and by ``unfuse``)."""
    pq, pk, pv = q._parameters, k._parameters, v._parameters
    params = (pq.get("weight"), pk.get("weight"), pv.get("weight"), pq.get("bias"), pk.get("bias"), pv.get("bias"))
    c = self.__dict__.get(_CACHE)
    if c is not None and all(a is b for a, b in zip(c[2][3], params)):
        try:
            if all(p is None or p.data_ptr() == ptr and p.shape == shape and p.is_contiguous()
                   for p, ptr, shape in zip(params, c[0], c[1])):
                return c[2]
        except RuntimeError:  # no storage
            return None
    self.__dict__.pop(_CACHE, None)
    wq, wk, wv, bq, bk, bv = params
    if wq is None or wk is None or wv is None or not all(type(t) in _PLAIN for t in params if t is not None):
        return None
    w = packing.stacked((wq, wk, wv))
    if w is None:
        return None
    if bq is None and bk is None and bv is None:
        b = None
    else:
        b = packing.stacked((bq, bk, bv)) if all(t is not None for t in (bq, bk, bv)) else None
        if b is None:
            return None
    packed = (w, b, [wq.shape[0], wk.shape[0], wv.shape[0]], params)
    self.__dict__[_CACHE] = (tuple(p.data_ptr() if p is not None else 0 for p in params),
                             tuple(p.shape if p is not None else None for p in params), packed)
    return packed


def drop(module) -> None:
    """Forget ``module``'s packed views and the mark :func:`_unserve` leaves (on unfuse and on moves)."""
    module.__dict__.pop(_CACHE, None)
    module.__dict__.pop(_UNSERVED, None)


class _Shared:
    """One attention forward's GEMM: run by the first projection called with ``x`` (lazily, so it reads ``x``
    as it is then), its outputs and the versions of what it read. With ``norm`` (a :class:`norm_fold.Pending`), ``x``
    is that RMSNorm's input and the GEMM reads the norm's output: computed in its loads
    (:func:`tritonmm.dispatch.norm_linear.norm_linear`) or, where that kernel does not serve, by the norm first."""

    __slots__ = ("x", "w", "b", "sizes", "params", "outs", "version", "versions", "ptrs", "norm")

    def __init__(self, x, packed, norm=None):
        self.x, self.norm = x, norm
        self.w, self.b, self.sizes, self.params = packed
        self.outs = self.version = self.versions = self.ptrs = None

    def linear(self, x):
        """``F.linear`` of ``x`` (through the norm, with one) and the packed weights."""
        norm = self.norm
        if norm is None:
            return _F_linear(x, self.w, self.b)
        m = norm.norm
        y = norm_linear(x, m._parameters["weight"], m.variance_epsilon, self.w, self.b)
        return _F_linear(norm.normalize(x), self.w, self.b) if y is None else y

    def run(self) -> None:
        """The GEMM; ``outs`` is set last (another thread may read the attributes as soon as it is set), to
        () where each projection computes its own."""
        x = self.x
        try:
            versions = tuple(p._version if p is not None else 0 for p in self.params)
            ptrs = tuple(p.data_ptr() if p is not None else 0 for p in self.params)  # (``.data =`` keeps _version)
            version = x._version
            outs = self.linear(x).split_with_sizes(self.sizes, -1)
        except RuntimeError:  # dtypes, devices or sizes differ (each projection raises torch's own error), or an
            outs = ()  # inference-tensor parameter (no version counter)
        else:
            self.version, self.versions, self.ptrs = version, versions, ptrs
        self.outs = outs


class _Server:
    """A projection's instance ``forward`` for one attention forward: its slice of the shared GEMM, once,
    for a call on the forward's input unchanged since the GEMM read it, with its own weight and bias
    unchanged; the module's class forward for every other call."""

    __slots__ = ("module", "shared", "index", "served")

    def __init__(self, module, shared, index):
        self.module, self.shared, self.index, self.served = module, shared, index, None

    def __reduce__(self):  # (a copy taken during the forward: the projection's own forward, once)
        return Stale, (self.module,)

    def __call__(self, input, *args, **kwargs):
        sh = self.shared
        if self.served is None and input is sh.x and not args and not kwargs:
            self.served = False  # called with the forward's input (served or, where anything changed, not)
            if not _grad_enabled():  # (grad mode may have been turned on inside the forward)
                if sh.outs is None:
                    sh.run()
                outs, i = sh.outs, self.index
                if outs and input._version == sh.version:
                    w, b = sh.params[i], sh.params[i + 3]
                    p = self.module._parameters
                    if p.get("weight") is w and p.get("bias") is b and w._version == sh.versions[i] \
                            and w.data_ptr() == sh.ptrs[i] and (b is None or b._version == sh.versions[i + 3]
                                                                and b.data_ptr() == sh.ptrs[i + 3]):
                        self.served = True
                        return outs[i]
        if input is sh.x and sh.norm is not None:  # (the RMSNorm's input: the projection reads the norm's output)
            input = sh.norm.normalize(input)
        return type(self.module).forward(self.module, input, *args, **kwargs)


def _serve(self, x, norm=None):
    """Set each projection's instance forward to a :class:`_Server` of one shared GEMM on ``x`` (an RMSNorm's input,
    with ``norm``: served in eager calls too); returns the servers, or None where the call runs unfused."""
    if type(x) not in _PLAIN or not (SERVE_EAGER or norm is not None or _captured(x)) or _grad_enabled() \
            or _any_autocast() or _UNSERVED in self.__dict__:
        self.__dict__.pop(_CACHE, None)  # (no views kept for calls that do not use them)
        return None
    mods = self._modules
    q, k, v = mods.get("q_proj"), mods.get("k_proj"), mods.get("v_proj")
    if not (linear_type(q) and linear_type(k) and linear_type(v)):
        return None
    dq, dk, dv = q.__dict__, k.__dict__, v.__dict__
    if "forward" in dq or "forward" in dk or "forward" in dv or x.is_inference() or not modes.eager() \
            or modes.torch_only(x):  # (inference tensors have no version counter to check x against)
        return None
    if norm is not None and any_hooked(q, k, v):  # (their hooks would see the norm's input)
        return None
    packed = _packed(self, q, k, v)
    if packed is None or 2 * x.numel() * packed[0].shape[0] > MAX_FLOPS:
        return None
    shared = _Shared(x, packed, norm)
    servers = _Server(q, shared, 0), _Server(k, shared, 1), _Server(v, shared, 2)
    dq["forward"], dk["forward"], dv["forward"] = servers
    return servers


def _unserve(self, servers, completed: bool) -> None:
    """Remove the servers; after a forward that completed with a projection not called on its input while its
    server was in place (called on another input, or not at all), mark the attention so that it is not fused
    again."""
    unserved = False
    for s in servers:
        d = s.module.__dict__
        if d.get("forward") is s:
            del d["forward"]
            unserved = unserved or s.served is None
    if unserved and completed:
        self.__dict__[_UNSERVED] = True


_input_names: dict = {}  # an attention forward -> the name of its input (None: not fused)
_takes_norm: dict = {}  # an attention forward -> whether it reads its input only as the projections' and its shape


def _with_input(args: tuple, kwargs: dict, key: Optional[str], x) -> tuple:
    """``(args, kwargs)`` with ``x`` as the first positional argument (``key`` None) or as keyword ``key``."""
    if key is None:
        return (x, *args[1:]), kwargs
    kwargs[key] = x
    return args, kwargs


def fused_forward(base: type):
    """The forward of ``base``'s fused class: ``base``'s current forward, with the projections served by one
    GEMM where that forward qualifies (:func:`input_name`)."""

    def fused(self, *args, **kwargs):
        forward = base.forward
        served = norm = None
        if not _is_compiling():
            name = _input_names.get(forward, _MISSING)
            if name is _MISSING:
                if len(_input_names) >= 1024:
                    _input_names.clear()
                name = _input_names[forward] = input_name(forward)
                _takes_norm[forward] = name is not None and reads_shape_only(forward, name)
            if "_tritonmm_norm" in self.__dict__:  # a folding layer's call (norm_fold): maybe an RMSNorm's input
                key = getattr(self.__dict__["_tritonmm_norm"], "key", None)
                x = args[0] if key is None and args else kwargs.get(key) if key else None
                norm = norm_fold.take(self, x)
                if norm is not None and not (_takes_norm.get(forward) and key in (None, name)):
                    args, kwargs = _with_input(args, kwargs, key, norm.normalize(x))  # (reads it otherwise)
                    norm = None
            if name is not None:
                x = args[0] if args else kwargs.get(name)
                served = _serve(self, x, norm)
                if served is None and norm is not None:
                    args, kwargs = _with_input(args, kwargs, key, norm.normalize(x))
        elif self._tritonmm_qkv_input[0] is forward and self._tritonmm_qkv_input[1] is not None:
            return qkv_traced.forward(self, forward, self._tritonmm_qkv_input[1], MAX_FLOPS, args, kwargs)
        if served is None:
            return forward(self, *args, **kwargs)
        completed = False
        try:
            out = forward(self, *args, **kwargs)
            completed = True
            return out
        finally:
            _unserve(self, served, completed)

    functools.update_wrapper(fused, base.forward)
    fused._tritonmm_qkv = True
    return fused


def fused_attributes(base: type) -> dict:
    """The class attributes of ``base``'s fused class: its forward, and an ``_apply`` (``.to()``, ``.cuda()``,
    ``.half()``) that drops the packed views (they would keep the old storage alive)."""

    def _apply(self, fn, *args, **kwargs):
        out = base._apply(self, fn, *args, **kwargs)
        drop(self)
        return out

    return {"forward": fused_forward(base), "_apply": _apply, "_tritonmm_takes_norm": takes_norm(base.forward),
            "_tritonmm_qkv_input": (base.forward, input_name(base.forward))}  # (read under torch.compile)


def state(module, state):
    """``module``'s pickled state without its packed views (a fused attention rebuilds them on its next call)."""
    if isinstance(state, dict) and (_CACHE in state or _UNSERVED in state):
        state = {k: v for k, v in state.items() if k not in (_CACHE, _UNSERVED)}
    return state
