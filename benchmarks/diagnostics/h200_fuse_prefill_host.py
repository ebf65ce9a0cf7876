"""Host time to issue one eager prefill (1 x 512, no grad) with tritonmm off against ``fuse``, and a profile of each.

Both modes on one model (the model benchmark's ``mode``: packed once, so off reads the same packed weights), 40 rounds
in alternating order, each after one untimed forward: ``issue`` is the time until ``model(ids)`` returns, ``wall``
until the following ``torch.cuda.synchronize()``; medians. Then 20 forwards of each mode under cProfile (top 22 by
own time, printed).

Usage: PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_fuse_prefill_host.py  (prints; writes
$OUT/h200_fuse_prefill_host.json)
"""
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch

from tritonmm.bench.model import _tokens, build_model, mode

dev = torch.device("cuda")
rows = {}
for config in ("llama3-8b-2l", "small"):
    model = build_model(config, dev, torch.bfloat16)
    ids = _tokens(model.config.vocab_size, 1, 512, dev)
    fwd = lambda: model(ids, use_cache=False)  # noqa: E731
    issue = {"off": [], "fuse": []}
    with torch.no_grad():
        for m in issue:
            with mode(m, model):
                for _ in range(3):
                    fwd()
        torch.cuda.synchronize()
        for r in range(40):
            for m in (("off", "fuse") if r % 2 else ("fuse", "off")):
                with mode(m, model):
                    fwd()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter_ns()
                    fwd()
                    t1 = time.perf_counter_ns()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter_ns()
                    issue[m].append(((t1 - t0) / 1e3, (t2 - t0) / 1e3))
        for m, v in issue.items():
            row = rows[f"{config} prefill 1 x 512 {m}"] = {"issue_us": statistics.median(a for a, _ in v),
                                                           "wall_us": statistics.median(b for _, b in v)}
            print(config, m, "issue us", row["issue_us"], "wall us", row["wall_us"])
        for m in ("off", "fuse"):
            with mode(m, model):
                fwd()
                torch.cuda.synchronize()
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(20):
                    fwd()
                torch.cuda.synchronize()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
                print("=====", config, m)
                print(s.getvalue()[-5000:])
    del model
    torch.cuda.empty_cache()
out_dir = os.environ.get("OUT", "/tmp/out")
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, "h200_fuse_prefill_host.json"), "w") as f:
    json.dump({"what": __doc__.split("\n\n")[0], "rows": rows}, f, indent=1)
