"""Whether first-sight tuning's Triton picks help or hurt a Llama-3-8B-sized model (2 layers, random weights) on
this GPU: one training step (fp32 weights, bf16 autocast, AdamW, 8 x 2048 tokens) with the layers swapped, the
table entries first-sight tuning wrote, the dispatcher's decision for every GEMM of the step and of 1 x 512 /
4 x 1024 prefills, and the step alternated off / swapped / swapped with cuBLAS forced. Run from the repository
root with PYTHONPATH=. on a GPU; prints its findings (benchmarks/diagnostics/h200_first_sight_in_model.json)."""
import contextlib
import json
import pathlib
import statistics
import time

import torch

import tritonmm
from tritonmm.bench import model as bm
from tritonmm.dispatch import first_sight, tuned
from tritonmm.ops import routes

dev = torch.device("cuda")
model = bm.build_model("llama3-8b-2l", dev, torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
ids = bm._tokens(model.config.vocab_size, 8, 2048, dev)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


step()
tritonmm.swap_linear(model)
t0 = time.time()
for _ in range(3):
    step()
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for batch, seq in ((1, 512), (4, 1024)):
        for _ in range(2):
            model(bm._tokens(model.config.vocab_size, batch, seq, dev), use_cache=False)
torch.cuda.synchronize()
print("swapped steps incl. first sight", round(time.time() - t0, 2), "s; first-sight stats", first_sight.stats)
for f in sorted(pathlib.Path(tuned.user_dir()).rglob("*.json")):
    ents = json.loads(f.read_text()).get("entries", {})
    print("table", f, len(ents))
    for k, e in ents.items():
        print("  ", k, {kk: e.get(kk) for kk in ("backend", "kernel", "torch_us", "triton_us", "ratio", "prior") if kk in e})
seen = set()
for M in (512, 4096, 16384):
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or (*mod.weight.shape, M) in seen:
            continue
        N, K = mod.weight.shape
        seen.add((N, K, M))
        x, dy = torch.randn(M, K, device=dev, dtype=torch.bfloat16), torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        w = mod.weight.detach().to(torch.bfloat16)
        for what, (a, b) in {"fwd": (x, w.t()), "dX": (dy, w), "dW": (dy.t(), x)}.items():
            e = tritonmm.explain(a, b)
            print(f"{name + ' M=' + str(M):32s} N={N} K={K} {what}: {e.backend} {e.kernel} | {e.reason[:110]}")
print("routes cached:", sum(isinstance(v, routes.Route) for v in routes._cache.values()), "of", len(routes._cache))
tritonmm.unswap_linear(model)


@contextlib.contextmanager
def swap_torch():
    with bm.mode("swap", model), tritonmm.force_backend("torch"):
        yield


runs = {"off": (contextlib.nullcontext, step), "swap": (lambda: bm.mode("swap", model), step), "swap_torch": (swap_torch, step)}
ms = bm.alternate(runs, dev, 9, iters=2)
for k, v in ms.items():
    print(k, round(statistics.median(v), 2), "same-round off/this median",
          round(statistics.median(o / t for o, t in zip(ms["off"], v)), 4), [round(t, 1) for t in v])
