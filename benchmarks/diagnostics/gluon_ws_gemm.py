"""Probe: a warp-specialized persistent GEMM for Hopper written in Gluon (``triton.experimental.gluon``), plain and
gated on packed [Wg; Wu] weights, against cuBLAS. One loader warp issues the TMA loads of a STAGES-deep ring;
the default partition (``num_warps`` warps, two warpgroups over BLOCK_M rows) issues the WGMMAs, keeping one k-step
in flight, frees each stage through an mbarrier, and runs the epilogue while the loader already fetches the next
tile. Each tile has two accumulators of (BLOCK_M, HALF): plain, columns [n, n + HALF) and [n + HALF, n + 2 HALF)
of one output tile; gated, the gate and up projections of the same HALF columns, so the epilogue computes
act(G) * U in registers and stores H once (each projection rounded to the output dtype first, as eager does).

The question it answers: whether warp specialization brings the GEMM under the fused MLP to cuBLAS's speed on an
H100/H200, where the Triton TMA kernel reaches 0.93-0.99x (``h200.json``, ``h100_gated_packed_variants.json``).

    PYTHONPATH=$PWD python3 benchmarks/diagnostics/gluon_ws_gemm.py           (GPU: checks, then timings; writes
                                                                              $OUT/gluon_ws_gemm.json)
    python3 benchmarks/diagnostics/gluon_ws_gemm.py --compile-only           (no GPU: compiles for sm_90)

Written against triton 3.6's Gluon API (the GPU hosts'): ``gl.warp_specialize`` changed its arguments after it.
The 128 x (2 x 128) tile with 4 stages holds 229,572 bytes of shared memory, 168 registers per thread, no spills
(``--compile-only`` prints each config's). The checks run in a child process with a timeout: a wrong mbarrier
phase hangs the GPU rather than failing.
"""
import argparse
import json
import os
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _tile_coords(tile, M, N, BLOCK_M: gl.constexpr, HALF: gl.constexpr, GATED: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """Group-M order; the rows of the weight feeding the two accumulators and the output column of the tile."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    width: gl.constexpr = HALF if GATED else 2 * HALF
    num_pid_n = gl.cdiv(N, width)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_m
    pid_n = (tile % in_group) // group_m
    off_n = pid_n * width
    off_hi = N + off_n if GATED else off_n + HALF
    return pid_m * BLOCK_M, off_n, off_hi


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, lo_bufs, hi_bufs, ready, empty, M, N, K,
                    GATED: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    width: gl.constexpr = HALF if GATED else 2 * HALF
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, width)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        off_m, off_lo, off_hi = _tile_coords(tile, M, N, BLOCK_M, HALF, GATED, GROUP_M)
        for k in range(0, K, BLOCK_K):
            s = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(empty.index(s), phase ^ 1)  # (barriers start with phase 1 complete: the ring is free)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_lo, k], bar, lo_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_hi, k], bar, hi_bufs.index(s))
            it += 1


@gluon.jit
def _mma_partition(a_bufs, lo_bufs, hi_bufs, ready, empty, c_desc, c_smem, M, N, K,
                   GATED: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    HALF: gl.constexpr = lo_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    width: gl.constexpr = HALF if GATED else 2 * HALF
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, HALF, 16])
    dtype: gl.constexpr = c_desc.dtype
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, width)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        off_m, off_lo, off_hi = _tile_coords(tile, M, N, BLOCK_M, HALF, GATED, GROUP_M)
        lo = gl.zeros((BLOCK_M, HALF), dtype=gl.float32, layout=layout)
        hi = gl.zeros((BLOCK_M, HALF), dtype=gl.float32, layout=layout)
        first = it
        for k in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s)
            lo = warpgroup_mma(a, lo_bufs.index(s).permute((1, 0)), lo, is_async=True)
            hi = warpgroup_mma(a, hi_bufs.index(s).permute((1, 0)), hi, is_async=True)
            lo, hi = warpgroup_mma_wait(num_outstanding=2, deps=(lo, hi))  # the previous k-step's pair is done
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > first)
            it += 1
        lo, hi = warpgroup_mma_wait(num_outstanding=0, deps=(lo, hi))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > first)
        if GATED:
            g = lo.to(dtype).to(gl.float32)  # each projection rounded, as eager's GEMMs round them
            u = hi.to(dtype).to(gl.float32)
            act = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)  # SiLU, rounded as eager's kernel rounds it
            tma.store_wait(0)  # (the previous tile's store has read c_smem)
            c_smem.store((act * u).to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_lo], c_smem)
        else:
            tma.store_wait(0)
            c_smem.store(lo.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_lo], c_smem)
            tma.store_wait(0)
            c_smem.store(hi.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_hi], c_smem)
    tma.store_wait(0)


@gluon.jit
def _ws_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, GATED: gl.constexpr, GROUP_M: gl.constexpr,
                    NUM_SMS: gl.constexpr, STAGES: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    lo_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, HALF, BLOCK_K], b_desc.layout)
    hi_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, HALF, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_partition, (a_bufs, lo_bufs, hi_bufs, ready, empty, c_desc, c_smem, M, N, K, GATED, GROUP_M, NUM_SMS,
                          num_warps)),
        (_load_partition, (a_desc, b_desc, a_bufs, lo_bufs, hi_bufs, ready, empty, M, N, K, GATED, GROUP_M,
                           NUM_SMS)),
    ], [1], [LOAD_REGS])


def _descs(x, w, out, BLOCK_M, HALF, BLOCK_K):
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))
    return desc(x, [BLOCK_M, BLOCK_K]), desc(w, [HALF, BLOCK_K]), desc(out, [BLOCK_M, HALF])


CONFIGS = {  # name: ws_gemm keywords (maxnreg: registers per thread of every warp, the loader's warpgroup included)
    "128x2x128_s3_w8": dict(BLOCK_M=128, HALF=128, BLOCK_K=64, STAGES=3, num_warps=8, maxnreg=168),
    "128x2x128_s4_w8": dict(BLOCK_M=128, HALF=128, BLOCK_K=64, STAGES=4, num_warps=8, maxnreg=168),
    "128x2x64_s4_w4": dict(BLOCK_M=128, HALF=64, BLOCK_K=64, STAGES=4, num_warps=4, maxnreg=232),
    "128x2x64_s6_w4": dict(BLOCK_M=128, HALF=64, BLOCK_K=64, STAGES=6, num_warps=4, maxnreg=232),
}


def ws_gemm(x, w, out, gated, BLOCK_M=128, HALF=128, BLOCK_K=64, GROUP_M=8, STAGES=3, num_warps=8, load_regs=40,
            maxnreg=168, num_sms=None):
    """out = x @ w^T (plain: w (N, K), out (M, N)) or act(x @ Wg^T) * (x @ Wu^T) (gated: w = [Wg; Wu] (2N, K),
    out (M, N)); x (M, K); bf16 or fp16, contiguous, 16-byte aligned rows."""
    M, K = x.shape
    N = out.shape[1]
    num_sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, HALF if gated else 2 * HALF)
    a, b, c = _descs(x, w, out, BLOCK_M, HALF, BLOCK_K)
    _ws_gemm_kernel[(min(num_sms, tiles),)](a, b, c, M, N, K, gated, GROUP_M, num_sms, STAGES, load_regs,
                                            num_warps=num_warps, maxnreg=maxnreg)


def compile_only(gated, STAGES=3, BLOCK_M=128, HALF=128, BLOCK_K=64, num_warps=8, load_regs=40, maxnreg=168):
    """Compile for sm_90 without a GPU (TensorDescriptors over CPU tensors give the signature): (shared memory
    bytes, registers per thread, spilled bytes) from the cubin's resource usage."""
    import re
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    M, N, K = 512, 256, 256
    x = torch.empty(M, K, dtype=torch.bfloat16)
    w = torch.empty(2 * N, K, dtype=torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    a, b, c = _descs(x, w, out, BLOCK_M, HALF, BLOCK_K)
    fn = _ws_gemm_kernel
    values = dict(a_desc=a, b_desc=b, c_desc=c, M=M, N=N, K=K)
    consts = dict(GATED=gated, GROUP_M=8, NUM_SMS=132, STAGES=STAGES, LOAD_REGS=load_regs, num_warps=num_warps)
    signature = {name: ("constexpr" if name in consts else mangle_type(values[name])) for name in fn.arg_names}
    src = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, local = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
    return dict(shared=k.metadata.shared, regs=regs, local_bytes=local)


def check():
    """Every config, plain and gated, on odd sizes (partial tiles everywhere) against float64; exit status 1 on a
    wrong or NaN value."""
    torch.manual_seed(0)
    bad = 0
    for M, N, K in ((300, 264, 200), (1000, 1032, 520), (2048, 4096, 1024)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        ref = x.double() @ w.double().T
        for name, cfg in CONFIGS.items():
            for gated in (False, True):
                o = torch.full((M, N if gated else 2 * N), float("nan"), device="cuda", dtype=torch.bfloat16)
                ws_gemm(x, w, o, gated, **cfg)
                torch.cuda.synchronize()
                want = torch.nn.functional.silu(ref[:, :N]) * ref[:, N:] if gated else ref
                err = ((o.double() - want).norm() / want.norm()).item()
                ok = err < 1e-2 and not o.isnan().any().item()
                bad += not ok
                print(json.dumps(dict(config=name, M=M, N=N, K=K, gated=gated, rel_err=err, ok=ok)), flush=True)
    sys.exit(1 if bad else 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--check", action="store_true", help="the checks alone (run in a child process by default)")
    args = p.parse_args()
    if args.compile_only:
        for name, cfg in CONFIGS.items():
            for gated in (False, True):
                print(name, "gated" if gated else "plain", compile_only(gated, **{k: v for k, v in cfg.items()}))
        return
    if args.check:
        check()
    out = {"device": torch.cuda.get_device_name(), "configs": CONFIGS, "checks": [], "rows": []}
    try:  # (a child process: a wrong barrier phase hangs the GPU, and only a timeout ends it)
        done = subprocess.run([sys.executable, __file__, "--check"], capture_output=True, text=True, timeout=240)
        out["checks"] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        out["checks_status"] = done.returncode if done.returncode == 0 else f"{done.returncode}: {done.stderr[-600:]}"
    except subprocess.TimeoutExpired:
        out["checks_status"] = "timed out after 240 s (a hang)"
    print("checks:", out["checks_status"], flush=True)
    _write(out)
    if out["checks_status"] != 0:
        return
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=150, return_mode="median") * 1e3  # noqa: E731
    for name, M, N, K in (("square", 4096, 4096, 4096), ("square", 8192, 8192, 8192), ("8b", 4096, 14336, 4096),
                          ("8b", 16384, 14336, 4096), ("tiny", 4096, 5632, 2048), ("8b", 512, 14336, 4096)):
        torch.manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        plain_w = w[:N] if name == "square" else w  # (square: N x N; else the GEMM on [Wg; Wu], 2N columns)
        o = torch.empty(M, plain_w.shape[0], device="cuda", dtype=torch.bfloat16)
        h = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        row = dict(config=name, M=M, N=N, K=K, cublas_us=bench(lambda: torch.nn.functional.linear(x, plain_w)))
        if name != "square":  # what a fused MLP's forward runs now above the packed kernel's threshold: eager's pair
            row["eager_gated_us"] = bench(lambda: torch.nn.functional.silu(torch.nn.functional.linear(x, w[:N]))
                                          * torch.nn.functional.linear(x, w[N:]))
        for cname, cfg in CONFIGS.items():
            try:
                row[f"{cname}_plain_vs_cublas"] = row["cublas_us"] / bench(lambda: ws_gemm(x, plain_w, o, False, **cfg))
                if name != "square":
                    t = bench(lambda: ws_gemm(x, w, h, True, **cfg))
                    row[f"{cname}_gated_vs_cublas_gemm"] = row["cublas_us"] / t
                    row[f"{cname}_gated_vs_eager"] = row["eager_gated_us"] / t
            except Exception as e:  # (a config that does not fit: reported)
                row[f"{cname}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        out["rows"].append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        _write(out)


def _write(out):
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "gluon_ws_gemm.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
