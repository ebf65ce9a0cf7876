"""Attention input projections as one GEMM: q, k and v read the same input, so in inference a fused
attention module runs them as x @ [Wq; Wk; Wv]^T, one cuBLAS GEMM on weights :func:`tritonmm.fuse` packed
into one allocation (:mod:`tritonmm.packing`, biases too where all three have one): one launch and one
weight read instead of three, where decode and short prefill are paced by launches.

An attention module qualifies (:func:`fusable`) when its children ``q_proj``, ``k_proj`` and ``v_proj``
are nn.Linear modules running nn.Linear's forward (or tritonmm's) with one ``in_features``, and its
forward names all three and takes the hidden states as its first argument, as transformers' Llama,
Mistral, Qwen2 and Qwen3 attentions do. The attention's own forward still runs, and so does each
projection's ``__call__`` (with its hooks): for the duration of one forward, each projection serves the
GEMM's slice when it is called with the very input the GEMM read (the same tensor object, not changed
in place since), and computes its own output otherwise. Calls where autograd records (a gradient is
needed), autocast is on, under torch.compile, tracing, a torch function or dispatch mode or a functorch
transform, on a tensor subclass, where a projection's ``forward`` is set on the instance (accelerate's
hooks) or its weights are not packed, run the three projections as they are. An attention whose forward
once called a projection on another input is not fused again (its forward computes something else first).
"""

from __future__ import annotations

import dis
import functools
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from . import modes, packing
from ._env import interpreting
from .plain_modules import any_hooked, linear_type, plain_linear

NAMES = ("q_proj", "k_proj", "v_proj")
_UNSERVED = "_tritonmm_qkv_unserved"  # set on a fused attention whose forward read another input
_F_linear = F.linear
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_is_compiling = torch.compiler.is_compiling
_PLAIN = modes.PLAIN


_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW")


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
            if ins[j + 1].opname not in _LOADS or ins[j + 1].argval != name:
                return None  # a projection called on something else, or read as an attribute
            called.add(i.argval)
            first, last = (j if first is None else first), j + 1
    if called != set(NAMES):
        return None
    for j in range(first, last + 1):
        if name in _names(ins[j]) and not (ins[j - 1].opname in ("LOAD_ATTR", "LOAD_METHOD")
                                           and ins[j - 1].argval in NAMES and ins[j].opname in _LOADS):
            return None
    return name


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
    each, in that order (:func:`tritonmm.packing.pack`): floating-point CUDA weights (CPU ones under Triton's
    interpreter); returns whether they are packed now."""
    projs = projections(module)
    return projs is not None and packing.pack(*projs, accept=_accept, biases=True)


def unpack(module) -> bool:
    """Give ``module``'s packed q, k and v weights (and biases) their own storage again."""
    projs = projections(module)
    return projs is not None and packing.unpack(*projs)


class _Server:
    """A projection's instance ``forward`` for one attention forward: the GEMM's slice ``out``, once, for the
    call on ``x`` unchanged since the GEMM read it; the module's class forward for every other call."""

    __slots__ = ("module", "x", "version", "out")

    def __init__(self, module, x, version, out):
        self.module, self.x, self.version, self.out = module, x, version, out

    def __call__(self, input, *args, **kwargs):
        out = self.out
        if out is not None and input is self.x and not args and not kwargs \
                and (self.version is None or input._version == self.version):
            self.out = None
            return out
        return type(self.module).forward(self.module, input, *args, **kwargs)


_CACHE = "_tritonmm_qkv_packed"  # a fused attention's (weights and biases, their data pointers, [Wq; Wk; Wv], [bq; bk; bv])


