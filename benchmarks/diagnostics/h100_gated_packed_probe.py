"""Probe: the stacked gated TMA kernels (3-D descriptors) against cuBLAS and tritonmm's current path."""
import json, os, sys
import torch, triton
import torch.nn.functional as F
from tritonmm.kernels.gated_packed import _gated_packed_kernel, _gated_packed_backward_kernel
from tritonmm.kernels.launch import ensure_allocator

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
dev = "cpu" if INTERP else "cuda"
ensure_allocator()
SMS = 4 if INTERP else torch.cuda.get_device_properties(0).multi_processor_count


def bucket(n):
    return 1 << max(0, (n - 1).bit_length())


def fwd(x, w, save, cfg, act="silu"):
    M, K = x.shape
    N = w.shape[0] // 2
    h = torch.full((M, N), float("nan"), dtype=x.dtype, device=x.device)
    gu = torch.full((M, 2 * N), float("nan"), dtype=x.dtype, device=x.device) if save else h
    BM, BN, BK, G, st, wa = cfg
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN // 2)
    _gated_packed_kernel[(min(SMS, tiles),)](x, w, h, gu, M, N, K, x.stride(0), w.stride(0), h.stride(0), gu.stride(0),
        bucket(M), bucket(N), bucket(K), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=G, NUM_SMS=SMS, SAVE=save,
        ACTIVATION=act, INPUT_PRECISION="tf32" if x.dtype != torch.float32 else "ieee",
        UPCAST=INTERP and x.dtype == torch.bfloat16, num_stages=st, num_warps=wa)
    return h, (gu if save else None)


def bwd(dy, wd, gu, cfg, act="silu"):
    M, K = dy.shape
    N = wd.shape[1]
    dgu = torch.full((M, 2 * N), float("nan"), dtype=dy.dtype, device=dy.device)
    BM, BN, BK, G, st, wa = cfg
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    _gated_packed_backward_kernel[(min(SMS, tiles),)](dy, wd, gu, dgu, M, N, K, dy.stride(0), wd.stride(0),
        gu.stride(0), dgu.stride(0), bucket(M), bucket(N), bucket(K), BLOCK_M=BM, BLOCK_N=BN,
        BLOCK_K=BK, GROUP_M=G, NUM_SMS=SMS, ACTIVATION=act,
        INPUT_PRECISION="tf32" if dy.dtype != torch.float32 else "ieee",
        UPCAST=INTERP and dy.dtype == torch.bfloat16, num_stages=st, num_warps=wa)
    return dgu


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(M, N, K, dtype, cfg_f, cfg_b, act="silu"):
    x = torch.randn(M, K, dtype=dtype, device=dev)
    w = torch.randn(2 * N, K, dtype=dtype, device=dev) / K ** 0.5
    wd = torch.randn(K, N, dtype=dtype, device=dev) / N ** 0.5
    wg, wu = w[:N], w[N:]
    h, gu = fwd(x, w, True, cfg_f, act)
    g64, u64 = x.double() @ wg.double().T, x.double() @ wu.double().T
    actf = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}[act]
    e1 = rel(h, actf(g64) * u64)
    e2 = rel(gu[:, :N], g64) + rel(gu[:, N:], u64)
    dy = torch.randn(M, K, dtype=dtype, device=dev)
    dgu = bwd(dy, wd, gu, cfg_b, act)
    g64r, u64r = gu[:, :N].double().requires_grad_(), gu[:, N:].double().requires_grad_()
    dg64, du64 = torch.autograd.grad(actf(g64r) * u64r, (g64r, u64r), dy.double() @ wd.double())
    e3 = rel(dgu[:, :N], dg64) + rel(dgu[:, N:], du64)
    bad = any(torch.isnan(t).any().item() for t in (h, gu, dgu))
    return dict(M=M, N=N, K=K, dtype=str(dtype), act=act, h=e1, gu=e2, dgu=e3, nan=bad)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


