"""GPU probe for kernel work (issue 4): host overhead per path, decode config sweep, padded cuBLAS on
unaligned shapes, and the experiments listed in the README (one function per step, named on the command
line). Prints one line per measurement and writes $OUT/probe.json. Not part of the package.

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


def delayed(fn, seconds):
    """``fn`` behind a busy-wait of ``seconds`` of host time."""
    def run():
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass
        return fn()
    return run


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



# --------------------------------------------------------------------------- warp specialization probe
import triton.language as tl  # noqa: E402


@triton.jit
def _ws_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_SMS: tl.constexpr, WS_OUTER: tl.constexpr, WS_INNER: tl.constexpr, FLATTEN: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS_OUTER):
        pid_m, pid_n = km._group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(k_tiles, warp_specialize=WS_INNER):
            a = a_desc.load([om, ki * BLOCK_K])
            b = b_desc.load([ki * BLOCK_K, on])
            acc = tl.dot(a, b, acc)
        c_desc.store([om, on], acc.to(c_ptr.dtype.element_ty))


def ws():
    """Warp specialization (tl.range(..., warp_specialize=True)) on the H200 with Triton 3.6."""
    km._ensure_allocator()
    r = res.setdefault("ws", [])
    cfgs = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4),
            (256, 128, 64, 3, 8), (128, 256, 128, 2, 8)]
    variants = [("plain", False, False, True), ("ws_outer", True, False, True), ("ws_inner", False, True, False),
                ("ws_outer_noflat", True, False, False)]
    for (M, N, K) in ((4096, 4096, 4096), (8192, 8192, 8192), (2048, 28672, 4096)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.matmul(a, b)
        t_torch = us(lambda: torch.matmul(a, b), rep=100)
        flop = 2 * M * N * K
        print(f"ws {M}x{N}x{K}: cuBLAS {t_torch:.1f} us {flop / t_torch / 1e6:.0f} TFLOP/s", flush=True)
        for bm, bn, bk, st, w in cfgs:
            for name, wo, wi, fl in variants:
                c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                grid = (min(132, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)

                def run():
                    _ws_kernel[grid](a, b, c, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=132,
                                     WS_OUTER=wo, WS_INNER=wi, FLATTEN=fl, num_stages=st, num_warps=w)
                line = dict(M=M, N=N, K=K, cfg=(bm, bn, bk, st, w), variant=name, torch_us=t_torch)
                try:
                    t0 = time.time()
                    run()
                    torch.cuda.synchronize()
                    line["compile_s"] = time.time() - t0
                    line["err"] = (c.float() - ref.float()).abs().max().item()
                    t = us(run, rep=100)
                    line.update(us=t, tflops=flop / t / 1e6, ratio=t_torch / t)
                    print(f"  {name:16} {(bm, bn, bk, st, w)} {t:8.1f} us {flop / t / 1e6:6.0f} TFLOP/s "
                          f"ratio {t_torch / t:.3f} err {line['err']:.3g}", flush=True)
                except Exception as e:  # noqa: BLE001
                    line["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"  {name:16} {(bm, bn, bk, st, w)} ERROR {line['error'][:200]}", flush=True)
                r.append(line)


# --------------------------------------------------------------------------- decode floor
@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x.to(tl.float32)))


def _events_us(fn, n=200):
    """Median µs without do_bench's L2 flush (the weight may stay in L2 when it fits: 50 MB here)."""
    for _ in range(10):
        fn()
    s = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    e = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        s[i].record()
        fn()
        e[i].record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in zip(s, e))[n // 2] * 1e3


def floor():
    """The fastest any kernel can read a decode row's weight under the benchmark's timing (do_bench flushes
    L2 by zeroing 256 MB before each call, so dirty lines are written back while the next kernel reads)."""
    r = res.setdefault("floor", [])
    for (N, K) in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        n = w.numel()
        line = dict(N=N, K=K, gbytes=n * 2 / 1e9)
        for blk in (4096, 16384):
            out = torch.empty(triton.cdiv(n, blk), device="cuda", dtype=torch.float32)
            f = (lambda blk=blk, out=out: _read_kernel[(triton.cdiv(n, blk),)](w, out, n, BLOCK=blk, num_warps=8))
            line[f"read{blk}_us"] = us(f, rep=100)
            line[f"read{blk}_noflush_us"] = _events_us(f)
        for M in (1, 16):
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            line[f"cublas_m{M}_us"] = us(lambda: torch.matmul(a, w), rep=100)
            line[f"cublas_m{M}_noflush_us"] = _events_us(lambda: torch.matmul(a, w))
        best = min(line["read4096_us"], line["read16384_us"])
        line["best_read_us"] = best
        line["max_ratio_m1"] = line["cublas_m1_us"] / best
        line["max_ratio_m16"] = line["cublas_m16_us"] / best
        r.append(line)
        print("floor", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in line.items()}, flush=True)
    z = torch.empty(64 << 20, device="cuda", dtype=torch.float32)
    res["flush_zero_us"] = _events_us(lambda: z.zero_(), n=50)
    print("256 MB zero_ (do_bench's flush):", round(res["flush_zero_us"], 1), "us", flush=True)


