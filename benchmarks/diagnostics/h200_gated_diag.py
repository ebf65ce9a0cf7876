"""Where the fused Llama MLP's time goes on the H200, and where a patched model's CUDA graph differs.

1. Host: the time to issue the forward and the backward of one step (no sync inside each), eager
   LlamaMLP against tritonmm.fuse (Llama-3-8B widths, bf16, 512 tokens), and a CPU-only torch.profiler
   table of one fused step (the backward runs on autograd's device thread, which cProfile does not see).
2. The gated product's Triton passes (forward on the two halves of one GEMM output, backward) over
   BLOCK and num_warps, against eager's kernels and Inductor's fused kernel for the same expression, in
   CUDA-graph replay (triton.testing.do_bench_cudagraph), with GB/s of the bytes each must move.
3. Kernels of one forward (eager, fused, torch.compile) and of one forward + backward (eager, fused) of the
   MLP at 512 and 4096 tokens (torch.profiler).
4. The small model's 1 x 16 forward captured in a CUDA graph with tritonmm off, swapped and patched:
   the kernels each graph replays and their times.
5. Host time to issue single ops of the fused path (cuBLAS GEMMs of both widths, allocations, the
   product launch), and cProfile of the fused forward and of its backward called directly.
6. Llama-3-8B-sized 2-layer model, eager prefill of 1 x 512 tokens, tritonmm off and fused: the host time
   to issue one forward, the kernels of one forward, and wall times alternated.
7. MLP forwards without autograd (TinyLlama's and the small config's widths; 512 and 4096 tokens): eager,
   fused as released, and fused with the cuBLAS + product path at any size (both product thresholds 0).
Usage: PYTHONPATH=$PWD python3 benchmarks/diagnostics/h200_gated_diag.py [sections, default 1234]"""
import contextlib
import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

import tritonmm
from tritonmm.bench.mlp import _mlp
from tritonmm.kernels import gated_product as gp

dev = torch.device("cuda")
bf16 = torch.bfloat16
sections = sys.argv[1] if len(sys.argv) > 1 else "1234567"


def kernels_of(fn, top=16):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.key and not e.key.startswith("cuda"):
            rows.append((t, e.count, e.key[:110]))
    total = sum(r[0] for r in rows)
    print(f"   total {total:9.1f} us")
    for t, c, k in sorted(rows, reverse=True)[:top]:
        print(f"   {t:9.1f} {c:3d} {k}")


if "1" in sections:
    mlp = _mlp(4096, 14336, dev, bf16)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    for M in (512, 4096):
        x = torch.randn(M, 4096, device=dev, dtype=bf16, requires_grad=True)
        grad = torch.randn(M, 4096, device=dev, dtype=bf16)
        for name, m in (("eager", mlp), ("fused", fused)):
            for _ in range(5):
                m(x).backward(grad)
            fwd, bwd, wall = [], [], []
            for _ in range(30):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                y = m(x)
                t1 = time.perf_counter()
                y.backward(grad)
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                fwd.append((t1 - t0) * 1e6)
                bwd.append((t2 - t1) * 1e6)
                wall.append((t3 - t0) * 1e6)
            print(f"host M={M} {name}: forward {statistics.median(fwd):7.1f} us, backward {statistics.median(bwd):7.1f} us "
                  f"to issue; step wall {statistics.median(wall):7.1f} us")
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                fused(x).backward(grad)
            torch.cuda.synchronize()
        print(f"fused M={M}: CPU profile of 10 steps (self CPU time)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=70))
    del mlp, fused, x, grad
    torch.cuda.empty_cache()

if "2" in sections:
    N = 14336
    for M in (512, 4096, 16384):
        gu = torch.randn(M, 2 * N, device=dev, dtype=bf16)
        h = torch.empty(M, N, device=dev, dtype=bf16)
        dh = torch.randn(M, N, device=dev, dtype=bf16)
        both = torch.empty(M, 2 * N, device=dev, dtype=bf16)
        g, u = gu[:, :N], gu[:, N:]
        fwd_bytes, bwd_bytes = 3 * M * N * 2, 5 * M * N * 2
        res = {}

        def bench(name, fn, nbytes):
            ms = do_bench_cudagraph(fn, rep=100)
            res[name] = ms
            print(f"M={M:6d} {name:34s} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s")

        bench("fwd eager silu(g)*u", lambda: F.silu(g) * u, fwd_bytes)
        comp_f = torch.compile(lambda gu: F.silu(gu[:, :N]) * gu[:, N:])
        comp_f(gu)
        bench("fwd inductor", lambda: comp_f(gu), fwd_bytes)
        for block in (512, 1024, 2048, 4096):
            for warps in (2, 4, 8, 16):
                grid = (M * triton.cdiv(N, block),)
                fn = lambda: gp._gated_product_halves_kernel[grid](gu, h, N, ACTIVATION="silu", UPCAST=False,  # noqa: E731
                                                                   BLOCK=block, num_warps=warps)
                bench(f"fwd triton BLOCK {block} warps {warps}", fn, fwd_bytes)

        def eager_bwd():
            s = torch.sigmoid(g.float())
            du = dh * (g.float() * s).to(bf16)
            dg = (dh * u) * (s * (1 + g.float() * (1 - s))).to(bf16)
            return du, dg

        bench("bwd eager (approx.)", eager_bwd, bwd_bytes)

        def bwd_expr(dh, gu):
            g, u = gu[:, :N].float(), gu[:, N:].float()
            s = torch.sigmoid(g)
            return torch.cat([(dh.float() * u * s * (1 + g * (1 - s))).to(bf16), (dh.float() * g * s).to(bf16)], 1)

        comp_b = torch.compile(bwd_expr)
        comp_b(dh, gu)
        bench("bwd inductor", lambda: comp_b(dh, gu), bwd_bytes)
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8, 16):
                grid = (M * triton.cdiv(N, block),)
                fn = lambda: gp._gated_product_backward_kernel[grid](dh, g, u, both[:, :N], both[:, N:], N, N, 2 * N,  # noqa: E731
                                                                     2 * N, ACTIVATION="silu", UPCAST=False,
                                                                     BLOCK=block, num_warps=warps)
                bench(f"bwd triton BLOCK {block} warps {warps}", fn, bwd_bytes)
        print(f"M={M} best fwd: {min((v, k) for k, v in res.items() if k.startswith('fwd triton'))}, "
              f"best bwd: {min((v, k) for k, v in res.items() if k.startswith('bwd triton'))}")
        del gu, h, dh, both
        torch._dynamo.reset()
    torch.cuda.empty_cache()

