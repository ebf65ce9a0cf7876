"""The gated linear above :data:`tritonmm.gated.GATED_MAX_M` rows: cuBLAS runs the gate and up
projections, one Triton pass (:mod:`tritonmm.kernels.gated_product`) the activation and the product,
and in the backward one Triton pass both projections' gradients.

Where the up weight directly follows the gate weight in one allocation (:func:`packed`; what
:func:`tritonmm.fuse` arranges) both projections run as one cuBLAS GEMM on x @ [Wg; Wu]^T, and in the
backward both weights' gradients as one GEMM.

Eager PyTorch runs the activation and the product as two kernels and their backward as three; these
passes read each tensor once. Values in fp32, rounded once to the output dtype.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from . import activations, modes, runners
from ._env import interpreting
from .packing import stacked

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes the Triton kernels of the gated linear take."""


def serves(t: torch.Tensor) -> bool:
    """Whether the product kernels take ``t``'s dtype and device (CUDA, or the CPU under the interpreter)."""
    return (t.is_cuda or t.is_cpu and interpreting()) and t.dtype in KERNEL_DTYPES


def packed(w_gate: torch.Tensor, w_up: torch.Tensor):
    """The (2N, K) tensor [w_gate; w_up], a view, where ``w_up`` directly follows ``w_gate`` in one storage
    (both contiguous, one shape and dtype; :func:`tritonmm.packing.stacked`), else None. Detached: callers
    return the weights' gradients themselves."""
    if w_gate.shape != w_up.shape or w_gate.dim() != 2:
        return None
    return stacked((w_gate, w_up))


_empty = torch.empty  # the product's output allocator (tests swap in a NaN-filling one)


def forward(x, w_gate, w_up, b_gate, b_up, activation, save, pack=True):
    """cuBLAS for both projections (one GEMM where the weights are :func:`packed`, ``pack`` allowing, and
    there are no biases), then one Triton pass for the activation and product (into the gate's buffer
    where two projections are not kept)."""
    M, N = x.shape[:-1].numel(), w_gate.shape[0]
    w = packed(w_gate, w_up) if pack and b_gate is None else None
    if w is not None:
        gu = torch.mm(x.reshape(M, x.shape[-1]), w.t())
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
    made on the way; else :func:`forward`."""
    N, K = w_gate.shape
    lead = x.shape[:-1]
    M, size, dtype, device = lead.numel(), w_gate.element_size(), x.dtype, x.device
    step, both, strides, out_shape = N * K * size, (2 * N, K), (K, 1), (*lead, N)
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


_F_linear = F.linear
_kernels = None  # tritonmm.kernels.gated_product, imported on first use (import tritonmm imports no Triton)


def _load():
    global _kernels
    from .kernels import gated_product

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


def clear_cache() -> None:
    """Forget the product kernels' bound launchers."""
    if _kernels is not None:
        _kernels.clear_cache()
