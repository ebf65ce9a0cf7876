"""cuBLAS on zero-padded, aligned copies of unaligned operands (the "padded" path).

cuBLAS needs 16-byte aligned leading dimensions for its fast Tensor Core kernels: on an
H200 a bfloat16 GEMM of 4097³ runs at about 133 TFLOP/s against 743 at 4096³ (NVIDIA,
*Matrix Multiplication Background*, "Tensor Core Requirements"). Copying the operands
into buffers whose K and N are rounded up to a multiple of :data:`PAD` (zeros in the
padded K range, so the sum over K is unchanged), running cuBLAS there and copying the
(M, N) corner of the result back measured 4.1x faster than torch.matmul on 4097³, 3.8x
on 4095³ and 3.4x on 2305³ (bfloat16, H200), where the persistent TMA kernel on aligned
copies gave 2.6x and 2.8x (and 1.1x on 2305³ in an earlier run). Each copy is one pass of the Triton pad-copy kernel
(:func:`tritonmm.kernels.copy.copier`, zeros included) on CUDA and under the interpreter,
torch's ``copy_`` and ``zero_`` elsewhere. Results are cuBLAS's own on the padded problem: padded
rows and columns of K only add exact zeros.

The buffers come from :mod:`tritonmm.workspace` (reused per thread, device and stream):
extra memory is at most the padded sizes of A, B and C.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import activations, workspace
from .shapes import Plan

PAD = 64  # elements: K and N round up to this (64 beat 8 on 2305³: cuBLAS's heuristics like it)


def _aligned(n: int, itemsize: int) -> bool:
    return (n * itemsize) % 16 == 0


def _round(n: int) -> int:
    return -(-n // PAD) * PAD


def _reads_in_place(t: Tensor) -> bool:
    """Whether cuBLAS can read a 2-D operand at full speed: unit stride in one dim, 16-byte aligned
    leading stride and base."""
    from .kernels.matmul import tma_compatible

    return tma_compatible(t)


def padded_shape(plan: Plan, dtype: torch.dtype) -> tuple[int, int] | None:
    """(Kp, Np) the padded path would use for a 2-D plan, or None when every operand and the
    output are already aligned (or the plan is batched), so padding gains nothing."""
    if plan.batch != 1:
        return None
    size = dtype.itemsize
    a2, b2 = plan.a4[0, 0], plan.b4[0, 0]
    if _aligned(plan.N, size) and _reads_in_place(a2) and _reads_in_place(b2):
        return None
    K, N = plan.K, plan.N
    return (K if _aligned(K, size) else _round(K)), (N if _aligned(N, size) else _round(N))


def runner(plan: Plan, dtype: torch.dtype, device: torch.device, activation: str, alloc=torch.empty):
    """A runner ``(a, b, bias) -> Tensor`` for one 2-D geometry (see the module docstring).

    ``a`` and ``b`` are the tensors the plan was made from (B may be an (N, K) weight read
    transposed); the result is a new contiguous tensor of ``plan.out_shape`` from ``alloc``.
    ``bias`` (linear only) has shape (N,), (1,) or (); ``activation`` is applied last.
    """
    M, N, K = plan.M, plan.N, plan.K
    Kp, Np = padded_shape(plan, dtype)
    a2, b2 = plan.a4[0, 0], plan.b4[0, 0]
    sa, sb = a2.stride(), b2.stride()
    copy_a = Kp != K or not _reads_in_place(a2)
    b_col = b2.stride(0) == 1 and b2.shape[0] > 1 and b2.stride(1) != 1  # an (N, K) weight read as (K, N)
    copy_b = Kp != K or Np != N or not _reads_in_place(b2)
    copy_c = Np != N
    specs = []
    if copy_a:
        specs.append(((M, Kp), dtype))
    if copy_b:
        specs.append((((Np, Kp) if b_col else (Kp, Np)), dtype))
    if copy_c:
        specs.append(((M, Np), dtype))
    out_shape = plan.out_shape
    from .kernels import copy as copy_kernel  # imports triton: not at ``import tritonmm``

    # one Triton pass per copy (zeros included) on CUDA and under the interpreter, torch's copies elsewhere
    if copy_a:
        copy_a_fn = copy_kernel.copier((M, K), sa, (M, Kp), Kp, device)
    if copy_b:  # an (N, K) weight keeps its row-major order (coalesced copy; cuBLAS reads it transposed)
        copy_b_fn = (copy_kernel.copier((N, K), (sb[1], sb[0]), (Np, Kp), Kp, device) if b_col
                     else copy_kernel.copier((K, N), sb, (Kp, Np), Np, device))
    if copy_c:
        copy_c_fn = copy_kernel.copier((M, N), (Np, 1), (M, N), N, device)

    def run(a: Tensor, b: Tensor, bias_: Tensor | None) -> Tensor:
        a = a.as_strided((M, K), sa)
        b = b.as_strided((K, N), sb)
        out = alloc(out_shape, dtype=dtype, device=device)
        bufs = workspace.buffers(device, specs)
        if copy_a:
            ap = bufs.pop(0)
            copy_a_fn(a, ap)
            a = ap
        if copy_b:
            bp = bufs.pop(0)
            copy_b_fn(b.mT if b_col else b, bp)
            b = bp.mT if b_col else bp
        c = bufs.pop(0) if copy_c else out.view(M, N)
        if bias_ is not None:
            full = bias_.reshape(-1).expand(N)
            if Np != N:
                full = torch.cat([full, full.new_zeros(Np - N)])
            torch.addmm(full, a, b, out=c)
        else:
            torch.mm(a, b, out=c)
        if copy_c:
            copy_c_fn(c[:, :N], out.view(M, N))
        return activations.apply_(out, activation)

    return run
