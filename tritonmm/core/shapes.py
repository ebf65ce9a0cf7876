"""torch.matmul's shape rules, and the reduction of any matmul to (B0, B1, M, K) @ (B0, B1, K, N) views.

Pure torch (no Triton): used by the op, its fake (meta) implementation and the dispatcher.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .activations import check as check_activation


def check_inputs(a: torch.Tensor, b: torch.Tensor, op: str = "matmul") -> None:
    """Raise as torch.matmul does for operands it refuses.

    Raises:
        TypeError: an argument is not a Tensor.
        RuntimeError: devices differ (a meta operand goes with any, as in torch), dtypes differ, an operand is
            0-D, or inner dims mismatch.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tritonmm.{op}: argument '{name}' must be Tensor, not {type(t).__name__}")
    if a.device != b.device and not (a.is_meta or b.is_meta):  # (torch takes meta with any device)
        raise RuntimeError(
            f"tritonmm.{op}: expected all tensors to be on the same device, but found at least two devices, "
            f"{a.device} and {b.device}"
        )
    if a.dtype != b.dtype:
        raise RuntimeError(
            f"tritonmm.{op}: expected both operands to have the same dtype, but got {a.dtype} and {b.dtype}"
        )
    if a.dim() == 0 or b.dim() == 0:
        raise RuntimeError(
            f"tritonmm.{op}: both arguments to {op} need to be at least 1D, but they are {a.dim()}D and {b.dim()}D"
        )
    ka = a.shape[-1]
    kb = b.shape[-2] if b.dim() >= 2 else b.shape[0]
    if ka != kb:
        raise RuntimeError(
            f"tritonmm.{op}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied "
            f"(inner dimensions {ka} and {kb} differ)"
        )
    try:
        torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise RuntimeError(
            f"tritonmm.{op}: batch dimensions of {tuple(a.shape)} and {tuple(b.shape)} cannot be broadcast"
        ) from None


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias, activation: str) -> None:
    """Raise as F.linear does (plus an unknown activation).

    Raises:
        TypeError: x or weight is not a Tensor.
        ValueError: ``activation`` is not one of :data:`tritonmm.core.activations.ACTIVATIONS`.
        RuntimeError: devices or dtypes differ, x is 0-D, weight is not 2-D, or sizes mismatch.

    Where F.linear serves the call itself (:func:`torch_form`) only the activation is checked here: F.linear
    checks the rest.
    """
    check_activation(activation, "tritonmm.linear")
    if torch_form(x, weight, bias):
        return
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"tritonmm.linear: argument 'weight' must be Tensor, not {type(weight).__name__}")
    if weight.dim() != 2:
        raise RuntimeError(f"tritonmm.linear: weight must be 2-D (out_features, in_features), got {tuple(weight.shape)}")
    check_inputs(x, weight.t(), op="linear")
    if bias is not None:
        if bias.device != x.device or bias.dtype != x.dtype:
            raise RuntimeError(
                f"tritonmm.linear: bias ({bias.dtype}, {bias.device}) must match input ({x.dtype}, {x.device})"
            )
        if tuple(bias.shape) not in ((), (1,), (weight.shape[0],)):
            raise RuntimeError(
                f"tritonmm.linear: bias of shape {tuple(bias.shape)} does not match out_features {weight.shape[0]}"
            )


def torch_form(x, weight, bias) -> bool:
    """Whether a linear call has a form of F.linear that the kernels do not take, which F.linear then serves
    itself (checks, result, autograd): a 1-D weight (``x @ w``, the output losing its last dimension), a bias
    of more than one dimension (broadcast over the output: (M, N), (M, 1), (B, M, N), ...; the kernels'
    epilogue adds an (N,) row) or a bias of another dtype than x's (F.linear adds it in place after its
    matmul where x's layout takes that path, keeping x's dtype, and raises where it does not)."""
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return True
    return isinstance(bias, torch.Tensor) and (bias.dim() > 1 or isinstance(x, torch.Tensor) and bias.dtype != x.dtype)


def output_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """Shape of torch.matmul(a, b) (SymInt-friendly, for the fake implementation)."""
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    mid = (a.shape[-2],) if a.dim() >= 2 else ()
    last = (b.shape[-1],) if b.dim() >= 2 else ()
    return batch + mid + last


