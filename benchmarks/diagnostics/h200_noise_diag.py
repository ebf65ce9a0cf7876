"""Whether pinning the benchmark's main thread to one CPU core narrows the model benchmark's A/A spread on this
host: small-config eager prefill and training step, off / swap / control, in blocks alternating unpinned and
pinned. Run from the repository root with PYTHONPATH=. on a GPU; prints per block the ratios and the spread
(interquartile range) of the per-round ratios (benchmarks/diagnostics/h200_decode_diag.json, ``pinning``)."""
import os
import statistics
import subprocess
import timeit

import torch

from tritonmm.bench import model as bm

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(subprocess.run("lscpu | head -20; nproc", shell=True, capture_output=True, text=True).stdout)
cores = sorted(os.sched_getaffinity(0))
print("affinity", cores)
model = bm.build_model("small" if dev.type == "cuda" else "tiny", dev, torch.bfloat16)
ids = bm._tokens(model.config.vocab_size, 1, 512, dev)
tmodel = bm.build_model("small" if dev.type == "cuda" else "tiny", dev, torch.float32).train()
opt = torch.optim.AdamW(tmodel.parameters(), lr=1e-5, fused=dev.type == "cuda")
tids = bm._tokens(tmodel.config.vocab_size, 4, 512, dev)


def prefill():
    with torch.no_grad():
        model(ids, use_cache=False)


def step():
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss = tmodel(tids, labels=tids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def spread(times, m):
    r = [times["off"][i] / times[m][i] for i in range(len(times[m]))]
    q = statistics.quantiles(r, n=4)
    return q[2] - q[0]


for block in range(4):
    pinned = block % 2 == 1
    os.sched_setaffinity(0, {cores[-2]} if pinned else set(cores))
    for name, fn, mdl, iters in (("prefill 1x512", prefill, model, 3), ("train 4x512", step, tmodel, 2)):
        runs = {m: (lambda m=m, mdl=mdl: bm.mode(m, mdl), fn) for m in ("off", "swap")}
        t = bm.alternate(runs, dev, 30 if dev.type == "cuda" else 3, iters=iters)
        row = bm._row(name, "small", t)
        print(f"block {block} pinned={pinned} {name}: swap {row['swap_ratio']:.4f} control {row['control_ratio']:.4f} "
              f"off {row['off_ms']:.3f} ms; spread(IQR of per-round ratio) swap {spread(t, 'swap'):.4f} "
              f"control {spread(t, 'control'):.4f}; off min/median/max {min(t['off']):.3f}/{statistics.median(t['off']):.3f}/{max(t['off']):.3f}")
os.sched_setaffinity(0, set(cores))
if dev.type == "cuda":
    x = torch.randn(4, device=dev)
    for s in ("torch.cuda.is_current_stream_capturing()", "x.is_cuda", "torch.compiler.is_compiling()"):
        print(f"{sorted(timeit.repeat(s, globals=globals(), number=20000, repeat=7))[3] / 20000 * 1e9:8.1f} ns {s}")
