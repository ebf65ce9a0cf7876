"""GPU probe for kernel work (issue 4): host overhead per path, decode config sweep, padded cuBLAS on
unaligned shapes. Prints one line per measurement and writes $OUT/probe.json. Not part of the package.

    python benchmarks/probe.py overhead decode padded
"""
import itertools
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

import tritonmm
from tritonmm.kernels import matmul as km

OUT = os.environ.get("OUT", "/tmp/out")
res = {}
torch.manual_seed(0)


def us(fn, rep=20):
    return do_bench(fn, warmup=5, rep=rep, return_mode="median") * 1e3


def host_us(fn, n=3000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def overhead():
    r = res.setdefault("overhead", {})
    for (M, N, K) in ((16, 64, 64), (1, 4096, 4096), (1024, 1024, 1024)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        row = {"torch_host": host_us(lambda: torch.matmul(a, b)), "torch_bench": us(lambda: torch.matmul(a, b))}
        for k in ("pointer", "tma", "splitk"):
            with tritonmm.force_backend("triton", k):
                tritonmm.matmul(a, b)
                row[k + "_host"] = host_us(lambda: tritonmm.matmul(a, b))
                row[k + "_bench"] = us(lambda: tritonmm.matmul(a, b))
                cfg = tritonmm.explain(a, b).config
            if cfg:  # the same config passed explicitly (what tune does)
                with tritonmm.force_backend("triton", k, cfg):
                    tritonmm.matmul(a, b)
                    row[k + "_cfg_host"] = host_us(lambda: tritonmm.matmul(a, b))
                    row[k + "_cfg_bench"] = us(lambda: tritonmm.matmul(a, b))
        r[f"{M}x{N}x{K}"] = row
        print("overhead", M, N, K, {k: round(v, 1) for k, v in row.items()}, flush=True)


def decode():
    r = res.setdefault("decode", [])
    NK = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
    cfgs = []
    for bn, bk, st, w in itertools.product((32, 64, 128), (128, 256, 512), (3, 5), (4, 8)):
        if bk * bn * 2 * st > 200 * 1024 or (bk == 512 and bn == 128):
            continue
        cfgs.append(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_stages=st, num_warps=w))
    t0 = time.time()
    for M in (1, 16):
        for layout in ("nn", "nt"):
            for N, K in NK:
                if time.time() - t0 > float(os.environ.get("DECODE_BUDGET", 200)):
                    print("decode: time budget spent", flush=True)
                    return
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) if layout == "nn" else \
                    torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
                ref = a.double() @ b.double()
                t_torch = us(lambda: torch.matmul(a, b))
                rows = []
                sms = 132
                for cfg in cfgs:
                    tiles = triton.cdiv(N, cfg["BLOCK_N"])
                    splits = [1] + [s for s in (2, 4, 8) if tiles * s <= 4 * sms and K // s >= cfg["BLOCK_K"] * 2]
                    for s in splits:
                        c = dict(cfg, SPLIT_K=s) if s > 1 else cfg
                        kern = "splitk" if s > 1 else "pointer"
                        try:
                            launch = km.pointer_launcher(M, N, K, 1, 1, (0, 0, *a.stride()), (0, 0, *b.stride()),
                                                         (0, 0, N, 1), a.dtype, a.device, config=c, split_k=s > 1)
                            out = torch.empty(M, N, device="cuda", dtype=a.dtype)
                            launch(a, b, out, None)
                            err = (out.double() - ref).abs().max().item()
                            t = us(lambda: launch(a, b, out, None))
                            rows.append(dict(cfg=c, us=t, err=err))
                        except Exception as e:
                            rows.append(dict(cfg=c, err=str(e)[:100]))
                ok = sorted([x for x in rows if "us" in x], key=lambda x: x["us"])
                gb = (N * K * 2) / 1e3
                best = ok[0] if ok else None
                line = dict(M=M, N=N, K=K, layout=layout, torch_us=t_torch, torch_tbs=gb / t_torch / 1e3,
                            best=best, top5=ok[:5], n=len(rows))
                if best:
                    kern = "splitk" if "SPLIT_K" in best["cfg"] else "pointer"
                    with tritonmm.force_backend("triton", kern, best["cfg"]):
                        line["forced_us"] = us(lambda: tritonmm.matmul(a, b))
                r.append(line)
                print(f"decode M={M} N={N} K={K} {layout}: torch {t_torch:.1f} us ({gb / t_torch / 1e3:.2f} TB/s) "
                      f"best {best['us'] if best else float('nan'):.1f} us ratio "
                      f"{t_torch / best['us'] if best else 0:.2f} cfg {best['cfg'] if best else None} forced {line.get('forced_us', 0):.1f}", flush=True)


def padded():
    r = res.setdefault("padded", [])
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for n in (4095, 4097, 1000, 2305, 3000):
            a = torch.randn(n, n, device="cuda", dtype=dt)
            b = torch.randn(n, n, device="cuda", dtype=dt)
            t_torch = us(lambda: torch.matmul(a, b), rep=50)
            line = dict(dtype=str(dt), n=n, torch_us=t_torch)
            for g in (8, 64):
                p = -(-n // g) * g
                ap = torch.zeros(n, p, device="cuda", dtype=dt)
                bp = torch.zeros(p, p, device="cuda", dtype=dt)
                cp = torch.empty(n, p, device="cuda", dtype=dt)

                def run():
                    ap[:, :n].copy_(a)
                    bp[:n, :n].copy_(b)
                    torch.mm(ap, bp, out=cp)
                    return cp[:, :n].contiguous()
                err = (run().double() - a.double() @ b.double()).abs().max().item()
                ref_err = (torch.matmul(a, b).double() - a.double() @ b.double()).abs().max().item()
                line[f"pad{g}_us"] = us(run, rep=50)
                line[f"pad{g}_mm_us"] = us(lambda: torch.mm(ap, bp, out=cp), rep=50)
                line[f"pad{g}_err"] = err
                line["torch_err"] = ref_err
            with tritonmm.force_backend("triton", "tma"):
                line["tma_us"] = us(lambda: tritonmm.matmul(a, b), rep=50)
            r.append(line)
            print("padded", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in line.items()}, flush=True)


for step in sys.argv[1:]:
    t = time.time()
    try:
        globals()[step]()
    except Exception as e:
        print("STEP FAILED", step, type(e).__name__, e, flush=True)
    print(f"== {step} {time.time() - t:.0f} s", flush=True)
    os.makedirs(OUT, exist_ok=True)
    json.dump(res, open(os.path.join(OUT, "probe.json"), "w"), indent=1)