# --------------------------------------------------------------------------- odd shapes with the copy kernel
def odd():
    """Odd shapes: torch.matmul, tritonmm (dispatcher), forced padded (PAD 64 and 8) and forced TMA, side by side."""
    from tritonmm import engine, padded as pd
    r = res.setdefault("odd", [])
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for (M, N, K) in ((4095, 4095, 4095), (4097, 4097, 4097), (2305, 2305, 2305), (1000, 1000, 1000),
                          (127, 257, 1023), (2304, 1544, 4096)):
            a = torch.randn(M, K, device="cuda", dtype=dt)
            b = torch.randn(K, N, device="cuda", dtype=dt)
            ref = a.double() @ b.double()
            line = dict(dtype=str(dt)[6:], M=M, N=N, K=K, torch_us=us(lambda: torch.matmul(a, b), rep=60))
            line["auto_us"] = us(lambda: tritonmm.matmul(a, b), rep=60)
            line["auto"] = str(tritonmm.explain(a, b).backend) + ":" + str(tritonmm.explain(a, b).kernel)
            for name, force, pad in (("padded64", ("torch", "padded"), 64), ("padded8", ("torch", "padded"), 8),
                                     ("padded128", ("torch", "padded"), 128), ("tma", ("triton", "tma"), 64)):
                if name == "tma" and (dt == torch.float32 or M not in (4095, 4097)):
                    continue  # each forced TMA geometry autotunes: keep to the rows it serves
                pd.PAD = pad
                engine._cache.clear()
                try:
                    with tritonmm.force_backend(*force):
                        out = tritonmm.matmul(a, b)
                        line[name + "_err"] = (out.double() - ref).abs().max().item()
                        line[name + "_us"] = us(lambda: tritonmm.matmul(a, b), rep=60)
                except Exception as e:  # noqa: BLE001
                    line[name + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            pd.PAD = 64
            engine._cache.clear()
            line["torch_err"] = (torch.matmul(a, b).double() - ref).abs().max().item()
            r.append(line)
            print("odd", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in line.items()}, flush=True)


def pairs():
    """Short rows that both contenders serve with the same cuBLAS kernel: the bench's alternating pair
    repeated 6 times, with the garbage collector on and off, against torch.matmul behind an added
    busy-wait of host time (is a slower host path visible in the event timing?); each with the bench's
    timer (a GPU spin after each L2 flush) and with plain do_bench."""
    import gc

    from tritonmm.bench import _bench_pair

    def _do_bench_pair(f0, f1, rounds=10, rep=6):
        times = ([], [])
        for _ in range(rounds):
            for i, fn in enumerate((f0, f1)):
                times[i].extend(do_bench(fn, warmup=3, rep=rep, return_mode="all"))
        return tuple(float(torch.tensor(t).median()) for t in times)

    r = res.setdefault("pairs", [])
    for dt in (torch.float16, torch.bfloat16):
        for (M, N, K) in ((1000, 1000, 1000), (127, 257, 1023), (1024, 1024, 1024)):
            a = torch.randn(M, K, device="cuda", dtype=dt)
            b = torch.randn(K, N, device="cuda", dtype=dt)
            tritonmm.matmul(a, b)
            line = dict(dtype=str(dt)[6:], M=M, N=N, K=K, auto=tritonmm.explain(a, b).backend)
            base = lambda: torch.matmul(a, b)  # noqa: E731
            for name, fn, gc_on in (("tritonmm", lambda: tritonmm.matmul(a, b), True),
                                    ("tritonmm_nogc", lambda: tritonmm.matmul(a, b), False),
                                    ("torch+10us", delayed(base, 10e-6), True),
                                    ("torch+40us", delayed(base, 40e-6), True)):
                (gc.enable if gc_on else gc.disable)()
                line[name] = [round(t / x, 3) for t, x in
                              (_bench_pair(base, fn, rep=60, rounds=10) for _ in range(6))]
                if gc_on:  # the same pair timed with plain do_bench (no spin after the flush)
                    line[name + "_do_bench"] = [round(t / x, 3) for t, x in
                                                (_do_bench_pair(base, fn) for _ in range(6))]
                gc.enable()
            line["host_us_torch"] = host_us(base)
            line["host_us_tritonmm"] = host_us(lambda: tritonmm.matmul(a, b))
            r.append(line)
            print("pairs", line, flush=True)


