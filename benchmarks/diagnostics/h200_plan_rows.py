"""Host time per call of a swapped nn.Linear and of tritonmm.linear against nn.Linear / F.linear, for the
Llama-3-8B lm_head's weight (128256 x 4096, bf16: some of its GEMMs reach Triton in the H200's table, so its
plan is 0) with and without the plan's record of input sizes whose forward resolved to torch
(``plans.ROWS_MAX`` 0: none kept), and for a weight every GEMM of which goes to cuBLAS (4096 x 4096).

Each figure: the median over 15 rounds (the variants alternating) of the minimum of 5 timeit repeats of 50 calls,
``torch.cuda.synchronize()`` before each repeat (the host time to issue a call).

Usage: PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_plan_rows.py  (prints; writes $OUT/h200_plan_rows.json)
"""
import copy
import json
import os
import statistics
import timeit

import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.dispatch import plans

dev = torch.device("cuda")
rows = []
for N, K in ((128256, 4096), (4096, 4096)):
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    sw = tritonmm.swap_linear(copy.deepcopy(lin))
    w = sw.weight
    for M in (1, 16):
        for grad in (False, True):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=grad)
            g = dict(lin=lin, sw=sw, x=x, w=w, F=F, tritonmm=tritonmm, torch=torch)
            stmts = {"nn.Linear": "lin(x)", "swapped": "sw(x)", "F.linear": "F.linear(x, w)",
                     "tritonmm.linear": "tritonmm.linear(x, w)"}
            times = {}
            ctx = torch.enable_grad() if grad else torch.no_grad()
            with ctx:
                for r in range(15):
                    for rows_max in ((64, 0) if r % 2 else (0, 64)):
                        plans.ROWS_MAX = rows_max
                        tritonmm.clear_cache()
                        sw(x), tritonmm.linear(x, w)  # the plans
                        sw(x), tritonmm.linear(x, w)
                        for name, s in stmts.items():
                            if rows_max == 0 and name in ("nn.Linear", "F.linear"):
                                continue
                            t = min(timeit.repeat(s, "torch.cuda.synchronize()", globals=g, number=50, repeat=5)) / 50
                            key = name if name in ("nn.Linear", "F.linear") else f"{name}{'' if rows_max else ' (no sizes kept)'}"
                            times.setdefault(key, []).append(t * 1e6)
            row = {"N": N, "K": K, "M": M, "grad": grad, "plan": plans.plans[id(w)][0],
                   **{f"{k} us": round(statistics.median(v), 2) for k, v in times.items()}}
            print(row)
            rows.append(row)
    del lin, sw
    torch.cuda.empty_cache()
plans.ROWS_MAX = 64
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "h200_plan_rows.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "rows": rows}, f, indent=1)
