"""Compile the TMA kernel for sm_90 (Hopper) without a GPU and print one JSON line per build:
config, variant, shared memory in bytes, or the error. Run by tests/test_sm90_build.py in a
subprocess (Triton's interpreter, which the CPU test run enables, cannot compile)."""

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tritonmm.kernels import configs as cfg
from tritonmm.kernels import tma as km

VARIANTS = {  # (A_TRANS, B_TRANS, C_TMA, HAS_BIAS, ACTIVATION, integer arguments Triton specializes to 1)
    "nn": (False, False, True, False, "none", ()),
    "nt-bias-gelu-cptr": (False, True, False, True, "gelu", ()),
    "m1-n1": (False, True, True, False, "none", ("M", "N", "stride_p")),  # a decode row: M = 1 is a constant
}


def build(config: dict, variant: str) -> dict:
    fn = km._matmul_tma_kernel
    a_trans, b_trans, c_tma, bias, act, ones = VARIANTS[variant]
    const = {k: v for k, v in config.items() if k not in ("num_stages", "num_warps")}
    const.update({k: 1 for k in ones})
    const.update(NUM_SMS=132, A_TRANS=a_trans, B_TRANS=b_trans, C_TMA=c_tma, HAS_BIAS=bias, ACTIVATION=act,
                 INPUT_PRECISION="tf32", UPCAST=False)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16", p_ptr="*fp32", lock_ptr="*i32")
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    row = {"config": config, "variant": variant}
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_stages": config["num_stages"], "num_warps": config["num_warps"]})
        row["shared"] = k.metadata.shared
    except Exception as exc:  # reported, the test decides
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "split"
    for c in cfg.candidates("tma"):
        if which == "all" or c["SPLIT_K"] > 1:
            for v in VARIANTS:
                print(json.dumps(build(c, v)), flush=True)