def aa():
    """A/A test of the bench timer: torch.matmul against itself (two lambdas), against itself behind
    10/40 µs of host busy-wait, and tritonmm (dispatched to the same cuBLAS call), in the bench's
    alternating pair; the spin after each flush at 0, 200k (bench default) and 1M cycles; raw
    per-round medians and quantiles saved, to tell noise from bias."""
    from tritonmm import bench as tb

    def pair_samples(f0, f1, rep=60, rounds=10):
        times, rounds_med = ([], []), ([], [])
        for _ in range(rounds):
            for i, fn in enumerate((f0, f1)):
                t = tb._event_times_ms(fn, max(rep / rounds, 3))
                times[i].extend(t)
                rounds_med[i].append(round(float(torch.tensor(t).median()) * 1e3, 2))
        def q(t):  # 5/25/50/75/95th percentiles, µs
            qs = torch.tensor([.05, .25, .5, .75, .95], dtype=torch.float64)
            return [round(v * 1e3, 2) for v in torch.tensor(t, dtype=torch.float64).quantile(qs).tolist()]
        return dict(ratio=round(float(torch.tensor(times[0]).median() / torch.tensor(times[1]).median()), 4),
                    n=(len(times[0]), len(times[1])), q0=q(times[0]), q1=q(times[1]),
                    rounds0=rounds_med[0], rounds1=rounds_med[1],
                    mean_ratio=round(float(torch.tensor(times[0]).mean() / torch.tensor(times[1]).mean()), 4))

    r = res.setdefault("aa", [])
    shapes = ((16, 4096, 4096, torch.bfloat16), (1, 4096, 4096, torch.float16), (127, 257, 1023, torch.float16),
              (1, 4096, 14336, torch.bfloat16), (2304, 1536, 4096, torch.bfloat16))
    for (M, N, K, dt) in shapes:
        a = torch.randn(M, K, device="cuda", dtype=dt)
        b = torch.randn(K, N, device="cuda", dtype=dt)
        tritonmm.matmul(a, b)
        base = lambda: torch.matmul(a, b)  # noqa: E731
        same = lambda: torch.matmul(a, b)  # noqa: E731
        for cycles in (200_000, 0, 1_000_000):
            tb.HOST_SHIELD_CYCLES = cycles
            variants = [("torch", same), ("tritonmm", lambda: tritonmm.matmul(a, b))]
            if cycles == 200_000:
                variants += [("torch+10us", delayed(base, 10e-6)), ("torch+40us", delayed(base, 40e-6))]
            for name, fn in variants:
                for rep in range(2 if cycles == 200_000 else 1):
                    line = dict(M=M, N=N, K=K, dtype=str(dt)[6:], cycles=cycles, vs=name, rep=rep,
                                **pair_samples(base, fn))
                    r.append(line)
                    print("aa", {k: v for k, v in line.items() if k not in ("rounds0", "rounds1")}, flush=True)
        tb.HOST_SHIELD_CYCLES = 200_000


def aa2():
    """A/A test of the bench's pair timer after the change to call-by-call interleaving: torch.matmul
    against itself (two lambdas) 3 times and against tritonmm (auto dispatch) twice, per shape."""
    from tritonmm import bench as tb

    r = res.setdefault("aa2", [])
    shapes = ((16, 4096, 4096, torch.bfloat16), (1, 4096, 4096, torch.float16), (127, 257, 1023, torch.float16),
              (1, 4096, 14336, torch.bfloat16), (2304, 1536, 4096, torch.bfloat16))
    shapes = [s for s in shapes if f"{s[0]}x{s[1]}x{s[2]}" in os.environ.get("AA_SHAPES", "")] or shapes
    shapes += [(512, 512, 512, torch.float16), (512, 512, 512, torch.bfloat16), (2304, 1536, 4096, torch.float16)] \
        if os.environ.get("AA_SMALL") else []
    for (M, N, K, dt) in shapes:
        a = torch.randn(M, K, device="cuda", dtype=dt)
        b = torch.randn(K, N, device="cuda", dtype=dt)
        tritonmm.matmul(a, b)
        line = dict(M=M, N=N, K=K, dtype=str(dt)[6:], auto=tritonmm.explain(a, b).backend)
        for name, fn, reps in (("torch", lambda: torch.matmul(a, b), 3), ("tritonmm", lambda: tritonmm.matmul(a, b), 2)):
            line[name] = []
            for _ in range(reps):
                t0, t1 = tb._bench_pair(lambda: torch.matmul(a, b), fn, rep=60)
                line[name].append([round(t0, 2), round(t1, 2), round(t0 / t1, 4)])
        r.append(line)
        print("aa2", line, flush=True)


def splitk_sweep():
    """Decode shapes (M = 1, 16): split-K configs with the in-kernel last-arriver reduction against the
    two-kernel reduction, each config timed with the bench timer; the best of each against torch.matmul
    in the bench's alternating pair. Layouts nn (weight (K, N)) and nt (nn.Linear weight (N, K))."""
    from tritonmm import bench as tb

    r = res.setdefault("splitk_sweep", [])
    cfgs = []
    for bn, bk, sk in itertools.product((32, 64, 128), (128, 256), (2, 4, 8, 16)):
        for st in (4,) if bk == 256 else (4, 6):
            cfgs.append(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_stages=st, num_warps=4, SPLIT_K=sk))
    dt = torch.bfloat16
    for layout in ("nn", "nt"):
        for (N, K) in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
            for M in ((1, 16) if layout == "nn" else (16,)):
                a = torch.randn(M, K, device="cuda", dtype=dt)
                b = torch.randn(K, N, device="cuda", dtype=dt) if layout == "nn" else \
                    torch.randn(N, K, device="cuda", dtype=dt).T
                ref = torch.matmul(a.double(), b.double())
                best = {}
                for mode in ("last", "kernel"):
                    km.SPLITK_REDUCE = mode
                    for cfg in cfgs:
                        c = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
                        launch = km.pointer_launcher(M, N, K, 1, 1, (0, 0, *a.stride()), (0, 0, *b.stride()),
                                                     (0, 0, N, 1), dt, a.device, None, "none", cfg, split_k=True)
                        try:
                            launch(a, b, c, None)
                            torch.cuda.synchronize()
                            err = (c.double() - ref).abs().max().item()
                            t = tb._bench_us(lambda: launch(a, b, c, None), rep=8)
                        except Exception as e:  # noqa: BLE001
                            continue
                        if not err <= 0.02 * ref.abs().max().item():
                            print("splitk_sweep BAD", layout, M, N, K, mode, cfg, err, flush=True)
                            continue
                        if t < best.get(mode, (1e9,))[0]:
                            best[mode] = (t, cfg, launch, c)
                km.SPLITK_REDUCE = "last"
                line = dict(layout=layout, M=M, N=N, K=K)
                for mode, (t, cfg, launch, c) in best.items():
                    t_torch, t_k = tb._bench_pair(lambda: torch.matmul(a, b), lambda: launch(a, b, c, None), rep=60)
                    line[mode] = dict(cfg=cfg, sweep_us=round(t, 2), torch_us=round(t_torch, 2), us=round(t_k, 2),
                                      ratio=round(t_torch / t_k, 4))
                r.append(line)
                print("splitk_sweep", line, flush=True)