def _packed(self, q, k, v):
    """``[Wq; Wk; Wv]``, ``[bq; bk; bv]`` (or None: no biases) as views and the three output sizes, or None
    where the parameters are not packed: kept on the module between calls, for as long as the same parameters sit at the same
    addresses (moving the module drops it: :func:`drop`)."""
    pq, pk, pv = q._parameters, k._parameters, v._parameters
    wq, wk, wv = pq.get("weight"), pk.get("weight"), pv.get("weight")
    bq, bk, bv = pq.get("bias"), pk.get("bias"), pv.get("bias")
    c = self.__dict__.get(_CACHE)
    if c is not None and c[0] is wq and c[1] is wk and c[2] is wv and c[3] is bq and c[4] is bk and c[5] is bv:
        try:
            if wq.data_ptr() == c[6] and wk.data_ptr() == c[7] and wv.data_ptr() == c[8] \
                    and (bq is None or bq.data_ptr() == c[9]):
                return c[10], c[11], c[12]
        except RuntimeError:  # no storage
            return None
    self.__dict__.pop(_CACHE, None)
    if wq is None or wk is None or wv is None or not all(type(t) in _PLAIN for t in (wq, wk, wv)):
        return None
    w = packing.stacked((wq, wk, wv))
    if w is None:
        return None
    if bq is None and bk is None and bv is None:
        b = None
    else:
        b = packing.stacked((bq, bk, bv)) if all(t is not None and type(t) in _PLAIN for t in (bq, bk, bv)) else None
        if b is None:
            return None
    sizes = [wq.shape[0], wk.shape[0], wv.shape[0]]
    self.__dict__[_CACHE] = (wq, wk, wv, bq, bk, bv, wq.data_ptr(), wk.data_ptr(), wv.data_ptr(),
                             bq.data_ptr() if bq is not None else None, w, b, sizes)
    return w, b, sizes


def drop(module) -> None:
    """Forget ``module``'s packed views and the mark :func:`_unserve` leaves (on unfuse and on moves)."""
    module.__dict__.pop(_CACHE, None)
    module.__dict__.pop(_UNSERVED, None)


def _serve(self, x):
    """Run q, k and v as one GEMM on ``x`` and set each projection's instance forward to serve its slice
    (:class:`_Server`); returns the servers, or None where the call runs unfused."""
    if type(x) not in _PLAIN or _UNSERVED in self.__dict__ or _any_autocast():
        return None
    mods = self._modules
    q, k, v = mods.get("q_proj"), mods.get("k_proj"), mods.get("v_proj")
    if not (linear_type(q) and linear_type(k) and linear_type(v)):
        return None
    if _grad_enabled() and (x.requires_grad or any(p.requires_grad for m in (q, k, v) for p in m._parameters.values()
                                                   if p is not None)):
        return None  # (autograd records: the projections run as they are)
    dq, dk, dv = q.__dict__, k.__dict__, v.__dict__
    if "forward" in dq or "forward" in dk or "forward" in dv or not modes.eager() or modes.torch_only(x):
        return None
    packed = _packed(self, q, k, v)
    if packed is None:
        return None
    if x.is_inference():  # (no version counter: only a hook could change the input in between, see input_name)
        if any_hooked(q, k, v):
            return None
        version = None
    else:
        version = x._version
    w, b, sizes = packed
    try:
        outs = _F_linear(x, w, b).split_with_sizes(sizes, -1)
    except RuntimeError:  # (dtypes, devices or sizes differ) the projections raise torch's own error
        return None
    servers = _Server(q, x, version, outs[0]), _Server(k, x, version, outs[1]), _Server(v, x, version, outs[2])
    dq["forward"], dk["forward"], dv["forward"] = servers
    return servers


def _unserve(self, servers) -> None:
    unserved = False
    for s in servers:
        d = s.module.__dict__
        if d.get("forward") is s:
            del d["forward"]
        unserved = unserved or s.out is not None
    if unserved:  # its forward read another input: the GEMM was wasted, so it is not fused again
        self.__dict__[_UNSERVED] = True


def fused_forward(base: type):
    """The forward of ``base``'s fused class: ``base.forward`` with the projections served by one GEMM."""
    forward = base.forward
    name = input_name(forward)

    @functools.wraps(forward)
    def fused(self, *args, **kwargs):
        served = None
        if not _is_compiling():
            x = args[0] if args else kwargs.get(name)
            served = _serve(self, x)
        if served is None:
            return forward(self, *args, **kwargs)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _unserve(self, served)

    fused._tritonmm_qkv = True
    return fused


def fused_attributes(base: type) -> dict:
    """The class attributes of ``base``'s fused class: its forward, and an ``_apply`` (``.to()``, ``.cuda()``,
    ``.half()``) that drops the packed views (they would keep the old storage alive)."""

    def _apply(self, fn, *args, **kwargs):
        out = base._apply(self, fn, *args, **kwargs)
        drop(self)
        return out

    return {"forward": fused_forward(base), "_apply": _apply}


def state(module, state):
    """``module``'s pickled state without its packed views (a fused attention rebuilds them on its next call)."""
    if isinstance(state, dict) and (_CACHE in state or _UNSERVED in state):
        state = {k: v for k, v in state.items() if k not in (_CACHE, _UNSERVED)}
    return state
