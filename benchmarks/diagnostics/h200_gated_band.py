"""Whether the gated GEMM kernel (pointer kernel, first-sight tuning's pool) beats the torch expression (two
F.linear, SiLU, product) in GPU time above 16 rows: gated_tuning.measure per geometry, MLP widths of the model
benchmark's configs and TinyLlama, bf16, no bias. Writes $OUT/h200_gated_band.json."""
import json
import os
import time

import torch

from tritonmm.dispatch import gated_tuning

dev = torch.device("cuda")
rows = []
for name, N, K in (("small", 2816, 1024), ("tinyllama", 5632, 2048), ("llama3-8b", 14336, 4096)):
    for M in (32, 64, 128, 256, 512, 1024, 2048):
        flops = 2 * M * N * K
        if flops > 2**35:
            continue
        t0 = time.perf_counter()
        e = gated_tuning.measure(dev, torch.bfloat16, M, N, K, "silu")
        s = time.perf_counter() - t0
        tried = len([c for c in e.get("configs", []) or []]) if isinstance(e.get("configs"), list) else None
        row = {"config": name, "M": M, "N": N, "K": K, "flops": flops, "backend": e["backend"],
               "torch_us": e["torch_us"], "kernel_us": e["triton_us"],
               "ratio": e["torch_us"] / e["triton_us"] if e["triton_us"] else None,
               "config_picked": e.get("config"), "seconds": round(s, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "h200_gated_band.json"), "w") as f:
    json.dump({"what": __doc__, "rows": rows}, f, indent=1)
