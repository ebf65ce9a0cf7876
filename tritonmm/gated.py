"""The gated linear: ``act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)`` in fewer kernels.

This is the first half of a Llama-family MLP (gate and up projections, SiLU, product). Without autograd, on packed
weights (``w_up`` directly after ``w_gate``, as :func:`tritonmm.fuse` stores them) above :data:`GATED_MAX_M` rows and
from :data:`tritonmm.gated_cublas.PACKED_KERNEL_MIN_FLOPS` per projection, the gated GEMM on the packed weights
(:mod:`tritonmm.kernels.gated_packed`, Hopper GPUs) serves. Otherwise up to :data:`GATED_MAX_M`
rows, and without autograd up to :data:`KERNEL_MAX_FLOPS_NO_GRAD` per projection, the Triton GEMM kernels
(:mod:`tritonmm.kernels.gated`) read x once for both projections and write only the product, instead of two
projections, the activation and the product as four tensors. Above, from
:data:`PRODUCT_MIN_FLOPS` (:data:`PRODUCT_MIN_FLOPS_NO_GRAD` without autograd), cuBLAS runs the two projections and
one Triton pass (:mod:`tritonmm.gated_cublas`) the activation and the product, where eager runs two; smaller calls
run the torch expression. With packed weights (``w_up`` directly after ``w_gate`` in one storage, as
:func:`tritonmm.fuse` stores them; no biases) that path runs both projections as one GEMM.

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

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true as _known

from . import activations, device as _device, gated_cublas, gated_grads, gated_tuning, modes, routes, runners
from ._env import raw_name
from .gated_args import GATED_ACTIVATIONS, autocast as _autocast, check, kernel_shaped

__all__ = ["GATED_ACTIVATIONS", "gated_linear", "reference"]
_KERNEL_DTYPES = gated_cublas.KERNEL_DTYPES
GATED_MAX_M = 16
"""Rows (M) up to which the gated GEMM kernel on separate weights serves a call: decode-sized GEMMs, memory- and
launch-bound, where one kernel instead of four saves launches and a pass over the projections. Above it that kernel
ran slower than eager wherever the GPU set the pace (``benchmarks/h200_mlp.json``, ``kernel_ratio``)."""
PRODUCT_MIN_FLOPS = 2**35
"""FLOP per projection (2·M·N·K, 3.4e10) from which calls with autograd of more than :data:`GATED_MAX_M` rows
take the cuBLAS + product path; smaller ones run the torch expression (eager's kernels): the host sets the pace
there and the path costs more host time than its pass saves (``benchmarks/h200_mlp.json``)."""
PRODUCT_MIN_FLOPS_NO_GRAD = 2**37
"""FLOP per projection (1.4e11) from which calls without autograd on weights that are not packed take the product
path: an inference forward stays paced by the host to larger sizes than a training step, and the product pass's
launch costs host time (``benchmarks/h200_model.json``, ``diagnostics/h200_mlp_host_in_model.json``). Calls on
packed weights take the gated GEMM on them from :data:`tritonmm.gated_cublas.PACKED_KERNEL_MIN_FLOPS`."""
KERNEL_MAX_FLOPS_NO_GRAD = 2**34
"""FLOP per projection (2·M·N·K, 1.7e10) up to which calls without autograd of more than :data:`GATED_MAX_M` rows
run the gated GEMM kernel too, where this GPU's table or a first-sight measurement (:mod:`tritonmm.gated_tuning`)
picks it over the torch expression: faster there, slower above (``benchmarks/diagnostics/h200_gated_band.json``)."""
TMA_MIN_M = 64
"""Rows above which the persistent TMA kernel serves (on sm_90+, aligned operands; reached by
:func:`forward` callers that pass larger M); the pointer kernel's small-M tiles serve the rest."""
_LAUNCHERS_MAX = 1024
_launchers: dict = {}
_is_compiling = torch.compiler.is_compiling
_empty = torch.empty  # the kernels' output allocator (tests swap in a NaN-filling one)
_precision = torch.get_float32_matmul_precision  # (float32 launchers: TF32 or not, fixed when built)
_F32 = torch.float32


def reference(x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Optional[Tensor] = None,
              b_up: Optional[Tensor] = None, activation: str = "silu") -> Tensor:
    """The torch expression the gated linear computes (also its fallback)."""
    return activations.apply(F.linear(x, w_gate, b_gate), activation) * F.linear(x, w_up, b_up)


def kernel_serves(x: Tensor) -> bool:
    """Whether the Triton kernels serve this problem (any number of rows, :func:`forward`): dtype, device,
    a nonempty problem."""
    return x.numel() != 0 and gated_cublas.serves(x)


def _tma_ok(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def choose_kernel(x2: Tensor, w_gate: Tensor, w_up: Tensor) -> str:
    """"tma" for more than :data:`TMA_MIN_M` rows on sm_90+ with aligned operands, else "pointer"."""
    if x2.shape[0] > TMA_MIN_M and _device.has_tma(x2.device) and _tma_ok(x2, w_gate, w_up):
        return "tma"
    return "pointer"


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def forward(x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate, b_up, activation: str, save: bool,
            kernel: Optional[str] = None, config: Optional[dict] = None, pack: bool = True):
    """Run a :func:`kernel_shaped` call: (h, g, u), h of shape (*x.shape[:-1], N); g and u (M, N) when
    ``save``, else None. The gated GEMM ``kernel`` ("pointer" or "tma"; default: the pointer kernel) where
    :func:`kernel_rows` holds or ``kernel`` is given; else cuBLAS
    projections (one GEMM where the weights are packed and ``pack``; g and u are then the halves of its
    output) and the one-pass product."""
    from .kernels.launch import LAUNCH_FAILURES

    N, K = w_gate.shape
    lead = x.shape[:-1]
    M = lead.numel()
    if kernel is None and (not kernel_rows(M, N, K, save) or M > GATED_MAX_M and b_gate is None
                           and gated_cublas.packed_takes(x, w_gate, w_up, save)):
        return gated_cublas.forward(x, w_gate, w_up, b_gate, b_up, activation, save, pack)
    x2 = _unit_last(x.reshape(-1, K))
    w_gate, w_up = _unit_last(w_gate), _unit_last(w_up)
    auto = kernel is None and config is None
    if kernel is None:
        kernel = "pointer"  # (the kernel gated_tuning measures)
    elif kernel == "tma" and not _tma_ok(x2, w_gate, w_up):
        kernel = choose_kernel(x2, w_gate, w_up)
    key = _launcher_key(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config)
    launch = _launchers.get(key)
    if launch is None:
        launch, keep = _new_launcher(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config, auto)
        if keep:
            if len(_launchers) >= _LAUNCHERS_MAX:
                _launchers.clear()
            _launchers[key] = launch
    if launch is _TORCH:  # measured faster than the kernel here (gated_tuning)
        return _torch_forward(x, w_gate, w_up, b_gate, b_up, activation, save)
    out = _empty((*lead, N), dtype=x.dtype, device=x.device)  # not a view: in-place use stays allowed
    h = out.view(M, N)
    g = u = None
    if save:
        g = _empty((M, N), dtype=x.dtype, device=x.device)
        u = _empty((M, N), dtype=x.dtype, device=x.device)
    try:
        launch(x2, w_gate, w_up, b_gate, b_up, h, g, u)
    except LAUNCH_FAILURES as e:  # a config that does not compile or fit here: torch serves, once warned
        failed = functools.partial(_failed, activation=activation)
        if _launchers.get(key) is launch:  # (a launcher not kept, a decision deferred, stays undecided)
            _launchers[key] = failed
        warnings.warn(f"tritonmm.gated_linear: the {kernel} kernel failed ({type(e).__name__}: {e}); "
                      "torch serves this geometry", runners.KernelFailedWarning, stacklevel=3)
        failed(x2, w_gate, w_up, b_gate, b_up, h, g, u)
    return out, g, u


_TORCH = "torch"  # a launcher slot's value where the torch expression serves the geometry (gated_tuning)


def _torch_forward(x, w_gate, w_up, b_gate, b_up, activation, save):
    """:func:`forward`'s (h, g, u) from the torch expression: g and u the projections (M, N) with ``save``."""
    gate, up = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    h = activations.apply(gate, activation) * up
    M, N = x.shape[:-1].numel(), w_gate.shape[0]
    return (h, gate.reshape(M, N), up.reshape(M, N)) if save else (h, None, None)


def _new_launcher(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config, auto):
    """(launcher or :data:`_TORCH`, keep). Auto calls (no kernel or config given) take the config or torch
    decision of this GPU's table or a first-sight measurement (:func:`gated_tuning.choose`); ``keep``: False
    where that measurement is due at the next eager call."""
    from .kernels.gated_launchers import gated_launcher

    keep = True
    if auto:
        config, keep = gated_tuning.choose(kernel, x2, w_gate, b_gate is not None, activation)
        if config == _TORCH:
            return _TORCH, keep
    (M, K), N = x2.shape, w_gate.shape[0]
    bias_strides = None if b_gate is None else (b_gate.stride(0), b_up.stride(0))
    return gated_launcher(kernel, M, N, K, x2.stride(0), w_gate.stride(0), w_up.stride(0), x2.dtype, x2.device,
                          bias_strides, save, activation, config), keep


def _launcher_key(kernel, x2, w_gate, w_up, b_gate, b_up, save, activation, config) -> tuple:
    """What a gated launcher is built for: kernel, sizes, strides, dtype, device, epilogue, config, the
    operands' 16-byte alignment (Triton specializes every pointer on it) and, for float32, the matmul precision
    setting (TF32 or not, fixed when it is built)."""
    (M, K), N = x2.shape, w_gate.shape[0]
    bias_strides = None if b_gate is None else (b_gate.stride(0), b_up.stride(0))
    bias_aligned = b_gate is None or b_gate.data_ptr() % 16 == 0 and b_up.data_ptr() % 16 == 0
    return (kernel, M, N, K, x2.stride(0), w_gate.stride(0), w_up.stride(0), x2.dtype, x2.device, bias_strides, save,
            activation, None if config is None else tuple(sorted(config.items())),
            x2.data_ptr() % 16 == 0 and w_gate.data_ptr() % 16 == 0 and w_up.data_ptr() % 16 == 0, bias_aligned,
            x2.dtype is _F32 and _precision())


def _failed(x2, w_gate, w_up, b_gate, b_up, h, g, u, activation):
    """The torch expression written into the kernel's outputs (a geometry whose kernel failed)."""
    gate, up = F.linear(x2, w_gate, b_gate), F.linear(x2, w_up, b_up)
    h.copy_(activations.apply(gate.float(), activation) * up.float())
    if g is not None:
        g.copy_(gate)
        u.copy_(up)


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
        h, g, u = _torch_forward(x, w_gate, w_up, b_gate, b_up, activation, save)
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
_F_linear = F.linear
_any_autocast = torch._C._is_any_autocast_enabled
_INTERPRET = raw_name("TRITON_INTERPRET")
_cublas_forward = gated_cublas.forward


def _fast_key(x, wg, wu, bg, bu, activation):
    """The geometry key of a call that may take the fast path (None: it may not): plain eager mode, no
    gradient, no autocast, no pending negation (``x.conj().imag``) or storage-less zero tensor; types,
    shapes, strides, dtypes, devices, 16-byte alignments and, for float32, the matmul precision setting."""
    if _grad_enabled() and (x.requires_grad or wg.requires_grad or wu.requires_grad
                            or bg is not None and (bg.requires_grad or bu.requires_grad)):
        return None
    if (_any_autocast() or routes._functorch_active() or routes._fw_ad._current_level >= 0
            or routes._tracing_state() is not None or routes._function_modes() or routes._dispatch_modes()):
        return None
    px, pg, pu = x.data_ptr(), wg.data_ptr(), wu.data_ptr()
    if not (px and pg and pu) or x.is_neg() or wg.is_neg() or wu.is_neg():  # (a zero tensor's pointer is 0)
        return None
    if bg is not None and (not (bg.data_ptr() and bu.data_ptr()) or bg.is_neg() or bu.is_neg()):
        return None
    dtype = x.dtype
    return (type(x), type(wg), type(wu), x.shape, x.stride(), dtype, x.device, wg.shape, wg.stride(), wg.dtype,
            wg.device, wu.shape, wu.stride(), wu.dtype, wu.device, px & 15, pg & 15, pu & 15, activation,
            _bias_key(bg), _bias_key(bu), routes.raw_get(routes._AUTOTUNE), routes.raw_get(_INTERPRET),
            dtype is _F32 and _precision())  # (float32: TF32 or not, as its launcher was built)


def _bias_key(b):
    return None if b is None else (type(b), b.shape, b.stride(), b.dtype, b.device, b.data_ptr() & 15)


def _fast_eligible(x, wg, wu, bg, bu) -> bool:
    """Whether a call whose key was taken can be replayed by a bound launch: plain tensors the kernel
    serves, unit column strides, no pending negation or zero tensor."""
    tensors = (x, wg, wu, bg, bu)
    return (kernel_serves(x) and kernel_shaped(*tensors) and not _below_product_flops(x, wg, False, wu, bg)
            and modes.plain(*tensors) and modes.eager() and not modes.torch_only(*tensors) and wg.stride(-1) == 1
            and wu.stride(-1) == 1)


def _remember(key, x, wg, wu, bg, bu, activation) -> None:
    """Bind the geometry's launcher (built by the call just served) into a replay of that call."""
    N, K = wg.shape
    lead, M = x.shape[:-1], x.numel() // K if K else 0
    product = not kernel_rows(M, N, K, False) or M > GATED_MAX_M and bg is None \
        and gated_cublas.packed_takes(x, wg, wu, False)  # (replays serve calls without autograd)
    if product and bg is None and bu is None and wg.is_contiguous() and wu.is_contiguous():
        # (the key fixes the weights' strides) one GEMM where packed, one bound product launch
        run = gated_cublas.replay(x, wg, activation)
    elif product:
        def run(x, wg, wu, bg, bu):  # cuBLAS projections, one-pass product
            return _cublas_forward(x, wg, wu, bg, bu, activation, False)[0]
    else:
        x2 = x.reshape(-1, K)
        view = x2.data_ptr() == x.data_ptr()  # x is read in place: the launcher takes its pointer, strides bound
        contiguous = x2.stride(-1) != 1 and x2.shape[-1] != 1
        if contiguous:
            x2 = x2.contiguous()
        dtype, device, out_shape = x.dtype, x.device, (*lead, N)
        launch = _launchers.get(_launcher_key("pointer", x2, wg, wu, bg, bu, False, activation, None))
        if launch is None or isinstance(launch, functools.partial) or M == 0:  # not built, failed, or empty
            return
        if launch is _TORCH:  # measured faster than the kernel (gated_tuning)
            run = functools.partial(reference, activation=activation)
        elif view and not contiguous:  # (the key fixes x's shape and strides, so every call's x is such a view)
            def run(x, wg, wu, bg, bu):
                h = _empty(out_shape, dtype=dtype, device=device)  # contiguous: (M, N) in memory
                launch(x, wg, wu, bg, bu, h, None, None)
                return h
        else:
            def run(x, wg, wu, bg, bu):
                x2 = x.reshape(M, K)
                if contiguous:
                    x2 = x2.contiguous()
                h = _empty(out_shape, dtype=dtype, device=device)
                launch(x2, wg, wu, bg, bu, h, None, None)
                return h

    if len(_fast) >= _FAST_MAX:
        _fast.clear()
    _fast[key] = run


def clear_cache() -> None:
    """Forget the gated launchers and bound replays."""
    _fast.clear()
    _launchers.clear()
    gated_cublas.clear_cache()


def kernel_rows(M: int, N: int, K: int, grad: bool) -> bool:
    """Whether an M x N x K gated linear (per projection) is one the gated GEMM kernel may serve: up to
    :data:`GATED_MAX_M` rows, or up to :data:`KERNEL_MAX_FLOPS_NO_GRAD` for a call without autograd (``grad``
    False)."""
    return M <= GATED_MAX_M or not grad and 2 * M * N * K <= KERNEL_MAX_FLOPS_NO_GRAD


def _below_product_flops(x, w_gate, grad: bool, w_up=None, b_gate=None) -> bool:
    """More than :data:`GATED_MAX_M` rows, under :data:`PRODUCT_MIN_FLOPS` per projection for a call with autograd
    (``grad``), under :data:`PRODUCT_MIN_FLOPS_NO_GRAD` for one without, not :func:`kernel_rows` (static sizes) and
    not a call the gated GEMM on packed weights takes (:func:`gated_cublas.packed_takes`): the torch expression's
    calls."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    N = w_gate.shape[0]
    return 2 * rows * N * K < (PRODUCT_MIN_FLOPS if grad else PRODUCT_MIN_FLOPS_NO_GRAD) \
        and not kernel_rows(rows, N, K, grad) \
        and not (b_gate is None and rows > GATED_MAX_M and gated_cublas.packed_takes(x, w_gate, w_up, grad))


def torch_serves(x, w_gate, w_up=None) -> bool:
    """Whether an eager call is served by the torch expression (:data:`PRODUCT_MIN_FLOPS`,
    :data:`PRODUCT_MIN_FLOPS_NO_GRAD` where neither ``x`` nor ``w_gate`` needs a gradient, unless the gated GEMM on
    packed weights takes it), for callers that can run it more cheaply themselves (a fused module: its own
    forward; its gate has no bias where ``w_up`` is given)."""
    try:
        return _below_product_flops(x, w_gate, _grad_enabled() and (x.requires_grad or w_gate.requires_grad), w_up)
    except (AttributeError, IndexError, TypeError, RuntimeError):  # invalid operands: gated_linear raises
        return False


def _gated_linear(input, w_gate, w_up, b_gate, b_up, activation):
    """Every mode: validation, then the op, the autograd Function, the kernel or the torch expression."""
    check(input, w_gate, w_up, b_gate, b_up, activation)
    tensors = (input, w_gate, w_up, b_gate, b_up)
    if modes.is_compiling():  # decided at trace time; symbolic sizes take the torch expression (no guard)
        # (Dynamo reads a symbolic size as an int: only a bound provable without a guard takes the op)
        if input.dtype not in _KERNEL_DTYPES or not _known(input.numel() <= GATED_MAX_M * input.shape[-1]):
            return reference(*tensors, activation)  # traced: Inductor fuses the elementwise work
    elif modes.torch_only(*tensors) or routes._tracing_state() is not None:  # (jit tracing: the torch expression,
        return reference(*tensors, activation)  # which every run of the trace can take, with or without autograd)
    if torch._C._is_any_autocast_enabled():
        tensors = _autocast(*tensors)
    if not (kernel_serves(tensors[0]) and kernel_shaped(*tensors)):
        return reference(*tensors, activation)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if _below_product_flops(tensors[0], tensors[1], grad, tensors[2], tensors[3]):
        return reference(*tensors, activation)
    if not (modes.eager() and all(t is None or type(t) in modes.PLAIN for t in tensors)):
        return _gated_op(*tensors, activation, grad)[0]  # compile, export, subclasses, modes
    if grad:
        with torch._C._ExcludeDispatchKeyGuard(routes._AUTOCAST_KEYS):
            return _GatedFunction.apply(*tensors, activation)
    return forward(*tensors, activation, False)[0]
