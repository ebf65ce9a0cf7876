"""The gated linear above :data:`tritonmm.dispatch.gated.GATED_MAX_M` rows: cuBLAS runs the gate and up
projections, one Triton pass (:mod:`tritonmm.kernels.gated_product`) the activation and the product,
and in the backward one Triton pass both projections' gradients.

Where the up weight directly follows the gate weight in one allocation (:func:`packed`; what
:func:`tritonmm.fuse` arranges) both projections run as one cuBLAS GEMM on x @ [Wg; Wu]^T, and in the
backward both weights' gradients as one GEMM.

Where the packed weights' call is large enough (:data:`PACKED_KERNEL_MIN_FLOPS`) and the GPU has TMA (Hopper
and newer), the gated GEMM on the packed weights (:mod:`tritonmm.kernels.gated_packed`) replaces the cuBLAS GEMM
and the product pass: one kernel whose epilogue applies the activation and the product, so the (M, 2N)
projections are never written unless the backward needs them.

Eager PyTorch runs the activation and the product as two kernels and their backward as three; these
passes read each tensor once. Values in fp32, rounded once to the output dtype.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ..core import activations, modes
from ..core import device as _device
from ..core.env import interpreting
from ..core.layout import adjacent, stacked
from . import runners

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes the Triton kernels of the gated linear take."""
PACKED_KERNEL_MIN_FLOPS = 2**36
"""FLOP per projection (2·M·N·K, 6.9e10) from which a call on packed weights without autograd, of more than
:data:`tritonmm.dispatch.gated.GATED_MAX_M` rows, runs the gated GEMM on them (:mod:`tritonmm.kernels.gated_packed`)
instead of the torch expression or the cuBLAS GEMM and the product pass: faster there in the MLP and in a model's
prefill (``benchmarks/h100_mlp.json``; ``benchmarks/h100_model.json``, prefill 4 x 1024). Below, the kernel's GEMM
runs at 0.85x of cuBLAS's (Llama-3-8B widths, 512 rows: ``diagnostics/h100_gated_packed_variants.json``) and the
product pass it saves costs less than that: from 2^33, a Llama-3-8B-sized model's 1 x 512 prefill (6.0e10 per
projection) ran at 0.945x off (``diagnostics/h100_model_packed_2_33.json``). None: never."""
PACKED_KERNEL_SAVE = False
"""Whether calls that keep the projections for the backward run it too: they ran slower than the cuBLAS GEMM
and the product pass (``benchmarks/h200_mlp.json``); an epilogue storing G, U and H as three tiles reaches 1.01-1.02x
of that pair, about 0.3% of a training step (``diagnostics/h100_gated_packed_save.json``)."""
_PACKED_DTYPES = (torch.float16, torch.bfloat16)


def serves(t: torch.Tensor) -> bool:
    """Whether the product kernels take ``t``'s dtype and device (CUDA, or the CPU under the interpreter)."""
    return (t.is_cuda or t.is_cpu and interpreting()) and t.dtype in KERNEL_DTYPES


def packed(w_gate: torch.Tensor, w_up: torch.Tensor):
    """The (2N, K) tensor [w_gate; w_up], a view, where ``w_up`` directly follows ``w_gate`` in one storage
    (both contiguous, one shape and dtype; :func:`tritonmm.core.layout.stacked`), else None. Detached: callers
    return the weights' gradients themselves."""
    return stacked((w_gate, w_up)) if _pair(w_gate, w_up) else None


