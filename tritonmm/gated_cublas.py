"""The gated linear above :data:`tritonmm.gated.GATED_MAX_M` rows: cuBLAS runs the gate and up
projections, one Triton pass (:mod:`tritonmm.kernels.gated_product`) the activation and the product,
and in the backward one Triton pass both projections' gradients.

Eager PyTorch runs the activation and the product as two kernels and their backward as three; these
passes read each tensor once. Values in fp32, rounded once to the output dtype.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from . import activations, modes, runners
from ._env import interpreting

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes the Triton kernels of the gated linear take."""


def serves(t: torch.Tensor) -> bool:
    """Whether the product kernels take ``t``'s dtype and device (CUDA, or the CPU under the interpreter)."""
    return t.dtype in KERNEL_DTYPES and (t.device.type == "cuda" or t.device.type == "cpu" and interpreting())


def forward(x, w_gate, w_up, b_gate, b_up, activation, save):
    """cuBLAS for both projections, then one Triton pass for the activation and product (into the gate's
    buffer where the projections are not kept)."""
    M, N = x.shape[:-1].numel(), w_gate.shape[0]
    g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    h = torch.empty_like(g) if save else g
    product(g, u, h, activation)
    return (h, g.view(M, N), u.view(M, N)) if save else (h, None, None)


_kernels = None  # tritonmm.kernels.gated_product, imported on first use (import tritonmm imports no Triton)


def _load():
    global _kernels
    from .kernels import gated_product

    _kernels = gated_product
    return _kernels


def product(g, u, h, activation) -> None:
    """``h = act(g) * u`` in one pass (contiguous tensors of one size, dtype and device; ``h`` may be ``g``)."""
    if not g.numel():
        return
    kernels = _kernels or _load()
    try:
        kernels.gated_product(g, u, h, activation)
    except kernels.LAUNCH_FAILURES as e:  # (not seen: an elementwise kernel) torch serves, warned
        warnings.warn(f"tritonmm.gated_linear: the gated product kernel failed ({type(e).__name__}: {e}); "
                      "torch computes it", runners.KernelFailedWarning, stacklevel=4)
        h.copy_(activations.apply(g.float(), activation) * u.float())


def grads(dh, g, u, activation, needs):
    """(d_gate, d_up) from the upstream gradient ``dh`` and the saved projections: one Triton pass where the
    kernels serve the tensors, else torch's formulas."""
    if serves(g) and g.numel() and g.is_contiguous() and u.is_contiguous() and dh.dtype == g.dtype == u.dtype \
            and dh.device == g.device and modes.plain(dh, g, u) and not modes.torch_only(dh) and modes.eager():
        dh = dh.contiguous()
        d_gate, d_up = torch.empty_like(g), torch.empty_like(u)
        (_kernels or _load()).gated_product_backward(dh, g, u, d_gate, d_up, activation)
        return d_gate, d_up
    with torch.enable_grad():
        g_ = g.detach().requires_grad_()
        act = activations.apply(g_, activation)
    d_gate = torch.autograd.grad(act, g_, dh * u)[0] if any(needs[i] for i in (0, 1, 3)) else None
    d_up = dh * act.detach() if any(needs[i] for i in (0, 2, 4)) else None
    return d_gate, d_up


def clear_cache() -> None:
    """Forget the product kernels' bound launchers."""
    if _kernels is not None:
        _kernels.clear_cache()
