"""The epilogue activations, and their torch versions for the paths that do not fuse them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")


def apply_(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation`` applied in torch, in place where torch allows it; ``x`` must be a fresh tensor."""
    if activation == "relu":
        return torch.relu_(x)
    if activation in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_(x, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return F.silu(x, inplace=True)
    return x


def apply(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation`` applied out of place (differentiable, any autograd or functorch mode)."""
    if activation == "relu":
        return F.relu(x)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return F.silu(x)
    return x
