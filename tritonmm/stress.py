"""Bounded randomized soak: many threads and CUDA streams calling tritonmm with random problems.

    python -m tritonmm.stress                         # GPU: 20,000 calls, 4 threads, 2 streams
    python -m tritonmm.stress --calls 100000 --threads 8 --streams 4 --json soak.json
    python -m tritonmm.stress --autotune              # let forced-Triton geometries autotune concurrently

Each thread owns a CUDA stream (threads share streams when ``--streams`` < ``--threads``) and
calls ``tritonmm.matmul`` / ``tritonmm.linear`` on problems drawn from a pool of random
geometries: float16, bfloat16 and float32 (TF32 allowed); 1-D, 2-D and batched operands with
broadcasting; transposed and sliced (non-contiguous, unaligned) operands; fused bias and
activations; automatic dispatch (a third) or a forced Triton kernel (TMA, pointer, split-K). Every
result is checked against a float64 reference with :func:`tritonmm.core.reference.error_report`
(error within twice torch.matmul's plus rounding). Fresh N(0, 1) data each call, never zeros.

It prints the calls made, mismatches and errors (both must be 0), the peak GPU memory
(``torch.cuda.max_memory_allocated``) and the growth of allocated memory between the end
of a warm-up pass (every geometry once on every thread) and the end of the run (must be 0).
Exit status 1 when any of these fails.

Without a GPU it runs a short single-thread soak through Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import pathlib
import random
import sys
import threading
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m tritonmm.stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20_000 if gpu else 60, help="calls after the warm-up pass")
    p.add_argument("--threads", type=int, default=4 if gpu else 1, help="calling threads")
    p.add_argument("--streams", type=int, default=2 if gpu else 1, help="CUDA streams the threads share")
    p.add_argument("--geometries", type=int, default=48 if gpu else 12, help="size of the random problem pool")
    p.add_argument("--max-dim", type=int, default=1536 if gpu else 48, help="largest M, N or K drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autotune", action="store_true",
                   help="autotune forced-Triton geometries (default: heuristic configs, TRITONMM_AUTOTUNE=0)")
    p.add_argument("--json", type=pathlib.Path, help="write the summary as JSON")
    return p.parse_args(argv)


def _dim(rng: random.Random, max_dim: int) -> int:
    kind = rng.random()
    if kind < 0.2:
        return rng.randint(1, 16)  # decode-like
    if kind < 0.5:
        return rng.randint(1, max_dim)  # anything, mostly unaligned
    return min(max_dim, 16 * rng.randint(1, max(1, max_dim // 16)))  # aligned


def make_geometry(rng: random.Random, max_dim: int, gpu: bool) -> dict:
    """One random problem description (no tensors)."""
    dtype = rng.choice(["bfloat16", "float16", "float32"] if gpu else ["float16", "float32"])
    op = rng.choice(["matmul", "matmul", "linear"])
    M, N, K = _dim(rng, max_dim), _dim(rng, max_dim), _dim(rng, max_dim)
    g = {"op": op, "dtype": dtype, "M": M, "N": N, "K": K,
         "a_t": rng.random() < 0.3, "b_t": rng.random() < 0.5, "slice": rng.random() < 0.2,
         "backend": rng.choice(["auto", "triton", "triton"]), "kernel": rng.choice(["auto", "tma", "pointer", "splitk"])}
    if op == "matmul":
        g["batch_a"], g["batch_b"] = rng.choice([((), ()), ((3,), ()), ((2, 3), (3,)), ((4,), (4,)), ((2, 1), (1, 3))])
        g["vec"] = rng.choice([None, None, None, "a", "b"]) if not g["batch_a"] else None
    else:
        g["batch_a"], g["batch_b"], g["vec"] = rng.choice([(), (5,), (2, 3)]), (), None
        g["bias"] = rng.random() < 0.6
        g["activation"] = rng.choice(["none", "relu", "gelu", "gelu_tanh", "silu"])
    return g


def _operand(shape, transposed: bool, sliced: bool, dtype, device, gen) -> torch.Tensor:
    """N(0, 1) data of ``shape``, stored transposed and/or as a slice of a wider buffer as asked."""
    *batch, r, c = shape
    store = (*batch, c, r) if transposed else (*batch, r, c)
    if sliced:
        store = (*store[:-1], store[-1] + 3)
    t = torch.randn(store, device=device, generator=gen).to(dtype)
    if sliced:
        t = t[..., 1:store[-1] - 2]
    return t.mT if transposed else t


def make_case(g: dict, device, gen) -> dict:
    dtype = getattr(torch, g["dtype"])
    M, N, K = g["M"], g["N"], g["K"]
    if g["op"] == "linear":
        x = _operand((*g["batch_a"], M, K), g["a_t"], g["slice"], dtype, device, gen)
        w = _operand((N, K), g["b_t"], False, dtype, device, gen)
        bias = torch.randn(N, device=device, generator=gen).to(dtype) if g["bias"] else None
        return {"a": x, "b": w, "bias": bias}
    a = _operand((*g["batch_a"], M, K), g["a_t"], g["slice"], dtype, device, gen)
    b = _operand((*g["batch_b"], K, N), g["b_t"], False, dtype, device, gen)
    if g["vec"] == "a":
        a = a[0]
    elif g["vec"] == "b":
        b = b[:, 0]
    return {"a": a, "b": b, "bias": None}


def run_case(g: dict, case: dict):
    """(result, error report) of one call."""
    import torch.nn.functional as F

    import tritonmm
    from tritonmm.core.activations import apply_
    from tritonmm.core.reference import error_report

    a, b, bias = case["a"], case["b"], case["bias"]
    with tritonmm.force_backend(g["backend"], g["kernel"] if g["backend"] == "triton" else "auto"):
        if g["op"] == "matmul":
            out = tritonmm.matmul(a, b)
            return out, error_report(out, a, b)
        act = g["activation"]
        out = tritonmm.linear(a, b, bias, act)

    def ref(x, w):
        return apply_(F.linear(x, w, None if bias is None else bias.to(x.dtype)), act)

    return out, error_report(out, a, b, ref_fn=ref, torch_fn=ref, contract=F.linear)


def describe(g: dict) -> str:
    extra = f" bias={g.get('bias')} act={g.get('activation')}" if g["op"] == "linear" else f" vec={g['vec']}"
    return (f"{g['op']} {g['dtype']} M={g['M']} N={g['N']} K={g['K']} batch={g['batch_a']}x{g['batch_b']} "
            f"a_t={g['a_t']} b_t={g['b_t']} slice={g['slice']} {g['backend']}/{g['kernel']}{extra}")


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        if args.threads != 1 or args.streams != 1:
            print("No GPU: Triton's interpreter is not thread-safe; running one thread, no streams.")
            args.threads = args.streams = 1
    if not args.autotune:
        os.environ.setdefault("TRITONMM_AUTOTUNE", "0")
    import tritonmm
    from tritonmm.dispatch import runners

    torch.set_float32_matmul_precision("high")  # float32 problems use TF32, in torch.matmul and in tritonmm
    device = torch.device("cuda" if gpu else "cpu")
    rng = random.Random(args.seed)
    pool = [make_geometry(rng, args.max_dim, gpu) for _ in range(args.geometries)]
    streams = [torch.cuda.Stream() for _ in range(args.streams)] if gpu else [None] * args.streams
    counts = collections.Counter()
    mismatches, errors, lock = [], [], threading.Lock()
    barrier = threading.Barrier(args.threads + 1)
    per_thread = [args.calls // args.threads + (i < args.calls % args.threads) for i in range(args.threads)]

    def one(g, gen, tally: bool):
        try:
            case = make_case(g, device, gen)
            before = {k: v.clone() for k, v in case.items() if v is not None}
            out, rep = run_case(g, case)
            touched = [k for k, v in before.items() if not torch.equal(v, case[k])]
            path = _backend_of(g, case) if tally else None
            with lock:
                if tally:
                    counts["calls"] += 1
                    counts[path] += 1
                if not rep["ok"] or touched:
                    mismatches.append(f"{describe(g)}: error {rep['tri_err']:.3e} > bound {rep['bound']:.3e}"
                                      + (f"; inputs modified: {touched}" if touched else ""))
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the soak
            with lock:
                errors.append(f"{describe(g)}: {type(exc).__name__}: {exc}")

    def worker(tid: int):
        gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + tid)
        stream = streams[tid % len(streams)]
        local = random.Random(args.seed * 7919 + tid)
        ctx = torch.cuda.stream(stream) if gpu else contextlib.nullcontext()
        with ctx:
            for g in pool:  # warm-up: compile, plan, size this thread's workspace on its stream
                one(g, gen, tally=False)
            if gpu:
                stream.synchronize()
            barrier.wait()  # the main thread measures memory here
            barrier.wait()
            for _ in range(per_thread[tid]):
                one(local.choice(pool), gen, tally=True)
            if gpu:
                stream.synchronize()
            barrier.wait()  # still alive (thread-local workspaces held) while the main thread measures again
            barrier.wait()

    t0 = time.time()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.threads)]
    for t in threads:
        t.start()
    barrier.wait()
    gc.collect()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if gpu else 0
    warm_s = time.time() - t0
    barrier.wait()
    barrier.wait()  # every thread done with its calls, none exited yet
    gc.collect()
    if gpu:
        torch.cuda.synchronize()
    growth = (torch.cuda.memory_allocated() - base) if gpu else 0
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    barrier.wait()
    for t in threads:
        t.join()
    elapsed = time.time() - t0
    summary = {
        "device": torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter)",
        "torch": torch.__version__, "tritonmm": tritonmm.__version__,
        "calls": counts["calls"], "threads": args.threads, "streams": args.streams if gpu else 0,
        "geometries": len(pool), "seed": args.seed, "autotune": args.autotune,
        "mismatches": len(mismatches), "errors": len(errors),
        "peak_memory_bytes": peak, "memory_growth_bytes": growth,
        "warmup_s": round(warm_s, 1), "elapsed_s": round(elapsed, 1),
        "paths": {k: v for k, v in sorted(counts.items()) if k != "calls"},
        "runner_cache_entries": len(runners._cache),
        "first_mismatches": mismatches[:10], "first_errors": errors[:10],
    }
    print(f"calls made: {summary['calls']} ({args.threads} threads, {summary['streams']} streams, "
          f"{len(pool)} geometries, seed {args.seed}, {elapsed:.1f} s incl. {warm_s:.1f} s warm-up)")
    print(f"mismatches: {len(mismatches)}   errors: {len(errors)}")
    if gpu:
        print(f"peak GPU memory: {peak / 2**20:.1f} MiB   memory growth after warm-up: {growth} bytes")
    print("paths: " + ", ".join(f"{k} {v}" for k, v in summary["paths"].items()))
    for line in (mismatches + errors)[:10]:
        print("  FAIL", line)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if counts["calls"] == args.calls and not mismatches and not errors and growth == 0 else 1


def _backend_of(g: dict, case: dict) -> str:
    """The path the call took, as ``explain`` reports it (matmul geometry; linear as x @ w.T)."""
    import tritonmm

    a, b = case["a"], case["b"]
    if g["op"] == "linear":
        b = b.t()
    with tritonmm.force_backend(g["backend"], g["kernel"] if g["backend"] == "triton" else "auto"):
        d = tritonmm.explain(a, b)
    return "torch" if d.backend == "torch" else f"triton[{d.kernel}]"


if __name__ == "__main__":
    sys.exit(main())
