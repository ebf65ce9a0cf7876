"""cuBLAS on zero-padded, aligned copies of unaligned operands (the "padded" path).

cuBLAS needs 16-byte aligned leading dimensions for its fast Tensor Core kernels (NVIDIA, *Matrix
Multiplication Background*, "Tensor Core Requirements"); on an unaligned problem such as 4097³ it
runs several times below its aligned speed (``benchmarks/h200.json``, tag ``odd``). This path copies
the operands into buffers whose K and N are rounded up to a multiple of :data:`tritonmm.core.layout.PAD`
(zeros in the padded K range, so the sum over K is unchanged), runs cuBLAS there and copies the
(M, N) corner of the result back. Each copy is one pass of the Triton pad-copy kernel
(:func:`tritonmm.kernels.copy.copier`) on CUDA and under the interpreter, torch's ``copy_`` and
``zero_`` elsewhere. Results are cuBLAS's own on the padded problem: padded rows and columns of K
only add exact zeros.

The buffers come from :mod:`tritonmm.core.workspace` (reused per thread, device and stream):
extra memory is at most the padded sizes of A, B and C.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core import activations, workspace
from ..core.layout import padded_shape, tma_compatible
from ..core.shapes import Plan


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
    copy_a = Kp != K or not tma_compatible(a2)
    b_col = b2.stride(0) == 1 and b2.shape[0] > 1 and b2.stride(1) != 1  # an (N, K) weight read as (K, N)
    copy_b = Kp != K or Np != N or not tma_compatible(b2)
    copy_c = Np != N
    specs = []
    if copy_a:
        specs.append(((M, Kp), dtype))
    if copy_b:
        specs.append((((Np, Kp) if b_col else (Kp, Np)), dtype))
    if copy_c:
        specs.append(((M, Np), dtype))
    out_shape = plan.out_shape
    from ..kernels import copy as copy_kernel  # imports triton: not at ``import tritonmm``

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
