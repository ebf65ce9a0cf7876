"""The gated linear ``act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)`` in every mode: the entry point
:func:`gated_linear`, the op ``tritonmm::gated_linear`` and its autograd. Which path serves a call by its size (the
gated GEMM kernels, cuBLAS projections and a one-pass product, the torch expression) is decided and launched by
:mod:`tritonmm.dispatch.gated`.

Autograd: where a gradient is needed the forward also stores the two projections (rounded to the
output dtype, as F.linear's outputs are); the backward uses them (no recomputation): one Triton pass
computes both projections' gradients from them, and its four GEMMs run on cuBLAS, the input's
gradient as one addmm. A backward with ``create_graph=True`` (double backward) differentiates the
torch expression, recomputed. Under ``torch.autocast`` the inputs are cast as F.linear casts them, on each
call (the weights too: torch's autocast reuses a leaf's cast within a region). Plain eager calls launch the
kernel directly; other modes (``torch.compile``, ``torch.export``, tensor subclasses) go through the
``tritonmm::gated_linear`` op (under ``torch.compile`` for sizes known at trace time to be at most
``GATED_MAX_M`` rows; other traced calls record the torch expression, which Inductor fuses, without a guard on
their size); functorch transforms, jit tracing, float64, devices other than CUDA (or the interpreter's CPU) and
empty problems are served by the torch expression itself.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true as _known

from ..core import modes
from ..core.env import raw_get, raw_name
from ..dispatch import gated as gated_paths
from ..dispatch import gated_cublas
from ..dispatch.gated import below_product_flops, forward, kernel_serves, reference, replay, torch_forward
from . import gated_grads
from .eager import AUTOCAST_KEYS
from .gated_args import GATED_ACTIVATIONS, check, kernel_shaped
from .gated_args import autocast as _autocast

__all__ = ["GATED_ACTIVATIONS", "gated_linear"]
_KERNEL_DTYPES = gated_cublas.KERNEL_DTYPES
_is_compiling = torch.compiler.is_compiling
_precision = torch.get_float32_matmul_precision  # (float32 launchers: TF32 or not, fixed when built)
_F32 = torch.float32


class _GatedFunction(torch.autograd.Function):
    """The gated linear in eager mode with autograd: kernel forward, saved projections, cuBLAS backward."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, b_gate, b_up, activation):
        h, g, u = forward(x, w_gate, w_up, b_gate, b_up, activation, True)
        gated_grads.save(ctx, x, w_gate, w_up, b_gate, b_up, g, u)
        ctx.activation = activation
        return h

    @staticmethod
    def backward(ctx, grad_h):
        return (*gated_grads.saved_backward(ctx, grad_h), None)


@torch.library.custom_op("tritonmm::gated_linear", mutates_args=())
def _gated_op(x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Optional[Tensor], b_up: Optional[Tensor],
              activation: str, save: bool) -> tuple[Tensor, Tensor, Tensor]:
    if not (kernel_serves(x) and kernel_shaped(x, w_gate, w_up, b_gate, b_up)):
        h, g, u = torch_forward(x, w_gate, w_up, b_gate, b_up, activation, save)
    else:
        h, g, u = forward(x, w_gate, w_up, b_gate, b_up, activation, save, pack=not save)  # (outputs alias nothing)
    return (h, g, u) if save else (h, x.new_empty(0), x.new_empty(0))


@_gated_op.register_fake
def _gated_fake(x, w_gate, w_up, b_gate, b_up, activation, save):
    N = w_gate.shape[0]
    h = x.new_empty((*x.shape[:-1], N))
    if not save:
        return h, x.new_empty(0), x.new_empty(0)
    M = x.numel() // x.shape[-1] if x.shape[-1] else x.shape[:-1].numel()
    return h, x.new_empty((M, N)), x.new_empty((M, N))


def _op_setup_context(ctx, inputs, output):  # every input saved: traced graphs choose what they keep
    x, w_gate, w_up, b_gate, b_up, activation, save = inputs
    ctx.save_for_backward(x, w_gate, w_up, b_gate, b_up, output[1], output[2])
    ctx.x_shape = x.shape
    ctx.activation = activation


def _op_backward(ctx, grad_h, _grad_g, _grad_u):
    return (*gated_grads.saved_backward(ctx, grad_h), None, None)


_gated_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def gated_linear(input: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Optional[Tensor] = None,
                 b_up: Optional[Tensor] = None, activation: str = "silu") -> Tensor:
    """``act(F.linear(input, w_gate, b_gate)) * F.linear(input, w_up, b_up)`` in fewer kernels: one Triton GEMM
    for both projections up to 16 rows, and without autograd up to :data:`KERNEL_MAX_FLOPS_NO_GRAD` per projection
    (where it was measured faster than the torch expression); above, cuBLAS projections and one Triton pass for the
    activation and product from :data:`PRODUCT_MIN_FLOPS` per projection (:data:`PRODUCT_MIN_FLOPS_NO_GRAD`
    without autograd), the torch expression below.

    Args:
        input (Tensor): x, (*, K); float16, bfloat16 or float32 for the Triton kernels.
        w_gate, w_up (Tensor): (N, K) each (nn.Linear weights), read in place; where ``w_up`` directly
            follows ``w_gate`` in one storage (``w[:N]`` and ``w[N:]`` of one (2N, K) weight), calls that
            run the projections on cuBLAS run both as one GEMM.
        b_gate, b_up (Tensor, optional): (N,) each; both or neither for the kernels (one alone, or
            other shapes F.linear takes, run the torch expression).
        activation (str): "silu" (Llama, Mistral, Qwen2), "gelu", "gelu_tanh" (Gemma) or "relu",
            applied to the gate in fp32 before the product and the one rounding.

    Returns:
        Tensor: (*, N) in the input dtype (the autocast dtype under ``torch.autocast``).

    Raises:
        TypeError: an argument is not a Tensor. ValueError: unknown activation.
        RuntimeError: shapes, dtypes or devices do not match (as F.linear's errors).
    """
    if not _is_compiling():
        try:
            key = _fast_key(input, w_gate, w_up, b_gate, b_up, activation)
            run = _fast.get(key) if key is not None else None
        except (AttributeError, RuntimeError, TypeError):  # a non-tensor, nested or storage-less operand
            key = run = None
        if run is not None:
            return run(input, w_gate, w_up, b_gate, b_up)
        out = _gated_linear(input, w_gate, w_up, b_gate, b_up, activation)
        if key is not None and _fast_eligible(input, w_gate, w_up, b_gate, b_up):
            _remember(key, input, w_gate, w_up, b_gate, b_up, activation)
        return out
    return _gated_linear(input, w_gate, w_up, b_gate, b_up, activation)


