"""Host and wall time per call of a transformers LlamaMLP forward without autograd (bf16): the module unfused
against the fused MLP's paths and one written here, at decode to prefill rows.

Paths: ``module`` (unfused), ``fused`` (tritonmm.fuse, packed weights, as the package chooses), ``gated_kernel``
(the gated Triton GEMM, up to gated.GATED_MAX_M rows; as ``fused`` there), ``product`` (above it: cuBLAS on the
packed weights and the Triton product pass, gated.PRODUCT_MIN_FLOPS_NO_GRAD set to 0) and ``packed_torch``
(:func:`packed_torch`: one cuBLAS GEMM on the packed [Wg; Wu], torch's SiLU and product on its two strided halves,
then down_proj as F.linear). Each sample: ``torch.cuda.synchronize()``, 20 calls (``issue_us``: until the last
returns, per call), then ``torch.cuda.synchronize()`` (``wall_us``, per call); the paths alternate within each of
30 rounds; medians.

Usage: PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_mlp_paths.py  (prints; writes $OUT/h200_mlp_paths.json)
"""
import contextlib
import copy
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import tritonmm
from tritonmm import gated, packing

dev = torch.device("cuda")
PATHS = {
    "fused": {},
    "gated_kernel": {},  # (rows above GATED_MAX_M: skipped)
    "product": {"PRODUCT_MIN_FLOPS_NO_GRAD": 0},  # (up to GATED_MAX_M rows: skipped)
}


def packed_torch(mlp):
    """The MLP's forward with gate and up as one GEMM on its packed weights, in torch's kernels."""
    w = packing.stacked((mlp.gate_proj.weight, mlp.up_proj.weight))
    down = mlp.down_proj.weight

    def forward(x):
        g, u = F.linear(x, w).chunk(2, -1)
        return F.linear(F.silu(g).mul_(u), down)

    return forward


@contextlib.contextmanager
def patched(values):
    old = {k: getattr(gated, k) for k in values}
    for k, v in values.items():
        setattr(gated, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(gated, k, v)


def sample(fn, n=20):
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    t2 = time.perf_counter_ns()
    return (t1 - t0) / n / 1e3, (t2 - t0) / n / 1e3


def main():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    rows_out = []
    for hidden, inter in ((4096, 14336), (1024, 2816)):
        torch.manual_seed(0)
        with torch.device(dev):
            mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter)).to(torch.bfloat16)
        fused = tritonmm.fuse(copy.deepcopy(mlp))
        for M in (1, 16, 64, 512, 4096):
            x = torch.randn(1, M, hidden, device=dev, dtype=torch.bfloat16)
            paths = {"module": ({}, mlp), "packed_torch": ({}, packed_torch(fused))}
            for name, values in PATHS.items():
                if name == "gated_kernel" and M > gated.GATED_MAX_M or name == "product" and M <= gated.GATED_MAX_M:
                    continue
                paths[name] = (values, fused)
            times = {n: [] for n in paths}
            with torch.no_grad():
                want = mlp(x).float()
                for name, (values, m) in paths.items():
                    with patched(values):
                        err = (m(x).float() - want).abs().max().item()
                        for _ in range(3):
                            sample(lambda: m(x), 5)
                    assert err < 0.05 * want.abs().max().item(), (name, err)
                for r in range(30):
                    order = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
                    for name in order:
                        values, m = paths[name]
                        with patched(values):
                            times[name].append(sample(lambda: m(x)))
            row = {"hidden": hidden, "intermediate": inter, "rows": M}
            for name, t in times.items():
                row[f"{name}_issue_us"] = round(statistics.median(a for a, _ in t), 2)
                row[f"{name}_wall_us"] = round(statistics.median(b for _, b in t), 2)
            print(row)
            rows_out.append(row)
        del mlp, fused
        torch.cuda.empty_cache()
    d = os.environ.get("OUT", "/tmp/out")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "h200_mlp_paths.json"), "w") as f:
        json.dump({"what": __doc__.split("\n\n")[0], "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