# --------------------------------------------------------------------------- decode GEMV prototype
@triton.jit(do_not_specialize=["SPLITS", "K_TILES"])
def _gemv_kernel(a_ptr, b_ptr, p_ptr, c_ptr, lock_ptr, M, N, K, SPLITS, K_TILES,
                 stride_am, stride_ak, stride_bk, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C (M, N) = A (M, K) @ B (K, N) for M <= BLOCK_M in {1, 16}: grid (N / BLOCK_N, SPLITS); each program
    reads K_TILES tiles (BLOCK_K, BLOCK_N) of B, CUDA-core FMAs for BLOCK_M = 1 (tl.dot otherwise), writes an
    fp32 partial; the column block's last split sums the partials in order."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    k0 = pid_s * K_TILES * BLOCK_K
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(K_TILES):
        offs_k = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        b = tl.load(b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mk[:, None] & mask_n[None, :], other=0.0)
        if BLOCK_M == 1:
            a = tl.load(a_ptr + offs_k * stride_ak, mask=mk, other=0.0)
            acc += a.to(tl.float32)[:, None] * b.to(tl.float32)
        else:
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=(offs_m[:, None] < M) & mk[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
    if BLOCK_M == 1:
        part = tl.sum(acc, axis=0)[None, :]
    else:
        part = acc
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    if SPLITS == 1:
        tl.store(c_ptr + offs, part.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr + pid_s.to(tl.int64) * M * N + offs, part, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tot = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            pp = p_ptr + offs
            for s in range(SPLITS):
                tot += tl.load(pp, mask=mask, other=0.0, cache_modifier=".cg")
                pp += M * N
            tl.store(c_ptr + offs, tot.to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


def gemv():
    """Decode rows (M = 1, 16; nn and nt; bfloat16): the GEMV prototype over BLOCK_N, BLOCK_K, K tiles per
    program and num_warps, each timed with the bench timer; the best against torch.matmul in the bench's
    pair; the pure read of the weight (the floor) with the same timer."""
    from tritonmm import bench as tb

    r = res.setdefault("gemv", [])
    dt = torch.bfloat16
    rows = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
    for layout in ("nn", "nt"):
        for (N, K) in rows:
            w = torch.randn(K, N, device="cuda", dtype=dt) if layout == "nn" else \
                torch.randn(N, K, device="cuda", dtype=dt).T
            n = w.numel()
            rd = torch.empty(triton.cdiv(n, 4096), device="cuda", dtype=torch.float32)
            wflat = w if layout == "nn" else w.T
            floor_us = tb._bench_us(lambda: _read_kernel[(triton.cdiv(n, 4096),)](wflat, rd, n, BLOCK=4096, num_warps=8), rep=20)
            for M in (1, 16):
                a = torch.randn(M, K, device="cuda", dtype=dt)
                ref = torch.matmul(a.double(), w.double())
                locks = torch.zeros(N // 32 + 1, device="cuda", dtype=torch.int32)
                results = []
                for bn, bk, nw in itertools.product((128, 256, 512), (32, 64, 128), (4, 8)):
                    if bn * bk > 32768 or (M == 16 and bk < 32):
                        continue
                    for kt in (1, 2, 4, 8, 16):
                        splits = triton.cdiv(K, bk * kt)
                        if splits > 128 or (kt > 1 and triton.cdiv(K, bk * (kt // 2)) == splits):
                            continue
                        part = torch.empty(splits * M * N, device="cuda", dtype=torch.float32)
                        c = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
                        grid = (triton.cdiv(N, bn), splits)
                        f = (lambda grid=grid, part=part, c=c, splits=splits, kt=kt, bn=bn, bk=bk, nw=nw:
                             _gemv_kernel[grid](a, w, part, c, locks, M, N, K, splits, kt, a.stride(0), a.stride(1),
                                                w.stride(0), w.stride(1), BLOCK_M=1 if M == 1 else 16,
                                                BLOCK_N=bn, BLOCK_K=bk, num_warps=nw))
                        try:
                            f()
                            torch.cuda.synchronize()
                            err = (c.double() - ref).abs().max().item()
                            if not err <= 0.02 * ref.abs().max().item():
                                print("gemv BAD", layout, M, N, K, bn, bk, nw, kt, err, flush=True)
                                continue
                            t = tb._bench_us(f, rep=6)
                        except Exception as e:  # noqa: BLE001
                            print("gemv ERR", bn, bk, nw, kt, type(e).__name__, str(e)[:200], flush=True)
                            continue
                        results.append((t, dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, K_TILES=kt, SPLITS=splits), f))
                results.sort(key=lambda x: x[0])
                line = dict(layout=layout, M=M, N=N, K=K, floor_us=round(floor_us, 2),
                            top=[(round(t, 2), cfg) for t, cfg, _ in results[:6]])
                pairs = []
                for t, cfg, f in results[:2]:
                    t_torch, t_k = tb._bench_pair(lambda: torch.matmul(a, w), f, rep=80)
                    pairs.append(dict(cfg=cfg, torch_us=round(t_torch, 2), us=round(t_k, 2), ratio=round(t_torch / t_k, 4)))
                line["pairs"] = pairs
                r.append(line)
                print("gemv", json.dumps(line), flush=True)


def aa_raw():
    """Identical cuBLAS calls in the bench's pair timer, raw samples (bf16 512^3 and fp16 1024^3):
    torch vs tritonmm (dispatched to torch), and torch vs another torch.matmul lambda."""
    from tritonmm import bench as tb

    r = res.setdefault("aa_raw", [])
    tb.warm_up_gpu()
    for dt, n in ((torch.bfloat16, 512), (torch.float16, 1024)):
        a = torch.randn(n, n, device="cuda", dtype=dt)
        b = torch.randn(n, n, device="cuda", dtype=dt)
        tritonmm.matmul(a, b)
        for name, g in (("tritonmm", lambda: tritonmm.matmul(a, b)), ("torch2", lambda: torch.matmul(a, b))):
            t0, t1 = [], []
            for _ in range(10):
                x, y = tb._pair_times_ms((lambda: torch.matmul(a, b), g), 6)
                t0 += x
                t1 += y
            t0 = torch.tensor(t0) * 1e3
            t1 = torch.tensor(t1) * 1e3
            line = dict(dtype=str(dt)[6:], n=n, other=name, samples=len(t0),
                        med=[round(t0.median().item(), 3), round(t1.median().item(), 3)],
                        mean=[round(t0.mean().item(), 3), round(t1.mean().item(), 3)],
                        q=[[round(v, 3) for v in t.quantile(torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=t.dtype)).tolist()] for t in (t0, t1)],
                        distinct=[sorted(set(round(v, 3) for v in t.tolist()))[:12] for t in (t0, t1)])
            r.append(line)
            print("aa_raw", json.dumps(line), flush=True)



def streamk():
    """Stream-K TMA configs (STREAM_K = 1) against the same configs without it and torch.matmul, bfloat16:
    correctness on random shapes, then per shape every base config both ways (bench timer), the best
    of each paired with torch.matmul. Needs the stream-K kernel of commit b939d84 (removed after this
    measurement: slower on every shape measured); elsewhere it stops at the first forced config."""
    from tritonmm import bench as tb
    from tritonmm.kernels import configs as C
    from tritonmm.testing import error_report

    r = res.setdefault("streamk", {"check": [], "rows": []})
    dt = torch.bfloat16
    sk = [c for c in C.candidates("tma") if c["STREAM_K"]]
    base = [dict(c, STREAM_K=0) for c in sk]
    g = torch.Generator().manual_seed(1)
    for i in range(24):
        M, N, K = (int(x) for x in torch.randint(1, 3000, (3,), generator=g))
        N, K = N // 8 * 8 + 8, K // 8 * 8 + 8
        a = torch.randn(M, K, device="cuda", dtype=dt)
        b = torch.randn(K, N, device="cuda", dtype=dt) if i % 2 else torch.randn(N, K, device="cuda", dtype=dt).T
        cfg = sk[i % len(sk)]
        with tritonmm.force_backend("triton", "tma", cfg):
            out = tritonmm.matmul(a, b)
            again = tritonmm.matmul(a, b)
        rep = error_report(out, a, b)
        line = dict(M=M, N=N, K=K, cfg=i % len(sk), ok=bool(rep["ok"]), repeat=bool(torch.equal(out, again)),
                    err=rep["tri_err"], bound=rep["bound"])
        r["check"].append(line)
        print("streamk check", line, flush=True)
    for (M, N, K) in ((2304, 1536, 4096), (2304, 1544, 4096), (27648, 128, 4096), (27648, 136, 4096),
                      (4096, 4096, 4096), (2048, 2048, 2048), (2048, 4096, 4096), (2048, 6144, 4096),
                      (2048, 4096, 14336), (8192, 4096, 4096), (1000, 1000, 1000), (8192, 8192, 8192)):
        a = torch.randn(M, K, device="cuda", dtype=dt)
        b = torch.randn(K, N, device="cuda", dtype=dt)
        line = dict(M=M, N=N, K=K, times={})
        best = {}
        for tag, cfgs in (("dp", base), ("sk", sk)):
            for j, cfg in enumerate(cfgs):
                try:
                    with tritonmm.force_backend("triton", "tma", cfg):
                        ok = error_report(tritonmm.matmul(a, b), a, b)["ok"]
                        t = tb._bench_us(lambda: tritonmm.matmul(a, b), rep=15 if M * N * K < 2**36 else 60)
                except Exception as e:  # noqa: BLE001
                    line["times"][f"{tag}{j}"] = f"{type(e).__name__}: {str(e)[:100]}"
                    continue
                line["times"][f"{tag}{j}"] = round(t, 2) if ok else "WRONG"
                if ok and t < best.get(tag, (1e9,))[0]:
                    best[tag] = (t, cfg)
        for tag, (t, cfg) in best.items():
            with tritonmm.force_backend("triton", "tma", cfg):
                t_torch, t_k = tb._bench_pair(lambda: torch.matmul(a, b), lambda: tritonmm.matmul(a, b),
                                              rep=40 if M * N * K < 2**36 else 150)
            line[tag] = dict(cfg=cfg, torch_us=round(t_torch, 2), us=round(t_k, 2), ratio=round(t_torch / t_k, 4))
        r["rows"].append(line)
        print("streamk", json.dumps(line), flush=True)


# --------------------------------------------------------------------------- 8192^3: clocks, power, clusters
def _path(a, b):
    d = tritonmm.explain(a, b)
    return f"{d.backend}:{d.kernel}"


def _smi_window(fn, seconds=3.0, flop=0):
    """Run ``fn`` back to back for ``seconds`` while nvidia-smi samples the SM clock and power every 100 ms.
    Returns the achieved TFLOP/s (CUDA events over the loop) and the medians of the samples after the first 0.5 s."""
    import statistics
    import subprocess
    import tempfile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    reasons = "clocks_event_reasons.active"  # older drivers: clocks_throttle_reasons.active
    if subprocess.run(["nvidia-smi", "-i", dev, f"--query-gpu={reasons}", "--format=csv"],
                      capture_output=True).returncode:
        reasons = "clocks_throttle_reasons.active"
    q = f"clocks.sm,power.draw,power.limit,temperature.gpu,{reasons}"
    smi = subprocess.Popen(["nvidia-smi", "-i", dev, f"--query-gpu={q}", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=log, stderr=subprocess.STDOUT)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    n = 0
    while time.time() - t0 < seconds:
        for _ in range(4):
            fn()
        n += 4
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    smi.wait()
    lines = [x.split(", ") for x in open(log.name).read().splitlines() if x.count(",") == 4]
    lines = lines[5:] or lines
    med = lambda i: statistics.median(float(x[i]) for x in lines) if lines else None  # noqa: E731
    us_call = start.elapsed_time(end) * 1e3 / n
    return dict(us=round(us_call, 1), tflops=round(flop / us_call / 1e6, 1), samples=len(lines),
                sm_mhz=med(0), power_w=med(1), power_limit_w=med(2), temp_c=med(3),
                throttle_reasons=sorted({x[4] for x in lines}))


def power():
    """bfloat16 4096^3 and 8192^3, torch.matmul and tritonmm (dispatched: the TMA kernel at 8192^3) back to back
    for 3 s each: achieved TFLOP/s with the SM clock and power nvidia-smi reads meanwhile, and the dense bf16
    Tensor Core peak at that clock (989.4 TFLOP/s at 1830 MHz for 132 SMs: 0.5407 TFLOP/s per MHz)."""
    r = res.setdefault("power", [])
    for n in (4096, 8192, 8192, 4096):
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for name, fn in (("torch", lambda: torch.matmul(a, b)), ("tritonmm", lambda: tritonmm.matmul(a, b))):
            line = dict(M=n, N=n, K=n, who=name, backend=_path(a, b) if name == "tritonmm" else "torch")
            line.update(_smi_window(fn, flop=2 * n ** 3))
            if line["sm_mhz"]:
                line["peak_at_clock_tflops"] = round(0.5407 * line["sm_mhz"], 1)
                line["share_of_peak_at_clock"] = round(line["tflops"] / line["peak_at_clock_tflops"], 3)
            r.append(line)
            print("power", json.dumps(line), flush=True)


def clusters():
    """8192^3 bfloat16 through the plain persistent TMA kernel of the ``ws`` step (128x256x64, 3 stages, 8 warps):
    num_ctas 1 and 2 (thread block clusters) and GROUP_M 4-32, against torch.matmul (do_bench medians)."""
    km._ensure_allocator()
    r = res.setdefault("clusters", [])
    M = N = K = 8192
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    ref = torch.matmul(a, b)
    flop = 2 * M * N * K
    t_torch = us(lambda: torch.matmul(a, b), rep=300)
    r.append(dict(who="torch", us=t_torch, tflops=flop / t_torch / 1e6))
    print(f"clusters cuBLAS {t_torch:.1f} us {flop / t_torch / 1e6:.0f} TFLOP/s", flush=True)
    for ctas, gm, (bm, bn, bk, st, w) in [(1, 8, (128, 256, 64, 3, 8)), (2, 8, (128, 256, 64, 3, 8)),
                                          (1, 4, (128, 256, 64, 3, 8)), (1, 16, (128, 256, 64, 3, 8)),
                                          (1, 32, (128, 256, 64, 3, 8)), (2, 16, (128, 256, 64, 3, 8)),
                                          (1, 8, (256, 128, 64, 3, 8)), (2, 8, (256, 128, 64, 3, 8))]:
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        grid = (132 // ctas,)  # one persistent program per cluster of num_ctas CTAs

        def run():
            _ws_kernel[grid](a, b, c, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_SMS=grid[0],
                             WS_OUTER=False, WS_INNER=False, FLATTEN=True, num_stages=st, num_warps=w, num_ctas=ctas)
        line = dict(who="triton", num_ctas=ctas, GROUP_M=gm, cfg=(bm, bn, bk, st, w))
        try:
            run()
            torch.cuda.synchronize()
            line["err"] = (c.float() - ref.float()).abs().max().item()
            t = us(run, rep=300)
            line.update(us=t, tflops=flop / t / 1e6, ratio=t_torch / t)
        except Exception as e:  # noqa: BLE001
            line["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        r.append(line)
        print("clusters", json.dumps(line), flush=True)


def tf32_odd():
    """float32 with TF32 on 4095^3 and 4097^3: torch.matmul, tritonmm (padded path), and cuBLAS alone on the
    aligned sizes the padded path uses (K and N rounded up to 64) and on 4096^3, in every operand layout
    (B read as (K, N) row-major, or as the transpose of an (N, K) matrix): the time the 3x target allows
    is torch.matmul's / 3."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    r = res.setdefault("tf32_odd", [])
    from tritonmm import bench as tb
    for n in (4095, 4097):
        a = torch.randn(n, n, device="cuda")
        b = torch.randn(n, n, device="cuda")
        t_torch, t_tmm = tb._bench_pair(lambda: torch.matmul(a, b), lambda: tritonmm.matmul(a, b), rep=150)
        line = dict(n=n, torch_us=round(t_torch, 1), tritonmm_us=round(t_tmm, 1), ratio=round(t_torch / t_tmm, 3),
                    target_us=round(t_torch / 3, 1), backend=_path(a, b), aligned={})
        for p in sorted({4096, -(-n // 64) * 64}):
            ap = torch.randn(n, p, device="cuda")
            for lay in ("nn", "nt"):
                bp = torch.randn(p, p, device="cuda") if lay == "nn" else torch.randn(p, p, device="cuda").T
                line["aligned"][f"{n}x{p}x{p} {lay}"] = round(us(lambda: torch.matmul(ap, bp), rep=150), 1)
        a2 = torch.empty(n, -(-n // 64) * 64, device="cuda")
        line["copy_one_operand_us"] = round(us(lambda: a2[:, :n].copy_(a), rep=100), 1)
        r.append(line)
        print("tf32_odd", json.dumps(line), flush=True)
    torch.set_float32_matmul_precision(precision)


def ldc():
    """The padded path's output copy: cuBLAS on the padded copies writing (M, Np) then copied to (M, N), against
    cuBLAS writing the (M, N) output directly (B's padded copy read as a (Kp, N) view, ldb = Np; ldc = N
    unaligned), 4095^3 and 4097^3 in every dtype (float32 with TF32); do_bench medians."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    r = res.setdefault("ldc", [])
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for n in (4095, 4097, 2305):
            p = -(-n // 64) * 64
            a = torch.randn(n, n, device="cuda", dtype=dt)
            b = torch.randn(n, n, device="cuda", dtype=dt)
            ap = torch.zeros(n, p, device="cuda", dtype=dt)
            ap[:, :n] = a
            bp = torch.zeros(p, p, device="cuda", dtype=dt)
            bp[:n, :n] = b
            cp = torch.empty(n, p, device="cuda", dtype=dt)
            c = torch.empty(n, n, device="cuda", dtype=dt)
            bv = bp[:, :n]
            torch.mm(ap, bp, out=cp)
            torch.mm(ap, bv, out=c)
            line = dict(dtype=str(dt).split(".")[-1], n=n, padded=p, same=bool(torch.equal(c, cp[:, :n])),
                        maxdiff=(c.float() - cp[:, :n].float()).abs().max().item(),
                        torch_us=us(lambda: torch.matmul(a, b), rep=100),
                        tritonmm_us=us(lambda: tritonmm.matmul(a, b), rep=100),
                        gemm_padded_out_us=us(lambda: torch.mm(ap, bp, out=cp), rep=100),
                        gemm_direct_out_us=us(lambda: torch.mm(ap, bv, out=c), rep=100),
                        copy_out_us=us(lambda: c.copy_(cp[:, :n]), rep=100))
            r.append(line)
            print("ldc", json.dumps(line), flush=True)
    torch.set_float32_matmul_precision(precision)


def small():
    """Small problems where the benchmark's times are far above the math (127x257x1023: 13.6 us for
    67 MFLOP): per path, the device time of each kernel (torch.profiler, L2 flushed before each call as
    do_bench does) against do_bench's median with and without the flush; bfloat16."""
    from torch.profiler import ProfilerActivity, profile

    r = res.setdefault("small", [])
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    cfgs = {"splitk": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_stages": 4, "num_warps": 4,
                       "SPLIT_K": 4},
            "pointer": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 8, "num_stages": 4, "num_warps": 4}}
    for (M, N, K) in ((127, 257, 1023), (128, 256, 1024), (1000, 1000, 1000), (512, 512, 512)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        for path in ("torch", "splitk", "pointer", "tma"):
            force = (("torch",) if path == "torch" else
                     ("triton", path, cfgs[path]) if path in cfgs else ("triton", path))
            with tritonmm.force_backend(*force):
                fn = lambda: tritonmm.matmul(a, b)
                fn()
                torch.cuda.synchronize()
                line = dict(M=M, N=N, K=K, path=path, bench_us=us(fn, rep=50))
                line["noflush_us"] = _events_us(fn)
                try:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        fn()
                    line["graph_noflush_us"] = _events_us(g.replay)
                except Exception as exc:
                    line["graph_noflush_us"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(50):
                        flush.zero_()
                        fn()
                    torch.cuda.synchronize()
                kern = {}
                for ev in prof.key_averages():
                    t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
                    if t and "fill" not in ev.key.lower() and "zero" not in ev.key.lower():
                        kern[ev.key[:70]] = [round(t / 50, 2), ev.count]
                line["kernels_us_per_call_and_count"] = kern
            r.append(line)
            print("small", json.dumps(line), flush=True)



def small_sweep():
    """Small problems (127x257x1023, 512^3, 1000^3; bfloat16): ``python -m tritonmm.tune`` over a grid of
    configs wider than configs/candidates.json (split-K up to 8 on the odd shape; 64-wide tiles and TMA
    split-K configs past SPLIT_MAX_M on the squares), to see whether any beats cuBLAS by the table's margin.
    The tuner's own records (each config's do_bench median, the fastest one paired with torch.matmul)."""
    import tempfile

    from tritonmm import tune
    from tritonmm.kernels import configs as C

    base = json.loads((C.config_dir() / "candidates.json").read_text())
    splitk = [[bm, bn, bk, 1, 2, 4, s] for bm in (16, 32, 64) for bn in (32, 64, 128) for bk in (64, 128)
              for s in (2, 4, 8)]
    pointer = ([[bm, bn, bk, 8, 2, 4] for bm in (16, 32, 64) for bn in (32, 64) for bk in (64, 128)]
               + [[32, 64, 64, 8, 4, 4], [64, 32, 64, 8, 4, 4], [32, 32, 64, 8, 4, 4], [64, 64, 64, 8, 3, 4],
                  [64, 64, 128, 8, 3, 4], [32, 64, 128, 8, 3, 4], [64, 64, 32, 8, 4, 4], [128, 64, 64, 8, 3, 4]])
    tma = [[64, 64, 64, 8, 4, 4, 0, 1], [64, 64, 64, 8, 4, 4, 0, 2], [64, 128, 64, 8, 4, 4, 0, 2],
           [128, 64, 64, 8, 4, 4, 0, 2], [128, 128, 64, 8, 4, 8, 0, 2], [64, 128, 128, 8, 3, 4, 0, 1],
           [128, 128, 64, 8, 4, 8, 0, 1], [64, 128, 64, 8, 4, 4, 0, 1], [64, 128, 64, 8, 5, 4, 0, 1],
           [128, 64, 64, 8, 4, 4, 0, 1], [64, 256, 64, 8, 3, 8, 0, 1], [128, 256, 64, 8, 3, 8, 1, 1],
           [64, 64, 128, 8, 3, 4, 0, 2], [64, 128, 32, 8, 6, 4, 0, 1], [64, 64, 64, 8, 4, 4, 0, 4],
           [64, 128, 64, 8, 4, 4, 0, 4]]
    cand = {**base, "splitk": {**base["splitk"], "configs": splitk}, "pointer": {**base["pointer"], "configs": pointer},
            "tma": {**base["tma"], "configs": tma}}
    d = tempfile.mkdtemp()
    json.dump(cand, open(os.path.join(d, "candidates.json"), "w"))
    os.environ["TRITONMM_CONFIG_DIR"] = d
    C._candidates_file.cache_clear()
    C.SPLIT_MAX_M = 1 << 30  # let the TMA split-K configs run on the squares too
    r = res.setdefault("small_sweep", [])
    for (M, N, K), kernels in (((127, 257, 1023), ["splitk", "pointer"]), ((1000, 1000, 1000), ["tma"]),
                               ((512, 512, 512), ["pointer", "tma"])):
        shapes = os.path.join(d, f"s{M}.json")
        json.dump({"shapes": [{"tag": "small", "M": M, "N": N, "K": K}]}, open(shapes, "w"))
        table = os.path.join(d, f"t{M}.json")
        tune.main(["--shapes", shapes, "--dtype", "bfloat16", "--kernels", *kernels, "--out", table])
        m = json.load(open(table))["measurements"][0]
        timed = sorted((c for c in m["configs"] if "us" in c), key=lambda c: c["us"])
        line = dict(M=M, N=N, K=K, kernels=kernels, torch_us=m["torch_us"], paired=m.get("paired"),
                    measured=len(m["configs"]), failed=[c for c in m["configs"] if "failed" in c][:5],
                    fastest=[[c["kernel"], c["config"], round(c["us"], 2)] for c in timed[:8]])
        r.append(line)
        print("small_sweep", json.dumps(line), flush=True)


for step in sys.argv[1:]:
    t = time.time()
    try:
        globals()[step]()
    except Exception as e:
        print("STEP FAILED", step, type(e).__name__, e, flush=True)
    print(f"== {step} {time.time() - t:.0f} s", flush=True)
    os.makedirs(OUT, exist_ok=True)
    json.dump(res, open(os.path.join(OUT, "probe.json"), "w"), indent=1)