if "3" in sections:
    mlp = _mlp(4096, 14336, dev, bf16)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    compiled = torch.compile(copy.deepcopy(mlp), dynamic=True)
    for M in (512, 4096):
        x = torch.randn(M, 4096, device=dev, dtype=bf16)
        with torch.no_grad():
            for name, m in (("eager", mlp), ("fused", fused), ("compile", compiled)):
                m(x)
                print(f"forward kernels M={M} {name}:")
                kernels_of(lambda: m(x))
        xg = x.clone().requires_grad_()
        grad = torch.randn(M, 4096, device=dev, dtype=bf16)
        for name, m in (("eager", mlp), ("fused", fused)):
            print(f"fwd+bwd kernels M={M} {name}:")
            kernels_of(lambda: m(xg).backward(grad), top=20)
    del mlp, fused, compiled
    torch._dynamo.reset()
    torch.cuda.empty_cache()

if "4" in sections:
    from tritonmm.bench.model import _capture, _tokens, build_model, mode

    model = build_model("small", dev, bf16)
    ids = _tokens(model.config.vocab_size, 1, 16, dev)
    tritonmm.fuse(model)  # packs the weights once (a graph captured before would read their old storage)
    tritonmm.unfuse(model, unpack=False)
    graphs = {}
    for m in ("off", "swap", "patch", "fuse"):
        with mode(m, model), torch.no_grad():
            graphs[m] = _capture(lambda: model(ids, use_cache=False).logits)
            if m == "patch":
                for n, mod in model.named_modules():
                    if isinstance(mod, torch.nn.Linear) and n.endswith(("q_proj", "gate_proj", "down_proj", "lm_head")) \
                            and ".1." not in n and ".2." not in n and ".3." not in n:
                        print(f"patch: {n} {type(mod).__name__}")
    times = {m: [] for m in graphs}
    for r in range(30):
        for m, g in (graphs.items() if r % 2 == 0 else reversed(list(graphs.items()))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                g.replay()
            torch.cuda.synchronize()
            times[m].append((time.perf_counter() - t0) / 50 * 1e6)
    for m, t in times.items():
        print(f"graph 1x16 {m}: {statistics.median(t):.1f} us per replay")
    for m, g in graphs.items():
        print(f"graph 1x16 {m} kernels:")
        kernels_of(g.replay, top=24)

if "5" in sections:
    import cProfile
    import pstats

    from tritonmm import gated_cublas
    from tritonmm.ops import gated_grads

    mlp = _mlp(4096, 14336, dev, bf16)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    wg, wu = fused.gate_proj.weight, fused.up_proj.weight
    w2 = gated_cublas.packed(wg, wu)
    print("packed:", w2 is not None)
    wgd = mlp.gate_proj.weight.detach()

    def host_us(fn, n=10):
        out = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
        return statistics.median(out)

    for M in (16, 512, 4096):
        x = torch.randn(M, 4096, device=dev, dtype=bf16)
        xg = x.clone().requires_grad_()
        gu = torch.randn(M, 2 * 14336, device=dev, dtype=bf16)
        h = torch.empty(M, 14336, device=dev, dtype=bf16)
        ops = {
            "torch.mm(x, wg.t()) N=14336": lambda: torch.mm(x, wgd.t()),
            "torch.mm(x, w2.t()) N=28672": lambda: torch.mm(x, w2.t()),
            "F.linear(x, wg)": lambda: F.linear(x, wgd),
            "torch.empty(M, 2N)": lambda: torch.empty(M, 2 * 14336, device=dev, dtype=bf16),
            "torch.empty(M, N)": lambda: torch.empty(M, 14336, device=dev, dtype=bf16),
            "product(halves)": lambda: gated_cublas.product(gu[:, :14336], gu[:, 14336:], h, "silu"),
            "gated_cublas.forward save": lambda: gated_cublas.forward(x, wg.detach(), wu.detach(), None, None, "silu", True),
            "F.silu(g) * u": lambda: F.silu(gu[:, :14336]) * gu[:, 14336:],
        }
        with torch.no_grad():
            ops["fused(x) no_grad"] = lambda: fused(x)
            ops["mlp(x) no_grad"] = lambda: mlp(x)
            for k, fn in ops.items():
                fn()
                print(f"host M={M:5d} {k:32s} {host_us(fn):8.1f} us")
        for k, fn in {"fused(xg) grad": lambda: fused(xg), "mlp(xg) grad": lambda: mlp(xg)}.items():
            fn()
            print(f"host M={M:5d} {k:32s} {host_us(fn):8.1f} us")
    M = 512
    x = torch.randn(M, 4096, device=dev, dtype=bf16, requires_grad=True)
    for _ in range(3):
        fused(x)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fused(x)
    pr.disable()
    torch.cuda.synchronize()
    print("cProfile: 20 fused forwards with grad, M=512")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    pstats.Stats(pr).sort_stats("cumtime").print_stats(25)
    with torch.no_grad():
        _, g, u = gated_cublas.forward(x.detach(), wg.detach(), wu.detach(), None, None, "silu", True)
    dh = torch.randn(M, 14336, device=dev, dtype=bf16)
    needs = (True, True, True, False, False)
    bwd = lambda: gated_grads.backward(dh, x.shape, x.detach(), wg.detach(), wu.detach(), g, u, "silu", needs)  # noqa: E731
    bwd()
    print(f"host M=512 gated_grads.backward direct {host_us(bwd):8.1f} us")
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        bwd()
    pr.disable()
    torch.cuda.synchronize()
    print("cProfile: 20 gated_grads.backward, M=512")
    pstats.Stats(pr).sort_stats("tottime").print_stats(20)

if "6" in sections:
    from tritonmm.bench.model import _tokens, alternate, build_model, mode

    model = build_model("llama3-8b-2l", dev, bf16)
    tritonmm.fuse(model)
    tritonmm.unfuse(model, unpack=False)
    ids = _tokens(model.config.vocab_size, 1, 512, dev)
    fwd = lambda: model(ids, use_cache=False)  # noqa: E731
    with torch.no_grad():
        for m in ("off", "fuse"):
            with mode(m, model):
                for _ in range(3):
                    fwd()
                host = []
                for _ in range(20):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fwd()
                    host.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
                print(f"8b-2l prefill 1x512 {m}: host to issue {statistics.median(host):8.1f} us")
        times = alternate({m: (lambda m=m: mode(m, model), fwd) for m in ("off", "fuse")}, dev, 20, iters=3)
        for m, t in times.items():
            print(f"8b-2l prefill 1x512 {m}: wall {statistics.median(t):.3f} ms")
        print("ratio off/fuse", statistics.median(a / b for a, b in zip(times["off"], times["fuse"])))
        for m in ("off", "fuse"):
            with mode(m, model):
                print(f"8b-2l prefill 1x512 {m} kernels:")
                kernels_of(fwd, top=14)
    del model
    torch.cuda.empty_cache()

if "7" in sections:
    from tritonmm import gated
    from tritonmm.bench.model import alternate

    released = gated.PRODUCT_MIN_FLOPS, gated.PRODUCT_MIN_FLOPS_NO_GRAD
    for hidden, inter in ((2048, 5632), (1024, 2816)):
        mlp = _mlp(hidden, inter, dev, bf16)
        fused = tritonmm.fuse(copy.deepcopy(mlp))
        for M in (64, 512, 4096):
            x = torch.randn(M, hidden, device=dev, dtype=bf16)

            def anysize():
                gated.PRODUCT_MIN_FLOPS = gated.PRODUCT_MIN_FLOPS_NO_GRAD = 0
                try:
                    return fused(x)
                finally:
                    gated.PRODUCT_MIN_FLOPS, gated.PRODUCT_MIN_FLOPS_NO_GRAD = released

            with torch.no_grad():
                times = alternate({"eager": (contextlib.nullcontext, lambda: mlp(x)),
                                   "fused": (contextlib.nullcontext, lambda: fused(x)),
                                   "anysize": (contextlib.nullcontext, anysize)}, dev, 15, iters=1, warmup=3)
            e = times["eager"]
            print(f"mlp {hidden}/{inter} M={M} no_grad: eager {statistics.median(e) * 1e3:.1f} us; "
                  + "; ".join(f"{k} {statistics.median(a / b for a, b in zip(e, v)):.3f}x"
                              for k, v in times.items() if k != "eager"))
        del mlp, fused
