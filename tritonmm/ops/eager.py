"""The ops' eager calls in every mode, for calls the keyed routes (:mod:`tritonmm.ops.routes`) do not serve: torch
itself (functorch transforms, forward-mode AD, nested tensors, subclasses with their own ``__torch_function__``), the
``torch.library`` op (torch.fx proxies, compile, export, tensor subclasses, torch function and dispatch modes), an
autograd Function over the runner (plain eager tensors that need a gradient: :mod:`tritonmm.ops.grads` formulas), or
the runner (:mod:`tritonmm.dispatch.runners`). Also the argument checks and autocast casts the entry points share.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx import Proxy as _Proxy

from ..core import modes
from ..dispatch import runners
from . import grads

_any_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch.is_grad_enabled
AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCPU)


def autocast_dtype(t: Tensor):
    """The autocast dtype of ``t``'s device type, or None where autocast is off there."""
    device_type = "cuda" if t.is_cuda else "cpu"  # (other device types never reach a Triton kernel)
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def cast(t, dtype):
    """An autocast cast, as torch's autocast casts matmul / linear inputs (floating, not float64).

    Weights too are cast on every call, as F.linear casts them on its first use in an autocast region
    (torch reuses a leaf's cast within one region and clears its cache when the region ends; a cache
    of tritonmm's own would outlive the region and could serve a stale cast after ``param.data``
    changes in place)."""
    if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t


class _MatmulFunction(torch.autograd.Function):
    """``tritonmm::matmul`` in eager mode with autograd: the runner forward, :mod:`tritonmm.ops.grads` backward."""

    @staticmethod
    def forward(ctx, a, b):  # ctx-style forward: Function.apply binds no signature per call
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_KEYS):  # inputs are cast already
            out = runners.matmul(a, b)
        grads.matmul_setup_context(ctx, (a, b), out)
        return out

    backward = staticmethod(grads.matmul_backward)


class _LinearFunction(torch.autograd.Function):
    """``tritonmm::linear`` in eager mode with autograd: the runner forward, :mod:`tritonmm.ops.grads` backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_KEYS):
            out = runners.linear(x, weight, bias, activation)
        grads.linear_setup_context(ctx, (x, weight, bias, activation), out)
        return out

    backward = staticmethod(grads.linear_backward)


def needs_grad(*tensors) -> bool:
    if not _grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def fx_proxy(*args) -> bool:
    """Whether torch.fx's symbolic tracer is passing Proxies: the op is then recorded in its graph."""
    return any(isinstance(t, _Proxy) for t in args)


def matmul_slow(a: Tensor, b: Tensor) -> Tensor:
    """Every mode: torch itself, the op, the autograd Function or the runner."""
    if fx_proxy(a, b):
        return torch.ops.tritonmm.matmul(a, b)
    require_tensor("input", a, "matmul")
    require_tensor("other", b, "matmul")
    if modes.torch_only(a, b) or modes.own_torch_function(a, b) and not modes.is_compiling():
        return torch.matmul(a, b)
    if not (modes.eager() and modes.plain(a, b)):
        return torch.ops.tritonmm.matmul(a, b)
    if _any_autocast():
        dtype = autocast_dtype(a)
        if dtype is not None:
            a, b = cast(a, dtype), cast(b, dtype)
    if needs_grad(a, b):
        return _MatmulFunction.apply(a, b)
    return runners.matmul(a, b)


def linear_slow(x: Tensor, weight: Tensor, bias, activation: str) -> Tensor:
    """As :func:`_matmul_slow`, for linear."""
    if fx_proxy(x, weight, bias):
        return torch.ops.tritonmm.linear(x, weight, bias, activation)
    require_tensor("input", x, "linear")
    require_tensor("weight", weight, "linear")
    if bias is not None:
        require_tensor("bias", bias, "linear")
    if modes.torch_only(x, weight, bias) or modes.own_torch_function(x, weight, bias) and not modes.is_compiling() \
            or bias is not None and bias.dim() > 1:  # a broadcast bias (shapes.torch_form): F.linear's own
        # autograd, autocast and modes serve it; the activation out of place
        return runners.torch_linear(x, weight, bias, activation, inplace=False)
    if not (modes.eager() and modes.plain(x, weight, bias)):
        return torch.ops.tritonmm.linear(x, weight, bias, activation)
    if _any_autocast():
        dtype = autocast_dtype(x)
        if dtype is not None:
            x, weight, bias = cast(x, dtype), cast(weight, dtype), cast(bias, dtype)
    if needs_grad(x, weight, bias):
        return _LinearFunction.apply(x, weight, bias, activation)
    return runners.linear(x, weight, bias, activation)


def require_tensor(name: str, value, op: str, torch_name: str = "") -> None:
    """Raise TypeError unless ``value``, argument ``name`` of ``tritonmm.<op>``, is a Tensor (the message also names
    ``torch_name``, torch's name of the argument, where it differs)."""
    if not isinstance(value, Tensor):
        also = f" (torch's '{torch_name}')" if torch_name else ""
        raise TypeError(f"tritonmm.{op}(): argument '{name}'{also} must be Tensor, not {type(value).__name__}")
