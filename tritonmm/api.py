"""Python entry points: thin, documented wrappers over the torch.library ops."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad as _fw_ad

from . import dispatch, engine, ops

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled())
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
# the older vmap behind autograd.grad(is_grads_batched=True) and jacobian/hessian(vectorize=True):
# its batched tensors are plain torch.Tensor without storage, invisible to the functorch check
_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


def _require_tensor(name: str, value, op: str) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"tritonmm.{op}(): argument '{name}' must be Tensor, not {type(value).__name__}")


def _torch_only(*tensors) -> bool:
    """Whether this call must be answered by torch itself: functorch transforms (vmap, grad, jvp, ...),
    forward-mode AD (``torch.autograd.forward_ad``), batched gradients (the older vmap of
    ``is_grads_batched=True`` / ``vectorize=True``) or nested tensors. The custom ops support none
    of them, while torch.matmul / F.linear support them all."""
    if _functorch_active() or _fw_ad._current_level >= 0:
        return True
    compiling = torch.compiler.is_compiling()  # (Dynamo cannot trace the legacy-batched check)
    for t in tensors:
        if t is not None and (t.is_nested or not compiling and _legacy_batched(t)):
            return True
    return False


def _eager() -> bool:
    """Whether the call is plain eager mode: no torch.compile or jit tracing, no torch function or
    dispatch mode. Only then may the calls below skip the torch.library op."""
    if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:  # compile, jit.trace
        return False
    return not (torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())


def _eager_fast_path(*tensors) -> bool:
    """Whether the op's implementation can be called directly, skipping the dispatcher's Python layers.

    True only when the dispatcher would add nothing: plain tensors that need no gradient and no
    autocast (called in :func:`_eager` mode, after :func:`_torch_only`, which takes functorch
    transforms). The result is the same either way; this saves tens of µs per call.
    """
    if _any_autocast():  # (functorch transforms never get here: see _torch_only)
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or grad and t.requires_grad):
            return False
    return True


_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCPU)


def _eager_autograd_path(*tensors) -> bool:
    """Whether the call can run as a plain ``torch.autograd.Function`` instead of the custom op: plain
    tensors on CPU or CUDA (called in :func:`_eager` mode), with autograd and/or autocast involved
    (else :func:`_eager_fast_path` applies).

    The Function runs the same implementation and the same gradient formulas (:mod:`tritonmm.ops`)
    and casts under autocast as the op's autocast rule does; it skips the torch.library dispatcher's
    Python layers, which cost 40-150 µs per call and per backward on a CPU host (more on the H200's).
    """
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.device.type not in ("cpu", "cuda")):
            return False
    return True


def _autocast_inputs(tensors):
    """The inputs as the op's autocast rule would pass them on (floating, not float64, cast to the
    autocast dtype of their device type), or unchanged outside autocast."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(ops._autocast_cast(t, dtype) for t in tensors)


class _MatmulFunction(torch.autograd.Function):
    """``tritonmm::matmul`` for eager autograd/autocast calls (see :func:`_eager_autograd_path`)."""

    @staticmethod
    def forward(ctx, a, b):  # ctx-style forward: Function.apply binds no signature per call
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):  # the op's implementation runs below autocast
            out = engine.matmul(a, b)
        ops._matmul_setup_context(ctx, (a, b), out)
        return out

    backward = staticmethod(ops._matmul_backward)


class _LinearFunction(torch.autograd.Function):
    """``tritonmm::linear`` for eager autograd/autocast calls (see :func:`_eager_autograd_path`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            out = engine.linear(x, weight, bias, activation)
        ops._linear_setup_context(ctx, (x, weight, bias, activation), out)
        return out

    backward = staticmethod(ops._linear_backward)


def matmul(input: Tensor, other: Tensor) -> Tensor:
    """Matrix product with ``torch.matmul`` semantics; the GEMM runs in an autotuned Triton kernel.

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

    Falls back to torch.matmul (cuBLAS) where :func:`explain` says so: CPU tensors (outside
    ``TRITON_INTERPRET=1``), unsupported dtypes, fp32 without TF32, tiny problems, batched
    GEMMs, and shapes where the tuned table measured cuBLAS faster. Sparse, nested, neg-bit
    and zero tensors, functorch transforms and forward-mode AD are handed to torch.matmul itself.
    """
    a, b = input, other
    _require_tensor("input", a, "matmul")
    _require_tensor("other", b, "matmul")
    if _torch_only(a, b):
        return torch.matmul(a, b)
    if _eager():
        if _eager_fast_path(a, b):
            return engine.matmul(a, b)
        if _eager_autograd_path(a, b):
            return _MatmulFunction.apply(*_autocast_inputs((a, b)))
    return torch.ops.tritonmm.matmul(a, b)


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    """``activation(F.linear(x, weight, bias))`` as one GEMM with a fused epilogue.

    Args:
        input (Tensor): x, (*, K), float16/bfloat16/float32; any leading shape and strides.
        weight (Tensor): (N, K), read in its own layout (no transpose copy).
        bias (Tensor, optional): (N,), same dtype as x; added to the fp32 accumulator.
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
    x = input
    _require_tensor("input", x, "linear")
    _require_tensor("weight", weight, "linear")
    if bias is not None:
        _require_tensor("bias", bias, "linear")
    if _torch_only(x, weight, bias):  # under autograd / functorch: activation out of place
        return engine.torch_linear(x, weight, bias, activation, inplace=False)
    if _eager():
        if _eager_fast_path(x, weight, bias):
            return engine.linear(x, weight, bias, activation)
        if _eager_autograd_path(x, weight, bias):
            x, weight, bias = _autocast_inputs((x, weight, bias))
            return _LinearFunction.apply(x, weight, bias, activation)
    return torch.ops.tritonmm.linear(x, weight, bias, activation)


def explain(a: Tensor, b: Tensor) -> dispatch.Decision:
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
    _require_tensor("a", a, "explain")
    _require_tensor("b", b, "explain")
    if _torch_only(a, b):
        return dispatch.Decision("torch", None, "functorch transform, forward-mode AD or nested tensor: "
                                                "torch.matmul itself serves the call")
    if engine._unusual(a) or engine._unusual(b):
        return dispatch.Decision("torch", None, "sparse, neg-bit (e.g. x.conj().imag) or zero tensor: "
                                                "torch.matmul itself serves the call")
    if _any_autocast():
        a, b = _autocast_inputs((a, b))
    return engine.lookup(a, b, None, "none", "matmul").decision


__all__ = ["explain", "linear", "matmul", "ops"]
