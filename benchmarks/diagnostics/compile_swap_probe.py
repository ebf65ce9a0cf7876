"""Diagnostic: a Llama-3-8B-sized model (bench --model's llama3-8b-2l, bf16) compiled with ``swap_linear``
against compiled off, prefill 4 x 1024, with the last position's logits only (as ``generate`` prefills) and with
every position's: wall time per call of each, the kernels each spends its GPU time in (torch.profiler, top rows),
and what ``tritonmm.explain`` says of the lm_head's GEMM at the row count each runs. The question it answers: what a
swapped model's compiled prefill spends its time on where it is slower than off.

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/compile_swap_probe.py   (writes $OUT/compile_swap_probe.json)
"""

import copy
import json
import os
import statistics

import torch

import tritonmm
from tritonmm.bench import model as bench_model
from tritonmm.bench.timing import machine_facts, wall_ms

device = torch.device("cuda")
model = bench_model.build_model("llama3-8b-2l", device, torch.bfloat16)
ids = bench_model._tokens(model.config.vocab_size, 4, 1024, device)
shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
copies = {m: copy.deepcopy(model, memo=dict(shared)) for m in ("off", "swap")}
tritonmm.swap_linear(copies["swap"])
compiled = {m: torch.compile(c) for m, c in copies.items()}
out = {"what": __doc__.split("\n\n")[0], "machine": machine_facts(), "rows": []}
w = model.lm_head.weight
for rows_kept, kw in (("last", {"logits_to_keep": 1}), ("all", {})):
    row = {"logits": rows_kept}
    with torch.no_grad():
        for m, fn in compiled.items():
            for _ in range(3):
                fn(ids, use_cache=False, **kw)
        for r in range(4):  # alternated
            for m, fn in compiled.items():
                row.setdefault(f"{m}_ms", []).append(wall_ms(lambda: fn(ids, use_cache=False, **kw), device, 5))
        for m, fn in compiled.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn(ids, use_cache=False, **kw)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90)
            row[f"{m}_kernels"] = table
            print(f"== {rows_kept} logits, {m}\n{table}")
    M = 4 if rows_kept == "last" else 4 * 1024
    a = torch.randn(M, w.shape[1], device=device, dtype=w.dtype)
    row["lm_head_explain"] = str(tritonmm.explain(a, w.t()))
    row.update({k: statistics.median(v) for k, v in list(row.items()) if k.endswith("_ms")})
    print({k: v for k, v in row.items() if not k.endswith("_kernels")})
    out["rows"].append(row)
out["dynamo_counters"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
print(out["dynamo_counters"])
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "compile_swap_probe.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