_fast: dict = {}
_FAST_MAX = 1024
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_AUTOTUNE, _INTERPRET = raw_name("TRITONMM_AUTOTUNE"), raw_name("TRITON_INTERPRET")


def _fast_key(x, wg, wu, bg, bu, activation):
    """The geometry key of a call that may take the fast path (None: it may not): plain eager mode, no
    gradient, no autocast, no pending negation (``x.conj().imag``) or storage-less zero tensor; types,
    shapes, strides, dtypes, devices, 16-byte alignments and, for float32, the matmul precision setting."""
    if _grad_enabled() and (x.requires_grad or wg.requires_grad or wu.requires_grad
                            or bg is not None and (bg.requires_grad or bu.requires_grad)):
        return None
    if (_any_autocast() or modes._functorch_active() or modes._fw_ad._current_level >= 0
            or modes._tracing_state() is not None or modes._function_modes() or modes._dispatch_modes()):
        return None
    px, pg, pu = x.data_ptr(), wg.data_ptr(), wu.data_ptr()
    if not (px and pg and pu) or x.is_neg() or wg.is_neg() or wu.is_neg():  # (a zero tensor's pointer is 0)
        return None
    if bg is not None and (not (bg.data_ptr() and bu.data_ptr()) or bg.is_neg() or bu.is_neg()):
        return None
    dtype = x.dtype
    return (type(x), type(wg), type(wu), x.shape, x.stride(), dtype, x.device, wg.shape, wg.stride(), wg.dtype,
            wg.device, wu.shape, wu.stride(), wu.dtype, wu.device, px & 15, pg & 15, pu & 15, activation,
            _bias_key(bg), _bias_key(bu), raw_get(_AUTOTUNE), raw_get(_INTERPRET),
            dtype is _F32 and _precision())  # (float32: TF32 or not, as its launcher was built)


def _bias_key(b):
    return None if b is None else (type(b), b.shape, b.stride(), b.dtype, b.device, b.data_ptr() & 15)


def _fast_eligible(x, wg, wu, bg, bu) -> bool:
    """Whether a call whose key was taken can be replayed by a bound launch: plain tensors the kernel
    serves, unit column strides, no pending negation or zero tensor."""
    tensors = (x, wg, wu, bg, bu)
    return (kernel_serves(x) and kernel_shaped(*tensors) and not below_product_flops(x, wg, False, wu, bg)
            and modes.plain(*tensors) and modes.eager() and not modes.torch_only(*tensors) and wg.stride(-1) == 1
            and wu.stride(-1) == 1)


def _remember(key, x, wg, wu, bg, bu, activation) -> None:
    """Keep a replay of the call just served for its geometry (:func:`tritonmm.dispatch.gated.replay`)."""
    run = replay(x, wg, wu, bg, bu, activation)
    if run is None:
        return
    if len(_fast) >= _FAST_MAX:
        _fast.clear()
    _fast[key] = run


def clear_cache() -> None:
    """Forget the bound replays, the gated launchers and the product kernels' launchers."""
    _fast.clear()
    gated_paths.clear_cache()


def _gated_linear(input, w_gate, w_up, b_gate, b_up, activation):
    """Every mode: validation, then the op, the autograd Function, the kernel or the torch expression."""
    check(input, w_gate, w_up, b_gate, b_up, activation)
    tensors = (input, w_gate, w_up, b_gate, b_up)
    if modes.is_compiling():  # decided at trace time; symbolic sizes take the torch expression (no guard)
        # (Dynamo reads a symbolic size as an int: only a bound provable without a guard takes the op)
        if input.dtype not in _KERNEL_DTYPES or not _known(input.numel() <= gated_paths.GATED_MAX_M * input.shape[-1]):
            return reference(*tensors, activation)  # traced: Inductor fuses the elementwise work
    elif modes.torch_only(*tensors) or modes._tracing_state() is not None:  # (jit tracing: the torch expression,
        return reference(*tensors, activation)  # which every run of the trace can take, with or without autograd)
    if torch._C._is_any_autocast_enabled():
        tensors = _autocast(*tensors)
    if not (kernel_serves(tensors[0]) and kernel_shaped(*tensors)):
        return reference(*tensors, activation)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if below_product_flops(tensors[0], tensors[1], grad, tensors[2], tensors[3]):
        return reference(*tensors, activation)
    if not (modes.eager() and all(t is None or type(t) in modes.PLAIN for t in tensors)):
        return _gated_op(*tensors, activation, grad)[0]  # compile, export, subclasses, modes
    if grad:
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_KEYS):
            return _GatedFunction.apply(*tensors, activation)
    return forward(*tensors, activation, False)[0]
