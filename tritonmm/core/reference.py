"""Reference and tolerance helpers shared by the tests and the benchmark.

The reference is float64 (on the operands' device). A result passes when its largest
elementwise error against the reference is at most

    2 * (torch.matmul's own largest error)          quack's rule: at most ~2x torch's error
    + u(dtype) * max|reference|                      the rounding of the output itself
    + 4 * 2**-24 * sqrt(K) * max sqrt(A^2 @ B^2)     fp32 accumulation in another order
    + 2**-10 * max(|A| @ |B|), with TF32 only        TF32 rounds the inputs (cuBLAS may not)

Non-finite reference entries must be matched exactly (NaN by NaN, inf by the same inf).
A missing K block or an unwritten tile errs by O(sqrt(BLOCK_K)) or O(|C|), far above this.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .device import tf32

EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}
TF32_EPS = 2.0**-10


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul in float64."""
    return torch.matmul(a.double(), b.double())


def rounding_unit(dtype: torch.dtype, device: torch.device) -> float:
    """Unit roundoff to allow for: TF32's where torch.matmul would use TF32."""
    if tf32(dtype, device):
        return TF32_EPS
    return EPS.get(dtype, 2.0**-52)


def error_report(
    tri: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ref_fn: Optional[Callable] = None,
    torch_fn: Optional[Callable] = None,
    contract: Optional[Callable] = None,
) -> dict:
    """Errors of ``tri`` and of torch against the float64 reference, and the allowed bound.

    Args:
        tri: the result under test.
        a, b: the operands.
        ref_fn: float64 reference ``(a64, b64) -> Tensor``; default torch.matmul.
        torch_fn: torch's own result ``(a, b) -> Tensor``; default torch.matmul.
        contract: the bare product ``(a, b) -> Tensor`` behind ref_fn (F.linear for linear); default torch.matmul.

    Returns:
        dict with ``tri_err``, ``torch_err`` (max abs errors), ``scale``, ``bound``, ``ok``.
    """
    ref_fn = ref_fn or torch.matmul
    torch_fn = torch_fn or torch.matmul
    contract = contract or torch.matmul
    ref = ref_fn(a.double(), b.double())
    torch_out = torch_fn(a, b)
    finite = ref[ref.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    a_abs, b_abs = a.double().nan_to_num(0, 0, 0).abs(), b.double().nan_to_num(0, 0, 0).abs()
    acc = contract(a_abs.square(), b_abs.square())
    acc_scale = acc.max().sqrt().item() if acc.numel() else 0.0
    tf32 = a.dtype == torch.float32 and rounding_unit(a.dtype, a.device) == TF32_EPS
    abs_scale = contract(a_abs, b_abs).max().item() if tf32 and acc.numel() else 0.0
    if tri.shape != ref.shape:
        return {"tri_err": float("inf"), "torch_err": 0.0, "scale": scale, "bound": 0.0, "ok": False}
    if ref.numel() == 0:
        return {"tri_err": 0.0, "torch_err": 0.0, "scale": 0.0, "bound": 0.0, "ok": True}
    tri_err = _max_err(tri.double(), ref)
    torch_err = _max_err(torch_out.double(), ref)
    K = a.shape[-1]
    bound = 2.0 * torch_err + rounding_unit(a.dtype, a.device) * scale + 4 * 2.0**-24 * K**0.5 * acc_scale
    bound += TF32_EPS * abs_scale  # TF32 rounds each input to 10 mantissa bits: |error| <= 2^-10 sum|a||b|
    ok = tri_err == tri_err and tri_err <= bound  # NaN fails
    return {"tri_err": tri_err, "torch_err": torch_err, "scale": scale, "bound": bound, "ok": ok}


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |x - ref|; non-finite reference entries must be matched exactly (NaN by NaN, inf by inf)."""
    fin = ref.isfinite()
    if not fin.all():
        same = (x.isnan() & ref.isnan()) | (x == ref)
        if not same[~fin].all():
            return float("nan")
    return (x[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def assert_matches_reference(tri, a, b, ref_fn=None, torch_fn=None, contract=None, what: str = "") -> None:
    """Assert :func:`error_report` passes, with the numbers in the message."""
    rep = error_report(tri, a, b, ref_fn, torch_fn, contract)
    if not rep["ok"]:
        raise AssertionError(
            f"{what} {tuple(a.shape)}x{tuple(b.shape)} {a.dtype}: max error {rep['tri_err']:.3e} > bound "
            f"{rep['bound']:.3e} (torch.matmul's error {rep['torch_err']:.3e}, scale {rep['scale']:.3e}, "
            f"shape {tuple(tri.shape)})"
        )


def randn(*shape, dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Standard normal test data (never zeros), made in float32 then cast."""
    size = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    return torch.randn(size, dtype=torch.float32, device=device, generator=generator).to(dtype)
