"""q, k and v as three GEMMs against one GEMM on the packed weights (triton.testing.do_bench, L2 flushed,
host launch gaps included), and the Llama-3-8B-sized model's prefill with a fused attention's one GEMM on
and off (MLPs fused in both), alternated as the model benchmark alternates, with a CUDA kernel profile
of one forward each (printed): python3 benchmarks/diagnostics/h200_qkv.py (writes $OUT/h200_qkv.json, default /tmp/out)."""
import contextlib
import json
import os

import torch
import triton
import tritonmm
from tritonmm import qkv
from tritonmm.bench import model as bm
dev = torch.device("cuda")
res = {}
F = torch.nn.functional
for (N, NK, K) in ((4096, 1024, 4096), (1024, 256, 1024)):
    wq, wk, wv = (torch.randn(n, K, device=dev, dtype=torch.bfloat16) / K**0.5 for n in (N, NK, NK))
    W = torch.cat([wq, wk, wv])
    for M in (1, 16, 128, 512, 1024, 2048, 4096):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        three = triton.testing.do_bench(lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)), rep=50, return_mode="median")
        one = triton.testing.do_bench(lambda: F.linear(x, W), rep=50, return_mode="median")
        res[f"gemm K={K} M={M}"] = {"three_us": three * 1e3, "one_us": one * 1e3, "ratio": three / one}
        print(f"K={K} M={M}: three {three*1e3:.1f} us, one {one*1e3:.1f} us, ratio {three/one:.3f}", flush=True)
m = bm.build_model("llama3-8b-2l", dev, torch.bfloat16)
tritonmm.fuse(m)
real = qkv._serve
def on(): qkv._serve = real
def no(): qkv._serve = lambda self, x: None
@contextlib.contextmanager
def ctx(f):
    f(); yield
for B, S in ((1, 512), (1, 1024), (2, 512)):
    ids = bm._tokens(m.config.vocab_size, B, S, dev)
    with torch.no_grad():
        t = bm.alternate({"off": (lambda: ctx(no), lambda: m(ids, use_cache=False)), "qkv": (lambda: ctx(on), lambda: m(ids, use_cache=False))}, dev, 30, iters=3)
    row = bm._row(f"prefill {B}x{S}", "8b", t)
    res[row["phase"]] = {k: v for k, v in row.items() if k.endswith("ratio") or k.endswith("_ms")}
    print(row["phase"], res[row["phase"]], flush=True)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        on(); m(ids, use_cache=False); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        no(); m(ids, use_cache=False); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
about = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "dtype": "bfloat16"}  # (the committed file adds the keys' legend)
out = os.environ.get("OUT", "/tmp/out")
os.makedirs(out, exist_ok=True)
json.dump({"about": about, "rows": res}, open(os.path.join(out, "h200_qkv.json"), "w"), indent=1)
