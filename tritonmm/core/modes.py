"""Which calls may skip the torch.library dispatcher: plain tensors in plain eager mode.

The custom ops (:mod:`tritonmm.ops`) serve every mode (torch.compile, export, jit tracing, tensor
subclasses such as DTensor, torch function and dispatch modes). Where none of those is active and
the operands are plain strided tensors, the Python API calls the runners (or torch) directly.
Calls torch must answer itself (functorch transforms, forward-mode AD, nested tensors, the older
vmap of batched gradients) go to torch.matmul / F.linear, which support them.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _fw_ad

PLAIN = (torch.Tensor, torch.nn.Parameter)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
# the older vmap behind autograd.grad(is_grads_batched=True) and jacobian/hessian(vectorize=True):
# its batched tensors are plain torch.Tensor without storage, invisible to the functorch check
_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)
_tracing_state = torch._C._get_tracing_state
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
is_compiling = torch.compiler.is_compiling


def torch_only(*tensors) -> bool:
    """Whether torch.matmul / F.linear must answer this call itself: functorch transforms (vmap, grad,
    jvp, ...), forward-mode AD, batched gradients or nested tensors, which the custom ops do not support."""
    if _functorch_active() or _fw_ad._current_level >= 0:
        return True
    compiling = is_compiling()  # (Dynamo cannot trace the legacy-batched check)
    for t in tensors:
        if t is not None and (t.is_nested or not compiling and _legacy_batched(t)):
            return True
    return False


_DISABLED_TF = torch._C._disabled_torch_function_impl
_DEFAULT_TF = torch.Tensor.__torch_function__.__func__


def own_torch_function(*tensors) -> bool:
    """Whether a tensor's class defines its own ``__torch_function__`` (as quantized-weight subclasses do to
    serve F.linear / torch.matmul themselves): such calls go to the torch function, not to the op."""
    for t in tensors:
        if t is not None and type(t) not in PLAIN:
            tf = type(t).__torch_function__
            if tf is not _DISABLED_TF and getattr(tf, "__func__", None) is not _DEFAULT_TF:
                return True
    return False


def eager() -> bool:
    """Plain eager mode: no torch.compile or jit tracing, no torch function or dispatch mode."""
    if is_compiling() or _tracing_state() is not None:
        return False
    return not (_function_modes() or _dispatch_modes())


def plain(*tensors) -> bool:
    """Plain strided CPU or CUDA tensors (or None), with no pending negation and not a zero tensor:
    what the runners read as raw memory."""
    for t in tensors:
        if t is not None and (type(t) not in PLAIN or t.device.type not in ("cpu", "cuda") or unusual(t)):
            return False
    return True


_STRIDED = torch.strided


def unusual(t: torch.Tensor) -> bool:
    """Tensors the kernels must not read as raw strided memory: sparse (and other layouts), a pending
    negation (``is_neg()``: views such as ``x.conj().imag``) or an efficient zero tensor (no storage)."""
    return t.layout is not _STRIDED or t.is_neg() or t._is_zerotensor()