@dataclass
class Plan:
    """A matmul as a two-level-batched GEMM over views of the operands (no copies where strides allow).

    Attributes:
        a4: (B0, B1, M, K) view of A (stride 0 on broadcast batch dims).
        b4: (B0, B1, K, N) view of B.
        out_shape: the shape torch.matmul returns.
        c_strides: (stride_b0, stride_b1) of the contiguous output seen as (B0, B1, M, N).
        copied: the operands had to be copied (more than two batch levels that cannot merge).
    """

    a4: torch.Tensor
    b4: torch.Tensor
    out_shape: tuple
    c_strides: tuple
    copied: bool = False

    @property
    def M(self) -> int:
        return self.a4.shape[2]

    @property
    def N(self) -> int:
        return self.b4.shape[3]

    @property
    def K(self) -> int:
        return self.a4.shape[3]

    @property
    def batch(self) -> int:
        return self.a4.shape[0] * self.a4.shape[1]


def _as4(t: torch.Tensor, levels: list, which: int, rows: int, cols: int) -> torch.Tensor:
    """View ``t`` (batch..., rows, cols) as (B0, B1, rows, cols) with the given coalesced batch levels."""
    sizes = [lv[0] for lv in levels]
    strides = [lv[1][which] for lv in levels]
    while len(sizes) < 2:
        sizes.insert(0, 1)
        strides.insert(0, 0)
    return t.as_strided((*sizes, rows, cols), (*strides, t.stride(-2), t.stride(-1)))


def _coalesce(batch: tuple, strides: list[tuple]) -> list:
    """Merge adjacent batch dims that every tensor steps through uniformly; drop size-1 dims.

    Returns a list of (size, (stride per tensor)) from outermost to innermost.
    """
    levels: list = []
    for i, size in enumerate(batch):
        if size == 1:
            continue
        st = tuple(s[i] for s in strides)
        if levels and all(prev == cur * size for prev, cur in zip(levels[-1][1], st)):
            levels[-1] = (levels[-1][0] * size, st)
        else:
            levels.append((size, st))
    return levels


def plan(a: torch.Tensor, b: torch.Tensor) -> Plan:
    """Reduce ``torch.matmul(a, b)`` to a two-level-batched GEMM on views (inputs already checked).

    1-D operands gain the unit dim torch.matmul gives them; when B has no batch dims and
    A's batch dims fold into M (a view), the problem becomes one (B*M, K) @ (K, N) GEMM.
    """
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    M, K = a2.shape[-2:]
    N = b2.shape[-1]
    out_shape = output_shape(a, b)
    batch = tuple(torch.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    if b2.dim() == 2 and a2.dim() > 2:
        try:
            af = a2.view(-1, K)
        except RuntimeError:
            af = None
        if af is not None:
            rows = af.shape[0]
            return Plan(af.as_strided((1, 1, rows, K), (0, 0, *af.stride())), b2.as_strided(
                (1, 1, K, N), (0, 0, *b2.stride())), out_shape, (0, 0))
    ae = a2.expand(*batch, M, K)
    be = b2.expand(*batch, K, N)
    c_batch_strides = []
    acc = M * N
    for size in reversed(batch):
        c_batch_strides.insert(0, acc)
        acc *= size
    strides = [ae.stride()[:-2], be.stride()[:-2], tuple(c_batch_strides)]
    levels = _coalesce(batch, strides)
    if len(levels) > 2 and 0 in (M, N, K, math.prod(batch)):
        # an empty problem reads nothing, and copies of empty tensors keep their stride-0 batch dims
        # (an empty tensor counts as contiguous): one level of stride-0 views, never read
        levels = [(math.prod(batch), (0, 0, 0))]
    copied = len(levels) > 2
    if copied:  # rare: three batch levels that cannot be merged; pay for copies
        ae, be = ae.contiguous(), be.contiguous()
        levels = _coalesce(batch, [ae.stride()[:-2], be.stride()[:-2], tuple(c_batch_strides)])
    c_strides = tuple(lv[1][2] for lv in levels)
    c_strides = (0,) * (2 - len(c_strides)) + c_strides
    return Plan(_as4(ae, levels, 0, M, K), _as4(be, levels, 1, K, N), out_shape, c_strides, copied)
