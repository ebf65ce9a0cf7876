"""The epilogue activations, and their torch versions for the paths that do not fuse them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "silu", "gelu", "gelu_tanh", "relu")
"""The epilogue activations; the gated linear takes all but "none", in this order."""


def check(activation, fn: str, allowed: tuple = ACTIVATIONS) -> None:
    """Raise ValueError unless ``activation`` is one of ``allowed``; the message :func:`tritonmm.gated_linear`
    gives too."""
    if not isinstance(activation, str) or activation not in allowed:
        raise ValueError(f"{fn}: unknown activation {activation!r}; expected one of {allowed}")


def apply(x: torch.Tensor, activation: str, inplace: bool = False) -> torch.Tensor:
    """``activation`` applied in torch: out of place (differentiable, any autograd or functorch mode),
    or in place where torch allows it (``x`` must then be a fresh tensor)."""
    if activation == "relu":
        return torch.relu_(x) if inplace else F.relu(x)
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_(x, approximate=approximate) if inplace else F.gelu(x, approximate=approximate)
    if activation == "silu":
        return F.silu(x, inplace=inplace)
    return x


def apply_(x: torch.Tensor, activation: str) -> torch.Tensor:
    """:func:`apply` in place: for fresh tensors outside autograd (the unfused torch paths)."""
    return apply(x, activation, inplace=True)
