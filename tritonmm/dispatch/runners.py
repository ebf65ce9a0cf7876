"""Runners: the implementation of the ops, one cached runner per operand geometry.

The first call with a given geometry (shapes, strides, dtypes, devices, 16-byte alignment of
every operand, bias, activation, forcing state, float32 precision) validates the operands, builds the plan,
asks the dispatcher and builds a runner (a launcher, the padded path or torch); later calls with the
same geometry only allocate the output and launch. The cache is bounded (``CACHE_MAX`` entries,
then cleared) and holds no tensors. No autograd here: :mod:`tritonmm.api` and :mod:`tritonmm.ops`
wrap these functions.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import activations, shapes, workspace
from ..core.env import env_state
from ..core.layout import tma_copy_layout, tma_copy_shape, tma_layout
from . import decide, padded

CACHE_MAX = 4096
_cache: dict = {}
_current_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


alloc = torch.empty  # output allocator; tests swap in a NaN-filling one to catch unwritten tiles


class KernelFailedWarning(RuntimeWarning):
    """A Triton kernel failed for a geometry (every config failed to compile or ran out of
    resources); that geometry is served by torch.matmul from then on."""


class Prepared:
    """What one geometry needs at call time: the decision and a runner ``(a, b, bias) -> Tensor``."""

    __slots__ = ("decision", "run")

    def __init__(self, decision: decide.Decision, run: Callable):
        self.decision = decision
        self.run = run


def _key(a: Tensor, b: Tensor, bias: Optional[Tensor], activation: str, op: str) -> tuple:
    return (
        op, a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
        a.data_ptr() & 15, b.data_ptr() & 15,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device, bias.data_ptr() & 15),
        activation, decide._forced.get(), env_state(), torch.get_float32_matmul_precision(),
    )


def _build(plan: shapes.Plan, decision: decide.Decision, dtype, device, bias, activation, torch_run) -> Callable:
    """The runner for one geometry."""
    out_shape = plan.out_shape
    if decision.kernel == "padded":
        return padded.runner(plan, dtype, device, activation, alloc=lambda *args, **kw: alloc(*args, **kw))
    if decision.backend == "torch":
        return torch_run
    if decision.kernel == "none":
        def run_empty(a, b, bias):
            out = alloc(out_shape, dtype=dtype, device=device)
            if out.numel():  # K == 0: the sum over K is empty, so every row is act(bias) (or act(0) = 0)
                fill = bias.to(torch.float32).reshape(-1) if bias is not None else torch.zeros(1, device=device)
                fill = activations.apply_(fill.clone(), activation)
                out.copy_(fill.reshape(()) if out.dim() == 0 else fill.expand(out.shape))
            return out
        return run_empty

    from ..kernels import copy as copy_kernel
    from ..kernels import launchers

    M, N, K = plan.M, plan.N, plan.K
    bias_stride = None if bias is None else (bias.stride(0) if bias.dim() == 1 and bias.shape[0] == N else 0)
    guard_index = device.index if device.type == "cuda" else None

    if decision.kernel == "tma":
        a2, b2 = plan.a4[0, 0], plan.b4[0, 0]
        copy_a, copy_b = "a" in decision.copies, "b" in decision.copies
        la = tma_copy_layout(a2) if copy_a else tma_layout(a2)
        lb = tma_copy_layout(b2) if copy_b else tma_layout(b2)
        launch = launchers.tma_launcher(M, N, K, *la, *lb, dtype, device, bias_stride, activation, decision.config)
        sa, sb = a2.stride(), b2.stride()

        copy_specs = [(tma_copy_shape(t), dtype) for t, c in ((a2, copy_a), (b2, copy_b)) if c]
        copy_a_fn = copy_kernel.tma_copier(a2) if copy_a else None
        copy_b_fn = copy_kernel.tma_copier(b2) if copy_b else None

        def operands(a, b):  # aligned copies go to the reused workspace (see tritonmm.core.workspace)
            bufs = workspace.buffers(device, copy_specs)
            if copy_a:
                a = copy_a_fn(a.as_strided((M, K), sa), bufs.pop(0))
            if copy_b:
                b = copy_b_fn(b.as_strided((K, N), sb), bufs.pop(0))
            return a, b

        if not copy_specs:
            operands = None
    else:
        launch = launchers.pointer_launcher(M, N, K, plan.a4.shape[0], plan.a4.shape[1], plan.a4.stride(),
                                            plan.b4.stride(), (*plan.c_strides, N, 1), dtype, device, bias_stride,
                                            activation, decision.config, split_k=decision.kernel == "splitk")
        operands = None

    if operands is None and guard_index is None:
        def run(a, b, bias):
            out = alloc(out_shape, dtype=dtype, device=device)
            launch(a, b, out, bias)
            return out
    elif operands is None:
        def run(a, b, bias):
            out = alloc(out_shape, dtype=dtype, device=device)
            if guard_index != _current_device():
                with torch.cuda.device(guard_index):  # Triton launches on the current device
                    launch(a, b, out, bias)
            else:
                launch(a, b, out, bias)
            return out
    else:
        def run(a, b, bias):
            out = alloc(out_shape, dtype=dtype, device=device)
            if operands is not None:
                a, b = operands(a, b)
            if guard_index is not None and guard_index != _current_device():
                with torch.cuda.device(guard_index):  # Triton launches on the current device
                    launch(a, b, out, bias)
            else:
                launch(a, b, out, bias)
            return out

    run.launcher = launch
    return run


def build(plan: shapes.Plan, decision: decide.Decision, dtype: torch.dtype, device: torch.device) -> Callable:
    """A runner ``(a, b, None) -> a @ b`` for ``plan`` that takes ``decision`` (no bias, no activation, no
    fallback): first-sight tuning times candidate kernels through it (:mod:`tritonmm.dispatch.first_sight`)."""
    return _build(plan, decision, dtype, device, None, "none", None)


def prepare(a: Tensor, b: Tensor, bias: Optional[Tensor], activation: str, op: str) -> Prepared:
    """Validate, plan, decide and build the runner for one geometry (the cache-miss path).

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`shapes.check_inputs` / :func:`shapes.check_linear`.
    """
    if op == "linear":
        shapes.check_linear(a, b, bias, activation)

        def torch_run(x, w, bias_):
            return torch_linear(x, w, bias_, activation).contiguous()
        if shapes.torch_form(a, b, bias):
            form = "a 1-D weight" if b.dim() == 1 else (f"a bias of shape {tuple(bias.shape)}, broadcast over the output"
                                                         if bias.dim() > 1 else f"a {bias.dtype} bias")
            return Prepared(decide.Decision("torch", None, f"{form}: F.linear serves the call"), torch_run)
        plan = shapes.plan(a, b.t())
    else:
        shapes.check_inputs(a, b)
        plan = shapes.plan(a, b)

        def torch_run(x, y, bias_):
            return torch.matmul(x, y).contiguous()
    decision = decide.decide(plan, a.dtype, a.device)
    if plan.copied and decision.backend == "triton":  # operands were copied to build the kernels' views:
        # such a geometry is planned per call (torch's backends take the caller's operands as they are)
        def run(x, y, bias_):
            p = shapes.plan(x, y.t() if op == "linear" else y)
            return _build(p, decision, a.dtype, a.device, bias_, activation, torch_run)(p.a4, p.b4, bias_)
    else:
        run = _build(plan, decision, a.dtype, a.device, bias, activation, torch_run)
    if decision.backend == "torch" or decision.kernel == "none":
        return Prepared(decision, run)
    return _guarded(decision, run, torch_run)


def _guarded(decision: decide.Decision, run: Callable, torch_run: Callable) -> Prepared:
    """A Prepared whose runner falls back to torch, with one :class:`KernelFailedWarning`, if Triton fails.

    Failures are compile errors, shared memory or register overflow and autotuning that finds
    no runnable config (``kernels.launch.LAUNCH_FAILURES``); nothing was returned to the caller, so the
    torch result replaces the unfinished output. Later calls of the geometry go to torch directly.
    """
    from ..kernels.launch import LAUNCH_FAILURES

    prepared = Prepared(decision, None)

    def guarded(a, b, bias):
        try:
            return run(a, b, bias)
        except LAUNCH_FAILURES as exc:
            reason = f"Triton {decision.kernel} kernel failed ({type(exc).__name__}: {str(exc).strip()[:200]})"
            warnings.warn(f"tritonmm: {reason}; this geometry now runs torch.matmul", KernelFailedWarning,
                          stacklevel=4)
            prepared.decision = dataclasses.replace(decision, backend="torch", kernel=None, config=None, copies=(),
                                                    reason=reason)
            prepared.run = torch_run
            return torch_run(a, b, bias)

    prepared.run = guarded
    return prepared


def lookup(a: Tensor, b: Tensor, bias: Optional[Tensor], activation: str, op: str) -> Prepared:
    """The cached :class:`Prepared` for this geometry, built on first use."""
    key = _key(a, b, bias, activation, op)
    try:
        entry = _cache.get(key)
    except TypeError:  # an unhashable activation: prepare's checks raise the ValueError
        return prepare(a, b, bias, activation, op)
    if entry is None:
        entry = prepare(a, b, bias, activation, op)
        if len(_cache) >= CACHE_MAX:
            _cache.clear()
        _cache[key] = entry
    return entry


_STRIDED = torch.strided


def _unusual(t: Tensor) -> bool:
    """Tensors the kernels must not read as raw strided memory: sparse (and other layouts), a pending
    negation (``is_neg()``: views such as ``x.conj().imag``) or an efficient zero tensor (no storage)."""
    return t.layout is not _STRIDED or t.is_neg() or t._is_zerotensor()


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """torch.matmul semantics through the cached dispatch (the op's implementation).

    Sparse, neg-bit and zero tensors go to torch.matmul unchanged.
    """
    if _unusual(a) or _unusual(b):
        return torch.matmul(a, b)
    return lookup(a, b, None, "none", "matmul").run(a, b, None)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    """act(F.linear(x, weight, bias)) through the cached dispatch (the op's implementation).

    Sparse, neg-bit and zero tensors and biases of more than one dimension go to F.linear unchanged (after the same
    checks), as do the other forms of :func:`shapes.torch_form` (their geometry's runner is F.linear: :func:`prepare`).
    """
    if _unusual(x) or _unusual(weight) or bias is not None and (_unusual(bias) or bias.dim() > 1):
        return torch_linear(x, weight, bias, activation)
    return lookup(x, weight, bias, activation, "linear").run(x, weight, bias)


def torch_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                 inplace: bool = True) -> Tensor:
    """act(F.linear(x, weight, bias)) by torch alone, for the calls tritonmm hands to torch.

    ``inplace`` applies the activation to F.linear's fresh output (outside autograd only).

    Raises:
        ValueError: unknown activation; otherwise F.linear's own errors.
    """
    if activation not in activations.ACTIVATIONS:
        shapes.check_linear(x, weight, bias, activation)  # raises the ValueError
    out = F.linear(x, weight, bias)
    return activations.apply_(out, activation) if inplace else activations.apply(out, activation)


def clear_cache() -> None:
    """Forget every cached decision and launcher (e.g. after installing a new tuned table) and
    free this thread's workspace buffers."""
    _cache.clear()
    workspace.release()