def is_packed(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """Whether :func:`packed` gives a tensor, without building it."""
    return _pair(w_gate, w_up) and adjacent((w_gate, w_up))


def _pair(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    return w_gate.shape == w_up.shape and w_gate.dim() == 2


_empty = torch.empty  # the product's output allocator (tests swap in a NaN-filling one)


def packed_size(M: int, N: int, K: int, save: bool) -> bool:
    """Whether an M x N x K call (per projection; keeping the projections with ``save``) is one the gated GEMM on
    packed weights takes (:data:`PACKED_KERNEL_MIN_FLOPS`, :data:`PACKED_KERNEL_SAVE`)."""
    flops = PACKED_KERNEL_MIN_FLOPS
    return flops is not None and 2 * M * N * K >= flops and (PACKED_KERNEL_SAVE or not save)


def packed_takes(x: torch.Tensor, w_gate: torch.Tensor, w_up, save: bool) -> bool:
    """Whether a call goes to the gated GEMM on packed weights: :func:`packed_size`, ``w_up`` directly after
    ``w_gate`` in one storage (:func:`packed`), float16 or bfloat16 on a GPU with TMA. (Alignment is checked when it
    runs: cuBLAS serves misaligned operands.)"""
    K = x.shape[-1]
    return w_up is not None and x.dtype in _PACKED_DTYPES and K != 0 \
        and packed_size(x.numel() // K, *w_gate.shape, save) and is_packed(w_gate, w_up) \
        and _device.has_tma(x.device)


def packed_kernel_serves(x2: torch.Tensor, w: torch.Tensor, save: bool, any_size: bool = False) -> bool:
    """Whether the gated GEMM on packed weights serves x2 (M, K) @ w^T, w = [Wg; Wu] (2N, K): :func:`packed_size`
    unless ``any_size``, float16 or bfloat16, TMA (sm_90+), unit column strides, 16-byte aligned bases and row
    strides, N % 8 == 0."""
    (M, K), N = x2.shape, w.shape[0] // 2
    if not (any_size or packed_size(M, N, K, save)) or x2.dtype not in _PACKED_DTYPES or w.dtype != x2.dtype:
        return False
    size = x2.element_size()
    return N % 8 == 0 and x2.stride(1) == 1 and w.stride(1) == 1 and (x2.stride(0) * size) % 16 == 0 \
        and (w.stride(0) * size) % 16 == 0 and x2.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 \
        and _device.has_tma(x2.device)


_packed_launchers: dict = {}
_LAUNCHERS_MAX = 1024


def _packed_launcher(key, x2, w, save, activation):
    """The bound launcher of :func:`tritonmm.kernels.packed_launchers.packed_launcher` for this geometry."""
    (M, K), N = x2.shape, w.shape[0] // 2
    launch = _packed_launchers.get(key)
    if launch is None:
        from ..kernels.packed_launchers import packed_launcher

        if len(_packed_launchers) >= _LAUNCHERS_MAX:
            _packed_launchers.clear()
        launch = _packed_launchers[key] = packed_launcher(M, N, K, x2.stride(0), w.stride(0), x2.dtype, x2.device,
                                                          save, activation)
    return launch


def _packed_kernel(x, x2, w, activation, save):
    """(h, g, u) from the gated GEMM on packed weights, or None where it failed here (warned once per
    geometry; cuBLAS serves it from then on)."""
    (M, K), N = x2.shape, w.shape[0] // 2
    key = (M, N, K, x2.stride(0), w.stride(0), x2.dtype, x2.device, save, activation)
    launch = _packed_launcher(key, x2, w, save, activation)
    if launch is _FAILED:
        return None
    h = _empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    gu = _empty((M, 2 * N), dtype=x.dtype, device=x.device) if save else None
    kernels = _kernels or _load()
    try:
        launch(x2, w, h.view(M, N), gu)
    except kernels.LAUNCH_FAILURES as e:
        _packed_launchers[key] = _FAILED
        warnings.warn(f"tritonmm.gated_linear: the gated GEMM on packed weights failed ({type(e).__name__}: {e}); "
                      "cuBLAS serves this geometry", runners.KernelFailedWarning, stacklevel=4)
        return None
    return (h, gu[:, :N], gu[:, N:]) if save else (h, None, None)


_FAILED = "failed"


def packed_kernel(x2, w, activation):
    """act(x2 @ Wg^T) * (x2 @ Wu^T) from the gated GEMM on packed weights w = [Wg; Wu], any size
    (:func:`packed_kernel_serves` with ``any_size``), for benchmarks; cuBLAS where it fails."""
    out = _packed_kernel(x2, x2, w, activation, False)
    return out[0] if out is not None else forward(x2, w[:w.shape[0] // 2], w[w.shape[0] // 2:], None, None,
                                                  activation, False, pack=False)[0]


def forward(x, w_gate, w_up, b_gate, b_up, activation, save, pack=True):
    """cuBLAS for both projections (one GEMM where the weights are :func:`packed`, ``pack`` allowing, and
    there are no biases), then one Triton pass for the activation and product (into the gate's buffer
    where two projections are not kept); on packed weights where :func:`packed_kernel_serves`, the gated GEMM
    on them instead."""
    M, N = x.shape[:-1].numel(), w_gate.shape[0]
    w = packed(w_gate, w_up) if pack and b_gate is None else None
    if w is not None:
        x2 = x.reshape(M, x.shape[-1])
        if packed_kernel_serves(x2, w, save):
            out = _packed_kernel(x, x2, w, activation, save)
            if out is not None:
                return out
        gu = torch.mm(x2, w.t())
        g, u = gu[:, :N], gu[:, N:]
        h = _empty((*x.shape[:-1], N), dtype=gu.dtype, device=gu.device)
        product(g, u, h.view(M, N), activation)
        return (h, g, u) if save else (h, None, None)
    g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    h = torch.empty_like(g) if save else g
    product(g, u, h, activation)
    return (h, g.view(M, N), u.view(M, N)) if save else (h, None, None)


def replay(x, w_gate, activation):
    """A bound :func:`forward` (no biases, nothing saved) for later calls of ``x``'s and ``w_gate``'s geometry
    (shapes, strides, dtypes and devices, which the caller's cache key fixes): where the weights are packed,
    one GEMM on x @ [Wg; Wu]^T and one bound launch of the product on its two halves, with no other tensor
    made on the way (or, at sizes where it may serve, the gated GEMM on the packed weights); else
    :func:`forward`."""
    N, K = w_gate.shape
    lead = x.shape[:-1]
    M, size, dtype, device = lead.numel(), w_gate.element_size(), x.dtype, x.device
    step, both, strides, out_shape = N * K * size, (2 * N, K), (K, 1), (*lead, N)
    if packed_size(M, N, K, False) and dtype in _PACKED_DTYPES and _device.has_tma(device):
        return _packed_replay(x, w_gate, activation)
    kernels = _kernels or _load()
    launch = kernels.halves_launcher(M, N, dtype, device, activation)

    def run(x, w_gate, w_up, b_gate, b_up):
        pg, pu = w_gate.data_ptr(), w_up.data_ptr()
        if pu != pg + step or pg - w_gate.storage_offset() * size != pu - w_up.storage_offset() * size:
            return forward(x, w_gate, w_up, b_gate, b_up, activation, False)[0]  # not packed
        gu = _F_linear(x, w_gate.as_strided(both, strides))  # (no autograd here: the caller's key has no gradient)
        h = _empty(out_shape, dtype=dtype, device=device)
        if not gu.is_contiguous():
            gu = gu.contiguous()
        if M:
            try:
                launch((gu, h, N))
            except kernels.LAUNCH_FAILURES as e:  # as in product(): torch serves, warned
                _torch_product(gu.view(M, 2 * N)[:, :N], gu.view(M, 2 * N)[:, N:], h.view(M, N), activation, e)
        return h

    return run


def _packed_replay(x, w_gate, activation):
    """A bound :func:`forward` at sizes where the gated GEMM on packed weights serves: its launcher, built by the call
    just served, launched with no check but the packing (the caller's key fixes shapes, strides, dtypes, devices and
    alignments); :func:`forward` where the weights no longer lie packed, x is not contiguous, or the launcher was not
    built or failed."""
    N, K = w_gate.shape
    lead = x.shape[:-1]
    M, size, dtype, device = lead.numel(), w_gate.element_size(), x.dtype, x.device
    step, out_shape = N * K * size, (*lead, N)
    launch = _packed_launchers.get((M, N, K, K, K, dtype, device, False, activation)) if x.is_contiguous() else None
    failures = (_kernels or _load()).LAUNCH_FAILURES
    bound = launch is not None and launch is not _FAILED and M > 0 and w_gate.is_contiguous()

    def run(x, w_gate, w_up, b_gate, b_up):
        pg, pu = w_gate.data_ptr(), w_up.data_ptr()
        if not bound or pu != pg + step or pg - w_gate.storage_offset() * size != pu - w_up.storage_offset() * size:
            return forward(x, w_gate, w_up, b_gate, b_up, activation, False)[0]
        h = _empty(out_shape, dtype=dtype, device=device)
        try:
            launch(x, w_gate, h, None)  # (the kernel takes base pointers: x as (M, K), w_gate's as [Wg; Wu]'s)
        except failures:  # (forward launches it again: it warns, and cuBLAS serves the geometry from then on)
            return forward(x, w_gate, w_up, b_gate, b_up, activation, False)[0]
        return h

    return run


_F_linear = F.linear
_kernels = None  # tritonmm.kernels.gated_product, imported on first use (import tritonmm imports no Triton)


def _load():
    global _kernels
    from ..kernels import gated_product

    _kernels = gated_product
    return _kernels


def product(g, u, h, activation) -> None:
    """``h = act(g) * u`` in one pass (tensors of one size, dtype and device: contiguous, ``h`` may be ``g``;
    or ``g`` and ``u`` the halves of one (M, 2N) tensor and ``h`` contiguous)."""
    if not g.numel():
        return
    kernels = _kernels or _load()
    try:
        kernels.gated_product(g, u, h, activation)
    except kernels.LAUNCH_FAILURES as e:  # (not seen: an elementwise kernel) torch serves, warned
        _torch_product(g, u, h, activation, e)


def _torch_product(g, u, h, activation, e) -> None:
    warnings.warn(f"tritonmm.gated_linear: the gated product kernel failed ({type(e).__name__}: {e}); "
                  "torch computes it", runners.KernelFailedWarning, stacklevel=5)
    h.copy_(activations.apply(g.float(), activation) * u.float())


def halves(g, u) -> bool:
    """Whether ``g`` and ``u`` (M, N) are the two halves of one (M, 2N) row-major tensor."""
    if g.dim() != 2 or g.stride(1) != 1 or u.stride(1) != 1:
        return False
    N = g.shape[1]
    return g.stride(0) == u.stride(0) == 2 * N and u.data_ptr() == g.data_ptr() + N * g.element_size()


def grads(dh, g, u, activation, needs):
    """(d_gate, d_up, both) from the upstream gradient ``dh`` and the saved projections: one Triton pass where
    the kernels serve the tensors, else torch's formulas. Where ``g`` and ``u`` are the :func:`halves` of one
    tensor, so are the gradients, of ``both`` (M, 2N); else ``both`` is None."""
    split = halves(g, u)
    if serves(g) and g.numel() and (split or g.is_contiguous() and u.is_contiguous()) \
            and dh.dtype == g.dtype == u.dtype and dh.device == g.device and modes.plain(dh, g, u) \
            and not modes.torch_only(dh) and modes.eager():
        dh = dh.contiguous()
        M, N = g.shape
        both = torch.empty((M, 2 * N), dtype=g.dtype, device=g.device) if split else None
        d_gate, d_up = (both[:, :N], both[:, N:]) if both is not None else (torch.empty_like(g), torch.empty_like(u))
        (_kernels or _load()).gated_product_backward(dh, g, u, d_gate, d_up, activation)
        return d_gate, d_up, both
    with torch.enable_grad():
        g_ = g.detach().requires_grad_()
        act = activations.apply(g_, activation)
    d_gate = torch.autograd.grad(act, g_, dh * u)[0] if any(needs[i] for i in (0, 1, 3)) else None
    d_up = dh * act.detach() if any(needs[i] for i in (0, 2, 4)) else None
    return d_gate, d_up, None


def grads_into(dh, g, u, activation, dg=None, du=None) -> None:
    """Both projections' gradients, and the product over ``dh``, in one Triton pass: ``dg = dh * u * act'(g)`` and
    ``du = dh * act(g)`` (by default over ``g`` and ``u``, each element read before it is written), and ``dh``
    becomes ``act(g) * u`` as :func:`product` rounds it. ``g`` and ``u`` are the :func:`halves` of one tensor, so
    are ``dg`` and ``du``; ``dh`` is contiguous; one dtype and device the kernels take."""
    if g.numel():
        (_kernels or _load()).gated_product_backward(dh, g, u, g if dg is None else dg, u if du is None else du,
                                                     activation, h_over_dh=True)


def clear_cache() -> None:
    """Forget the product kernels' and the packed kernel's bound launchers."""
    _packed_launchers.clear()
    if _kernels is not None:
        _kernels.clear_cache()
