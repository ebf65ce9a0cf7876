"""Per-GEMM rows: tritonmm against torch.matmul (or F.linear + F.gelu) on the shape suite, the
Triton kernel alone, and Inductor's max-autotune templates."""

from __future__ import annotations

import time

import torch

from ..core.timing import _bench_pair, _bench_us
from .timing import _first_call_ms


def _backend_label(d) -> str:
    if d.backend == "torch":
        return "torch:padded" if d.kernel == "padded" else "torch"
    return f"triton:{d.kernel}"


def _matmul_operands(shape: dict, dtype: torch.dtype, layout: str, gen) -> tuple:
    """Random (M, K) A and (K, N) B (B the transposed view of an (N, K) matrix for layout "nt")."""
    M, N, K = shape["M"], shape["N"], shape["K"]
    a = torch.randn(M, K, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
    if layout == "nt":
        return a, torch.randn(N, K, device="cuda", dtype=torch.float32, generator=gen).to(dtype).t()
    return a, torch.randn(K, N, device="cuda", dtype=torch.float32, generator=gen).to(dtype)


def _linear_operands(shape: dict, dtype: torch.dtype, gen) -> tuple:
    """Random x (M, K), weight (N, K) and bias (N,)."""
    M, N, K = shape["M"], shape["N"], shape["K"]
    return (torch.randn(M, K, device="cuda", generator=gen).to(dtype),
            torch.randn(N, K, device="cuda", generator=gen).to(dtype),
            torch.randn(N, device="cuda", generator=gen).to(dtype))


def bench_matmul_row(shape: dict, dtype: torch.dtype, args, gen) -> dict:
    import tritonmm
    from tritonmm.core.reference import error_report

    M, N, K = shape["M"], shape["N"], shape["K"]
    a, b = _matmul_operands(shape, dtype, args.layout, gen)
    flop = 2.0 * M * N * K
    row = {"tag": shape["tag"], "M": M, "N": N, "K": K, "dtype": str(dtype)[6:], "layout": args.layout}
    decision = tritonmm.explain(a, b)
    row["backend"] = _backend_label(decision)
    row["reason"] = decision.reason
    row["first_call_ms"] = _first_call_ms(lambda: tritonmm.matmul(a, b))
    row["torch_us"], row["tritonmm_us"] = _bench_pair(lambda: torch.matmul(a, b), lambda: tritonmm.matmul(a, b),
                                                      args.rep)
    if not args.no_kernel_only:
        # the Triton kernel alone: the tuned table's fastest Triton config for this shape where it
        # names one (also where cuBLAS won), else whatever @triton.autotune picks
        from ..core import shapes
        from ..dispatch import tuned

        e = tuned.entry(a.device, dtype, shapes.plan(a, b))
        named = e and e.get("config") and e.get("kernel") in ("tma", "pointer", "splitk")
        force = ("triton", e["kernel"], e["config"]) if named else ("triton",)
        row["kernel_source"] = "tuned table" if len(force) > 1 else "autotuned"
        row["kernel_config"] = force[2] if len(force) > 1 else None
        with tritonmm.force_backend(*force):
            kd = tritonmm.explain(a, b)
            row["kernel"] = kd.kernel
            row["kernel_first_call_ms"] = _first_call_ms(lambda: tritonmm.matmul(a, b))
            row["kernel_us"] = _bench_us(lambda: tritonmm.matmul(a, b), args.rep)
            if not args.no_check:
                rep = error_report(tritonmm.matmul(a, b), a, b)
                row.update(kernel_ok=rep["ok"], kernel_err=rep["tri_err"], torch_err=rep["torch_err"])
    if not args.no_check:
        rep = error_report(tritonmm.matmul(a, b), a, b)
        row.update(ok=rep["ok"], err=rep["tri_err"], torch_err=rep["torch_err"])
    for key in ("torch", "tritonmm", "kernel"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = flop / row[f"{key}_us"] / 1e6
    row["ratio"] = row["torch_us"] / row["tritonmm_us"]
    if "kernel_us" in row:
        row["kernel_ratio"] = row["torch_us"] / row["kernel_us"]
    return row


def inductor_pass(rows: list[dict], work: list, args, progress=iter) -> None:
    """Add the Inductor columns to every row, after all torch.matmul / tritonmm timings are done.

    A separate pass: Inductor's autotuning leaves compile workers behind, whose CPU use disturbs the
    timing of calls with Python work per call. Operands are drawn anew (same shapes).
    """
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(1)
    for row, (shape, dtype) in progress(list(zip(rows, work))):
        if args.linear:
            x, w, bias = _linear_operands(shape, dtype, gen)
            bench_inductor(row, lambda x_, w=w, bias=bias: F.gelu(F.linear(x_, w, bias)), args, x)
        else:
            bench_inductor(row, torch.matmul, args, *_matmul_operands(shape, dtype, args.layout, gen))
        if "inductor_us" in row:
            row["inductor_tflops"] = 2.0 * shape["M"] * shape["N"] * shape["K"] / row["inductor_us"] / 1e6
        torch.cuda.empty_cache()


def bench_inductor(row: dict, fn, args, *inputs) -> None:
    """Add Inductor's max-autotune column to ``row``: ``fn`` compiled with only Triton GEMM templates.

    Records ``inductor_tune_s`` (first call: compile and autotune, seconds), ``inductor_us``,
    ``inductor_ratio`` (torch.matmul time / Inductor time) and ``vs_inductor`` (Inductor time /
    tritonmm time: above 1 means tritonmm is faster).
    """
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(max_autotune_gemm_backends="TRITON", max_autotune=True):
        compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            compiled(*inputs)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - e.g. no template fits: report, keep benchmarking
            row["inductor_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            return
        row["inductor_tune_s"] = time.perf_counter() - t0
        row["inductor_us"] = _bench_us(lambda: compiled(*inputs), args.rep)
    row["inductor_ratio"] = row["torch_us"] / row["inductor_us"]
    row["vs_inductor"] = row["inductor_us"] / row["tritonmm_us"]


def bench_linear_row(shape: dict, dtype: torch.dtype, args, gen) -> dict:
    import torch.nn.functional as F

    import tritonmm
    from tritonmm.core.reference import error_report

    M, N, K = shape["M"], shape["N"], shape["K"]
    x, w, bias = _linear_operands(shape, dtype, gen)
    row = {"tag": shape["tag"], "M": M, "N": N, "K": K, "dtype": str(dtype)[6:], "op": "linear+bias+gelu"}
    d = tritonmm.explain(x, w.t())
    row["backend"] = _backend_label(d)
    row["first_call_ms"] = _first_call_ms(lambda: tritonmm.linear(x, w, bias, "gelu"))
    row["torch_us"], row["tritonmm_us"] = _bench_pair(lambda: F.gelu(F.linear(x, w, bias)),
                                                      lambda: tritonmm.linear(x, w, bias, "gelu"), args.rep)
    with tritonmm.force_backend("triton"):
        tritonmm.linear(x, w, bias, "gelu")
        row["kernel_us"] = _bench_us(lambda: tritonmm.linear(x, w, bias, "gelu"), args.rep)
        out = tritonmm.linear(x, w, bias, "gelu")
    if not args.no_check:
        rep = error_report(out, x, w, ref_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias.double())),
                           torch_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias)), contract=F.linear)
        row.update(kernel_ok=rep["ok"], kernel_err=rep["tri_err"], torch_err=rep["torch_err"])
    flop = 2.0 * M * N * K
    for key in ("torch", "tritonmm", "kernel"):
        if f"{key}_us" not in row:
            continue
        row[f"{key}_tflops"] = flop / row[f"{key}_us"] / 1e6
    row["ratio"] = row["torch_us"] / row["tritonmm_us"]
    row["kernel_ratio"] = row["torch_us"] / row["kernel_us"]
    return row
