"""The public entry points and their per-call fast path.

The fastest path is a weight plan (:mod:`tritonmm.dispatch.plans`): for an (N, K) weight that automatic dispatch sends
to cuBLAS in every GEMM it can take part in (:func:`decide.weight_free`: the forward for any number of rows,
in its dtype or an autocast dtype, and both gradients), a call in the default state (nothing forced, not
compiling) is ``F.linear`` / ``torch.matmul`` itself after one dictionary lookup, validated by the weight's
data pointer (a new dtype, device or storage moves it; a plan only ever chooses torch's own call, so a stale
one costs a missed Triton route, never a wrong result). Torch's own autograd, autocast (with its weight-cast
cache), functorch and mode handling then apply. Everything else goes through the keyed routes
(:mod:`tritonmm.ops.routes`). Under ``torch.compile`` and ``torch.export`` the call is the op itself, which
decides at trace time (:mod:`tritonmm.ops.traced`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .core import activations, layout, modes, shapes
from .core.env import raw_env, raw_name
from .dispatch import decide, first_sight, norm_linear, runners, tuned
from .dispatch.plans import free_ptrs, plans
from .kernels import configs
from .ops import eager, gated, routes

_plans_get = plans.get
_free_get = free_ptrs.get
_forced = decide._forced.get
_is_compiling = torch.compiler.is_compiling
# torch.compiler.is_compiling() reads this flag (torch.export and AOT tracing set it; Dynamo is checked apart);
# read in place it costs a third of the call
_compiler = torch.compiler if isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool) else None
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # True under Dynamo (constant); 30 ns in eager
_tracing_state = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_PLAIN = modes.PLAIN
_F_linear = F.linear
_matmul = torch.matmul
_activation = activations.apply
_EPILOGUES = activations.ACTIVATIONS  # (a tuple: an unhashable activation compares, the full checks raise)
_BACKEND, _KERNEL = raw_name("TRITONMM_BACKEND"), raw_name("TRITONMM_KERNEL")


def matmul(input: Tensor, other: Tensor) -> Tensor:
    """Matrix product with ``torch.matmul`` semantics; the GEMM runs in a Triton kernel or cuBLAS.

    Args:
        input (Tensor): A, (K,), (M, K) or (*batch_a, M, K); float16, bfloat16 or float32 for the
            Triton path (other dtypes go to torch.matmul).
        other (Tensor): B, (K,), (K, N) or (*batch_b, K, N); same dtype and device as ``input``.
            Batch dims broadcast, stride-0 (expanded) dims included; any strides are read in place.

    Returns:
        Tensor: torch.matmul's shape (1-D operands lose their unit dim; 1-D x 1-D gives 0-D),
        in the input dtype, contiguous. float16/bfloat16 accumulate in fp32; float32 uses TF32
        only where torch.matmul would (CUDA, ``torch.get_float32_matmul_precision() != "highest"``).

    Raises:
        TypeError: an argument is not a Tensor.
        RuntimeError: devices differ, dtypes differ (no promotion), an operand is 0-D,
            inner dims differ, or batch dims do not broadcast.

    Falls back to torch.matmul (cuBLAS) where :func:`explain` says so. Sparse, nested, neg-bit
    and zero tensors, functorch transforms and forward-mode AD are handed to torch.matmul itself.
    """
    if _dynamo_compiling():
        return eager.matmul_slow(input, other)
    ptr = _free_get(id(other))  # the weight plan (module docstring), checked inline
    if ptr is not None and _forced() is None and _BACKEND not in raw_env and _KERNEL not in raw_env:
        try:
            if ptr == other.data_ptr():
                return _matmul(input, other)
        except (AttributeError, RuntimeError):  # not a tensor, no storage
            pass
    else:
        plan = _plans_get(id(other))  # a weight free of tritonmm in its forward only
        if plan is not None and plan[0] and _forced() is None and _BACKEND not in raw_env and _KERNEL not in raw_env:
            try:
                if plan[1] == other.data_ptr() and not (
                        _grad_enabled() and (input.requires_grad or other.requires_grad)):
                    return _matmul(input, other)
            except (AttributeError, RuntimeError):
                pass
    if (_compiler._is_compiling_flag if _compiler is not None else _is_compiling()) or _tracing_state() is not None:
        return eager.matmul_slow(input, other)  # (jit tracing: every run of a trace takes one path)
    return routes.matmul_keyed(input, other)


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    """``activation(F.linear(x, weight, bias))``; on the Triton path one GEMM with a fused epilogue.

    Args:
        input (Tensor): x, (*, K), float16/bfloat16/float32; any leading shape and strides.
        weight (Tensor): (N, K), read in its own layout (no transpose copy).
        bias (Tensor, optional): (N,), same dtype as x; added to the fp32 accumulator. The other forms F.linear
            takes (a 1-D weight; a bias of more than one dimension or of another dtype) are served by F.linear.
        activation (str): "none", "relu", "gelu" (erf), "gelu_tanh" or "silu", applied to the
            fp32 accumulator before the one rounding to the output dtype.

    Returns:
        Tensor: (*, N), dtype of x, contiguous.

    Raises:
        TypeError: input, weight or bias is not a Tensor (bias may be None).
        ValueError: unknown activation.
        RuntimeError: dtypes or devices differ, weight is not 2-D, or K differs.

    Under ``torch.autocast`` the inputs are cast to the autocast dtype as F.linear's are.
    """
    if _dynamo_compiling():
        return eager.linear_slow(input, weight, bias, activation)
    ptr = _free_get(id(weight))  # the weight plan (module docstring), checked inline
    if ptr is not None and _forced() is None and _BACKEND not in raw_env and _KERNEL not in raw_env:
        try:
            if ptr == weight.data_ptr():
                if activation == "none":
                    return _F_linear(input, weight, bias)
                if activation in _EPILOGUES:  # as the activation module after F.linear computes it
                    return _activation(_F_linear(input, weight, bias), activation)
        except (AttributeError, RuntimeError):  # not a tensor, no storage
            pass
    else:
        plan = _plans_get(id(weight))  # free of tritonmm in its forward only, or at this input's size
        if plan is not None and (plan[0] or type(input) in _PLAIN) and _forced() is None \
                and _BACKEND not in raw_env and _KERNEL not in raw_env:  # (plan 0: no fx Proxy's truth tested)
            try:
                if plan[1] == weight.data_ptr() and activation in _EPILOGUES and not (
                        _grad_enabled() and (input.requires_grad or weight.requires_grad
                                             or bias is not None and bias.requires_grad)):
                    if plan[0]:
                        if activation == "none":
                            return _F_linear(input, weight, bias)
                        return _activation(_F_linear(input, weight, bias), activation)
                    if activation == "none" and input.numel() in plan[3] and input.dtype is plan[4] \
                            and not _any_autocast() and plan[2] == weight.shape:
                        return _F_linear(input, weight, bias)
            except (AttributeError, RuntimeError):
                pass
    if (_compiler._is_compiling_flag if _compiler is not None else _is_compiling()) or _tracing_state() is not None:
        return eager.linear_slow(input, weight, bias, activation)  # (jit tracing: every run of a trace takes one path)
    return routes.linear_keyed(input, weight, bias, activation)


def torch_planned(weight) -> bool:
    """Whether ``weight`` has a current plan sending every GEMM it takes part in to torch, in the default
    state (nothing forced): where a fused module has nothing left to fuse."""
    ptr = _free_get(id(weight))
    try:
        return ptr is not None and ptr == weight.data_ptr() and _forced() is None \
            and _BACKEND not in raw_env and _KERNEL not in raw_env
    except (AttributeError, RuntimeError):  # not a tensor, no storage
        return False


def explain(a: Tensor, b: Tensor) -> decide.Decision:
    """The backend ``matmul(a, b)`` would take now, with the reason (``str()`` it to read it).

    Args:
        a, b (Tensor): as for :func:`matmul`.

    Returns:
        Decision: ``backend`` ("triton" or "torch"), ``kernel``, ``reason``, ``config``, ``copies``.
        Under ``torch.autocast`` it is the decision for the operands as autocast casts them.

    Raises:
        Those of :func:`matmul` for invalid operands (operands handed to torch.matmul itself, such as
        sparse ones, are not checked here).
    """
    eager.require_tensor("a", a, "explain")
    eager.require_tensor("b", b, "explain")
    if modes.torch_only(a, b):
        return decide.Decision("torch", None, "functorch transform, forward-mode AD or nested tensor: "
                                                "torch.matmul itself serves the call")
    if modes.own_torch_function(a, b):
        return decide.Decision("torch", None, "a tensor subclass with its own __torch_function__: torch.matmul "
                                                "itself serves the call")
    if modes.unusual(a) or modes.unusual(b):
        return decide.Decision("torch", None, "sparse, neg-bit (e.g. x.conj().imag) or zero tensor: "
                                                "torch.matmul itself serves the call")
    if torch._C._is_any_autocast_enabled():
        dtype = eager.autocast_dtype(a)
        if dtype is not None:
            a, b = eager.cast(a, dtype), eager.cast(b, dtype)
    decision = runners.lookup(a, b, None, "none", "matmul").decision
    if decision.reason.startswith("not in this GPU's tuned table") or "used as a prior" in decision.reason:
        p = shapes.plan(a, b)
        if p.batch == 1 and first_sight.pending(a.device, a.dtype, [(p.M, p.N, p.K, layout.tag(p))]):
            return dataclasses.replace(decision, reason=decision.reason + ", until its first eager call measures "
                                                                          "it (first-sight tuning)")
    return decision


def clear_cache() -> None:
    """Forget every cached decision, runner, weight plan and tuned table read (so a new table or
    environment variable takes effect everywhere, settled swapped layers included) and free this
    thread's workspace buffers."""
    configs.clear()
    tuned.clear()
    first_sight.forget()
    forget_decisions()


def forget_decisions() -> None:
    """Forget every cached decision, runner and weight plan (settled layers unsettle), keeping the tuned tables
    read and the entries this process added to them (:func:`tritonmm.tune_model` after measuring)."""
    routes.clear()
    runners.clear_cache()
    gated.clear_cache()
    norm_linear.clear_cache()
    decide.state_changed()


__all__ = ["clear_cache", "explain", "linear", "matmul"]