FWD = [(128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (128, 256, 64, 4, 3, 8), (128, 256, 64, 16, 3, 8),
       (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 5, 4), (64, 256, 64, 8, 4, 4), (128, 256, 128, 8, 2, 8),
       (256, 128, 64, 8, 3, 8), (128, 256, 64, 8, 2, 8)]
BWD = [(128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4),
       (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 2, 8)]


def timing(hidden, inter, M, dtype=torch.bfloat16):
    from tritonmm import gated_cublas
    K, N = hidden, inter
    x = torch.randn(M, K, dtype=dtype, device=dev)
    w = torch.randn(2 * N, K, dtype=dtype, device=dev) / K ** 0.5
    wg, wu = w[:N], w[N:]
    wd = torch.randn(K, N, dtype=dtype, device=dev) / N ** 0.5
    dy = torch.randn(M, K, dtype=dtype, device=dev)
    o = dict(hidden=hidden, inter=inter, M=M)
    o["cublas_gu"] = 1e3 * bench(lambda: F.linear(x, w))
    o["eager_gu"] = 1e3 * bench(lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu))
    o["current_gu"] = 1e3 * bench(lambda: gated_cublas.forward(x, wg, wu, None, None, "silu", False))
    o["current_gu_save"] = 1e3 * bench(lambda: gated_cublas.forward(x, wg, wu, None, None, "silu", True))
    res = {}
    for c in FWD:
        for save in (False, True):
            try:
                res[f"{c}{'s' if save else ''}"] = 1e3 * bench(lambda: fwd(x, w, save, c))
            except Exception as e:
                res[f"{c}{'s' if save else ''}"] = type(e).__name__
    o["fwd"] = res
    o["fwd_best"] = min((v, k) for k, v in res.items() if isinstance(v, float) and not k.endswith("s"))
    o["fwd_save_best"] = min((v, k) for k, v in res.items() if isinstance(v, float) and k.endswith("s"))
    gu = F.linear(x, w)
    g, u = gu[:, :N], gu[:, N:]
    o["cublas_dh"] = 1e3 * bench(lambda: dy @ wd)
    o["current_dh"] = 1e3 * bench(lambda: gated_cublas.grads(dy @ wd, g, u, "silu", (True,) * 5))

    def eager_b():
        dh = dy @ wd
        a = F.silu(g)
        return torch.ops.aten.silu_backward(dh * u, g), dh * a
    o["eager_dh"] = 1e3 * bench(eager_b)
    res = {}
    for c in BWD:
        try:
            res[str(c)] = 1e3 * bench(lambda: bwd(dy, wd, gu, c))
        except Exception as e:
            res[str(c)] = type(e).__name__
    o["bwd"] = res
    o["bwd_best"] = min((v, k) for k, v in res.items() if isinstance(v, float))
    f, fs, b = o["fwd_best"][0], o["fwd_save_best"][0], o["bwd_best"][0]
    o["summary"] = dict(fwd_vs_cublas=o["cublas_gu"] / f, fwd_vs_current=o["current_gu"] / f, fwd_vs_eager=o["eager_gu"] / f,
                        save_vs_current=o["current_gu_save"] / fs, bwd_vs_current=o["current_dh"] / b,
                        bwd_vs_eager=o["eager_dh"] / b, bwd_vs_cublas=o["cublas_dh"] / b)
    return o


def mlp_memory(hidden, inter, M, dtype=torch.bfloat16):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    import tritonmm, copy
    torch.manual_seed(0)
    with torch.device(dev):
        mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")).to(dtype)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    out = {}
    for name, m in (("eager", mlp), ("fused", fused)):
        x = torch.randn(M, hidden, device=dev, dtype=dtype, requires_grad=True)
        gr = torch.randn(M, hidden, device=dev, dtype=dtype)
        m(x).backward(gr)  # grads allocated
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        m(x).backward(gr)
        torch.cuda.synchronize()
        out[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del x, gr
    out["ratio"] = out["fused"] / out["eager"]
    return out


if __name__ == "__main__":
    if INTERP:
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            print(check(40, 24, 48, dt, (32, 32, 32, 4, 1, 4), (32, 16, 32, 4, 1, 4)))
        print(check(33, 40, 72, torch.float32, (16, 16, 16, 2, 1, 4), (16, 16, 16, 2, 1, 4), act="gelu"))
        sys.exit()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    results = {"checks": [], "timing": [], "memory": []}
    for args in [(300, 1032, 520, torch.bfloat16, FWD[4], BWD[0]), (4096, 4096, 2048, torch.bfloat16, FWD[0], BWD[0]),
                 (257, 264, 136, torch.float16, FWD[4], BWD[3]), (512, 512, 256, torch.float32, (64, 64, 32, 8, 3, 4), (64, 32, 32, 8, 3, 4)),
                 (1000, 776, 1048, torch.bfloat16, FWD[0], BWD[0], "gelu")]:
        try:
            r = check(*args)
        except Exception as e:
            r = dict(args=str(args[:4]), error=f"{type(e).__name__}: {str(e)[:300]}")
        print(r, flush=True)
        results["checks"].append(r)
    for hidden, inter in ((4096, 14336), (2048, 5632)):
        for M in (512, 4096, 16384):
            r = timing(hidden, inter, M)
            results["timing"].append(r)
            print(json.dumps({k: r[k] for k in ("hidden", "M", "fwd_best", "fwd_save_best", "bwd_best", "summary")}), flush=True)
    for hidden, inter in ((4096, 14336), (2048, 5632)):
        r = mlp_memory(hidden, inter, 4096)
        results["memory"].append(r)
        print("memory", hidden, r, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "h100_gated_packed_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
