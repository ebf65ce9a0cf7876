"""Without a GPU: every kernel path through Triton's interpreter on small problems, checked against float64."""

from __future__ import annotations

import os

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cpu_check() -> int:
    """No GPU: run each kernel path through the interpreter on small problems and check them (and the
    padded path, cuBLAS on padded copies, as torch.mm on CPU). ``TRITON_INTERPRET`` is set to 1 for it (a
    note says so where it was 0); a path that the interpreter did not run counts as failed."""
    import torch.nn.functional as F

    import tritonmm
    from tritonmm.core.env import interpreting

    if not interpreting():  # (a value that is neither on nor off raises ValueError naming the variable)
        if "TRITON_INTERPRET" in os.environ:
            print(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} set to 1 for this check.")
        os.environ["TRITON_INTERPRET"] = "1"
        tritonmm.clear_cache()
    from tritonmm.core.reference import error_report, randn
    from tritonmm.kernels import configs

    print("No CUDA GPU: running the Triton kernels through Triton's interpreter (TRITON_INTERPRET=1) "
          "on small problems and checking them against float64 references.")
    torch.manual_seed(0)
    failures = 0
    print(f"{'dtype':9} {'kernel':10} {'problem':24} {'max err':>10} {'bound':>10}  result")
    tma_split = dict(configs.interpreter_config("tma"), SPLIT_K=3, EPILOGUE_SUBTILE=0)  # 3 uneven K slices
    for dtype in DTYPES.values():
        for kernel in ("tma", "tma-splitk", "pointer", "splitk", "padded"):
            force = {"padded": ("torch", "padded"), "tma-splitk": ("triton", "tma", tma_split)}.get(kernel,
                                                                                                ("triton", kernel))
            for what in ("matmul 97x83x71", "linear+bias+gelu 45x61x53"):
                with tritonmm.force_backend(*force):
                    if what.startswith("matmul"):
                        a, b = randn(97, 71, dtype=dtype), randn(71, 83, dtype=dtype)
                        rep = error_report(tritonmm.matmul(a, b), a, b)
                    else:
                        x, w, bias = randn(45, 53, dtype=dtype), randn(61, 53, dtype=dtype), randn(61, dtype=dtype)
                        rep = error_report(
                            tritonmm.linear(x, w, bias, "gelu"), x, w,
                            ref_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias.double())),
                            torch_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias)), contract=F.linear)
                        a, b = x, w.t()
                    ran = tritonmm.explain(a, b)  # the path taken (the interpreter's, or torch's on the CPU)
                    rep["ok"] = rep["ok"] and (ran.backend, ran.kernel) == (force[0], force[1])
                failures += not rep["ok"]
                print(f"{str(dtype)[6:]:9} {kernel:10} {what:24} {rep['tri_err']:>10.2e} {rep['bound']:>10.2e}  "
                      f"{'ok' if rep['ok'] else 'FAIL'}")
    print(f"\n{'all checks passed' if not failures else f'{failures} checks FAILED'}. "
          "Timings need a CUDA GPU: run `python -m tritonmm.bench` on one.")
    return 1 if failures else 0
