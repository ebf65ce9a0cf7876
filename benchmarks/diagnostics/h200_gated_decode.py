"""The gated GEMM kernel at decode sizes against the torch expression it replaces (two F.linear, SiLU, product),
bf16, per config of its pruned pool and autotuned: GPU time with L2 flushed as first-sight tuning times it
(``first_sight._times``), and back to back without flushing (a loop of 200 calls between CUDA events), with
each config's first-launch (compile) seconds.

Run from the repository root: ``PYTHONPATH=$PWD OUT=DIR python3 benchmarks/diagnostics/h200_gated_decode.py`` writes
``DIR/h200_gated_decode.json``.
"""

import json
import os
import time

import torch
import torch.nn.functional as F

from tritonmm.device import num_sms, smem_limit
from tritonmm.dispatch import first_sight
from tritonmm.kernels import gated_launchers as gl

GEOMETRIES = [(1, 14336, 4096), (16, 14336, 4096), (1, 5632, 2048), (16, 5632, 2048)]


def loop_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def main():
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for M, N, K in GEOMETRIES:
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=dt, generator=gen)
        wg, wu = (torch.randn(N, K, device=dev, dtype=dt, generator=gen) / K**0.5 for _ in range(2))

        def eager():
            return F.silu(F.linear(x, wg)) * F.linear(x, wu)

        names, fns, compile_s = ["torch"], [eager], [None]
        pool = gl.prune("pointer", list(gl._candidates("pointer")), M, N, K, 2, smem_limit(dev), num_sms(dev), keep=8)
        for cfg in pool + [None]:
            t0 = time.perf_counter()
            launch = gl.gated_launcher("pointer", M, N, K, K, K, K, dt, dev, None, False, "silu", cfg)

            def run(launch=launch):
                h = torch.empty(M, N, device=dev, dtype=dt)
                launch(x, wg, wu, None, None, h, None, None)
                return h
            err = (run().float() - eager().float()).abs().max().item()
            torch.cuda.synchronize()
            compile_s.append(round(time.perf_counter() - t0, 3))
            names.append(json.dumps(cfg if cfg is not None else {"autotuned": launch.state["config"]}))
            fns.append(run)
            print(M, N, K, names[-1], "first launch s", compile_s[-1], "max err", err, flush=True)
        flushed = first_sight._times(fns, 30)
        unflushed = [loop_us(f) for f in fns]
        for name, c, f, u in zip(names, compile_s, flushed, unflushed):
            rows.append({"M": M, "N": N, "K": K, "contender": name, "first_launch_s": c, "flushed_us": round(f, 2),
                         "loop_us": round(u, 2)})
            print(f"{M:3} {N:6} {K:5} {name:90} flushed {f:8.2f} us  loop {u:8.2f} us", flush=True)
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "h200_gated_decode.json"), "w") as fh:
        json.dump({"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
