"""Whether first-sight tuning's Triton picks help or hurt a Llama-3-8B-sized model (2 layers, random weights) on
this GPU: one training step (fp32 weights, bf16 autocast, AdamW, 8 x 2048 tokens) with the layers swapped, the
table entries first-sight tuning wrote, the dispatcher's decision for every GEMM of the step and of 1 x 512 /
4 x 1024 prefills, and the step alternated off / swapped / swapped with cuBLAS forced. Run from the repository
root with PYTHONPATH=. on a GPU; prints its findings (benchmarks/h200_first_sight_in_model.json)."""
import json, pathlib, time, torch
import tritonmm
from tritonmm import tuned, routes, first_sight
from tritonmm.bench import model as bm

dev = torch.device("cuda")
model = bm.build_model("llama3-8b-2l", dev, torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
ids = bm._tokens(model.config.vocab_size, 8, 2048, dev)
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
step()
tritonmm.swap_linear(model)
t0 = time.time()
for _ in range(3): step()
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for b_, s_ in ((1, 512), (4, 1024)):
        for _ in range(2):
            model(bm._tokens(model.config.vocab_size, b_, s_, dev), use_cache=False)
torch.cuda.synchronize()
print("swapped steps incl. first sight", round(time.time() - t0, 2), "s; first-sight stats", first_sight.stats)
d = tuned.user_dir()
for f in sorted(pathlib.Path(d).rglob("*.json")):
    data = json.loads(f.read_text())
    ents = data.get("entries", data)
    print("table", f, len(ents))
    for k, e in (ents.items() if isinstance(ents, dict) else []):
        print("  ", k, {kk: e.get(kk) for kk in ("backend", "kernel", "torch_us", "triton_us", "ratio", "prior") if kk in e})
seen = set()
for name, mod in [(f"{n} M={M}", m) for M in (512, 4096, 16384) for n, m in model.named_modules()]:
    if isinstance(mod, torch.nn.Linear):
        N, K = mod.weight.shape
        M = int(name.split("M=")[1])
        if (N, K, M) in seen: continue
        seen.add((N, K, M))
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16); w = mod.weight.detach().to(torch.bfloat16)
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        for what, (a, b) in {"fwd": (x, w.t()), "dX": (dy, w), "dW": (dy.t(), x)}.items():
            e = tritonmm.explain(a, b)
            print(f"{name:32s} N={N} K={K} {what}: {e.backend} {e.kernel} | {e.reason[:110]}")
print("routes cached:", sum(isinstance(v, routes.Route) for v in routes._cache.values()), "of", len(routes._cache))
tritonmm.unswap_linear(model)
import contextlib
runs = {"off": (contextlib.nullcontext, step), "swap": (lambda: bm.mode("swap", model), step)}
@contextlib.contextmanager
def _swap_torch():
    with bm.mode("swap", model), tritonmm.force_backend("torch"):
        yield
runs["swap_torch"] = (_swap_torch, step)
ms = bm.alternate(runs, dev, 9, iters=2)
import statistics
for k, v in ms.items():
    print(k, round(statistics.median(v), 2), "same-round off/this median", round(statistics.median(o / t for o, t in zip(ms["off"], v)), 4), [round(t, 1) for t in v])
