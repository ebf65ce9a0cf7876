"""Trace-time decisions: what ``torch.compile`` (and any AOT tracing) puts into the graph for the ops.

``tritonmm::matmul`` and ``tritonmm::linear`` are ``torch.library.triton_op`` s: when torch.compile
traces them, their Python body runs on fake or functional tensors and records what it calls. This
module is that body. It asks the dispatcher once, at trace time, with the shapes the graph was traced
for, and records:

* cuBLAS decisions as ``aten`` ops (``mm``, ``addmm``, ``matmul``; padded copies as ``constant_pad_nd``
  and a slice), so Inductor treats them as its own GEMMs and no tritonmm code runs per call;
* Triton decisions as the pointer kernel (split-K too) launched through ``torch.library.wrap_triton``
  with a fixed config (tuned table or quantization heuristic: nothing is benchmarked while tracing),
  which Inductor launches from its generated code. Automatic TMA-kernel decisions become cuBLAS here
  (TMA needs 16-byte aligned bases, which a traced graph cannot promise for every input); forced ones
  run the pointer kernel.

Where a size is symbolic (``dynamic=True``), automatic calls go to cuBLAS and forced ones to the
pointer kernel with the heuristic's config for the size hint; no guard is added on the size. Under
Triton's interpreter (CPU tests) and for batched problems forced to Triton, the kernel runs behind an
opaque op (``tritonmm::kernel_matmul`` / ``tritonmm::kernel_linear``) that takes the decision as arguments.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import activations, layout, shapes
from ..core import device as _device
from ..core.env import interpreting
from ..dispatch import decide


def _rows(t: Tensor) -> Tensor:
    """``t`` (*, K) as a 2-D (rows, K) tensor (a view where strides allow); empty tensors too."""
    rows = 1
    for d in t.shape[:-1]:
        rows = rows * d
    return t.reshape(rows, t.shape[-1])


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _hint(s) -> int:
    """A size, or the size hint of a symbolic one (no guard)."""
    if isinstance(s, int):
        return s
    return int(s.node.hint) if getattr(s.node, "hint", None) is not None else 64


def _torch_linear(x, weight, bias, activation):
    return activations.apply(F.linear(x, weight, bias), activation).contiguous()


def _padded_mm(a2: Tensor, b2: Tensor, bias, activation: str, Kp: int, Np: int) -> Tensor:
    """cuBLAS on zero-padded copies (:mod:`tritonmm.dispatch.padded`) as aten ops."""
    K, N = a2.shape[1], b2.shape[1]
    ap = F.pad(a2, (0, Kp - K))
    bp = F.pad(b2, (0, Np - N, 0, Kp - K))
    out = torch.mm(ap, bp)[:, :N]
    if bias is not None:
        out = out + bias
    return activations.apply(out, activation).contiguous()


def _decide_2d(a2: Tensor, b2: Tensor) -> decide.Decision:
    M, K = a2.shape
    N = b2.shape[1]
    if not _static(M, N, K):
        backend, kernel, config = decide.forced()
        if decide._capability(a2.dtype, a2.device):
            return decide.Decision("torch", None, "traced: capability")
        if backend == "triton" or (a2.device.type == "cpu" and interpreting() and backend != "torch"):
            return decide.Decision("triton", "pointer", "traced with symbolic sizes: pointer kernel")
        return decide.Decision("torch", None, "traced with symbolic sizes: cuBLAS")
    return decide.decide(shapes.plan(a2, b2), a2.dtype, a2.device)


def _launch_pointer(a2: Tensor, b2: Tensor, bias, activation: str, decision: decide.Decision) -> Tensor:
    """C = act(A2 @ B2 + bias) with the pointer kernel (split-K too) through ``wrap_triton``."""
    import triton

    from ..kernels import configs as _cfg
    from ..kernels.launch import input_precision
    from ..kernels.pointer import _matmul_kernel

    M, K = a2.shape
    N = b2.shape[1]
    dtype, dev = a2.dtype, a2.device
    split = decision.kernel == "splitk"
    kernel = "splitk" if split else "pointer"
    cfg = decision.config if decision.kernel in ("pointer", "splitk") else None
    if cfg is None:
        size = dtype.itemsize
        cfg = _cfg.heuristic(kernel, _hint(M), _hint(N), _hint(K), size, size, _device.smem_limit(dev),
                             _device.num_sms(dev))
    cfg = _cfg.complete(kernel, dict(cfg))
    out = torch.empty((M, N), dtype=dtype, device=dev)
    bm, bn, s = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg.get("SPLIT_K", 1)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if split:
        target = torch.empty((s, M, N), dtype=torch.float32, device=dev)
        locks = torch.zeros((tiles,), dtype=torch.int32, device=dev)
        sc = (0, 0, N, 1)
    else:
        target = locks = out
        sc = (0, 0, out.stride(0), 1)
    sa, sb = a2.stride(), b2.stride()
    int64 = not _static(M, N, K, *sa, *sb) or layout.needs_int64((M, K, sa[0], sa[1]), (K, N, sb[0], sb[1]),
                                                                 (M, N, N, 1))
    bias_stride = 0 if bias is None or bias.dim() == 0 or bias.shape[0] == 1 else bias.stride(0)
    even_k = _static(K) and K % cfg["BLOCK_K"] == 0
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    meta["SPLIT_K"] = s
    torch.library.wrap_triton(_matmul_kernel)[(tiles, s)](
        a2, b2, target, bias if bias is not None else out, out, locks,
        M, N, K, 1, 0, 0, sa[0], sa[1], 0, 0, sb[0], sb[1], *sc, M * N if split else 0, bias_stride,
        0, 0, 0, int(sa[1] != 1) | (int(sb[1] != 1) << 1),
        **meta, EVEN_K=even_k, INT64=int64, HAS_BIAS=bias is not None, ACTIVATION=activation,
        INPUT_PRECISION=input_precision(dtype, dev), UPCAST=False,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _config_arg(decision: decide.Decision) -> str:
    return json.dumps(decision.config) if decision.config else ""


def _gemm_2d(a2: Tensor, b2: Tensor, bias, activation: str, out_shape, opaque) -> Tensor:
    """One 2-D GEMM with an epilogue, as the trace-time decision says."""
    d = _decide_2d(a2, b2)
    if d.backend == "torch" or d.kernel == "none":
        if d.kernel == "padded":
            Kp, Np = layout.padded_shape(shapes.plan(a2, b2), a2.dtype)
            return _padded_mm(a2, b2, bias, activation, Kp, Np).view(out_shape)
        return None
    if a2.device.type != "cuda":  # the interpreter: the kernels cannot be traced through wrap_triton
        return opaque(d)
    if d.kernel == "tma" and decide.forced()[0] != "triton":
        return None  # automatic TMA decisions: cuBLAS (see the module docstring)
    return _launch_pointer(a2, b2, bias, activation, d).view(out_shape)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """The traced body of ``tritonmm::matmul``."""
    shapes.check_inputs(a, b)
    out_shape = shapes.output_shape(a, b)
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    if b2.dim() == 2:  # one GEMM: A's batch dims fold into M
        a2 = _rows(a2)
        out = _gemm_2d(a2, b2, None, "none", out_shape,
                       lambda d: torch.ops.tritonmm.kernel_matmul(a, b, d.kernel, _config_arg(d)))
        if out is not None:
            return out
        # cuBLAS on the rows (A's batch dims folded, a copy where its strides do not fold): torch.matmul on a
        # 3-D A that does not fold into rows as a view decomposes into a bmm against the broadcast B, a batched
        # GEMV per row block on cuBLAS (the last position's logits of a prefill: 6x the mm's time on an H100)
        return torch.mm(a2, b2).view(out_shape)
    elif decide.forced()[0] == "triton" or (a.device.type == "cpu" and interpreting()):
        if not decide._capability(a.dtype, a.device):
            return torch.ops.tritonmm.kernel_matmul(a, b, "pointer", "")
    return torch.matmul(a, b).contiguous()


def linear(x: Tensor, weight: Tensor, bias=None, activation: str = "none") -> Tensor:
    """The traced body of ``tritonmm::linear``."""
    shapes.check_linear(x, weight, bias, activation)
    if shapes.torch_form(x, weight, bias):  # F.linear's result, in x's dtype as eager F.linear gives it (an in-place add)
        return _torch_linear(x, weight, bias, activation).to(x.dtype)
    out_shape = (*x.shape[:-1], weight.shape[0])
    x2 = x.unsqueeze(0) if x.dim() == 1 else _rows(x)
    out = _gemm_2d(x2, weight.t(), bias, activation, out_shape,
                   lambda d: torch.ops.tritonmm.kernel_linear(x, weight, bias, activation, d.kernel, _config_arg(d)))
    return out if out is not None else _torch_linear(x2, weight, bias, activation).view(out_shape)  # (rows: see matmul)
