"""Benchmark: tritonmm against torch.matmul (cuBLAS), side by side in one run.

    python -m tritonmm.bench                      # public suite, every dtype it lists
    python -m tritonmm.bench --dtype bfloat16 --json out.json --csv out.csv
    python -m tritonmm.bench --linear             # fused linear+bias+GELU vs F.linear then F.gelu
    python -m tritonmm.bench --tags square odd    # a subset of the suite
    python -m tritonmm.bench --compare inductor   # add torch.compile max-autotune (Triton templates)
    python -m tritonmm.bench --plot bench.png     # TFLOP/s against problem size, per shape class
    python -m tritonmm.bench --from-json benchmarks/h200.json --plot bench.png   # no GPU needed
    python -m tritonmm.bench --from-json benchmarks/h200.json --markdown         # README tables

Per shape and dtype it prints tritonmm's time (µs) and TFLOP/s after dispatch, torch.matmul's,
their ratio (torch time / tritonmm time: above 1 means tritonmm is faster), the Triton kernel
alone (dispatch forced to Triton) and its ratio, the backend the dispatcher chose, and whether
the result matches a float64 reference as closely as torch.matmul's does. Times are medians of GPU
time measured as ``triton.testing.do_bench`` does (CUDA events, L2 flushed before each call), with
a GPU spin after each flush so host launch time is never counted (``_event_times_ms``), on N(0, 1)
data, never zeros;
torch.matmul and tritonmm are timed in alternation call by call (``_pair_times_ms``), so drift of a
shared GPU's clocks hits both alike and each follows the same work.

Without a GPU it runs small problems through Triton's interpreter on every kernel path, checks
them against float64 references and says that timings need a GPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_suite() -> pathlib.Path:
    from .kernels.configs import config_dir

    return config_dir() / "shapes.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tritonmm.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=pathlib.Path, default=None, help="suite JSON (default: the shipped public suite)")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None, help="dtypes (default: the suite's)")
    p.add_argument("--tags", nargs="+", default=None, help="only shapes whose tag starts with one of these")
    p.add_argument("--layout", choices=["nn", "nt"], default="nn",
                   help="B as a (K, N) row-major matrix (nn) or as an nn.Linear weight (N, K) transposed (nt)")
    p.add_argument("--linear", action="store_true", help="fused linear + bias + GELU vs F.linear then F.gelu")
    p.add_argument("--no-kernel-only", action="store_true", help="skip the forced-Triton column")
    p.add_argument("--no-check", action="store_true", help="skip the float64 correctness check")
    p.add_argument("--rep", type=int, default=100, help="timing budget per contender and row in ms (default 100)")
    p.add_argument("--compare", choices=["inductor"], nargs="*", default=[],
                   help="extra column: torch.compile(mode='max-autotune-no-cudagraphs') with Inductor's Triton "
                        "GEMM templates on the same problems, its tuning time reported too")
    p.add_argument("--plot", type=pathlib.Path, help="write a PNG of TFLOP/s against problem size per shape class")
    p.add_argument("--from-json", type=pathlib.Path,
                   help="print the table (and --plot) of an earlier --json run instead of measuring")
    p.add_argument("--markdown", action="store_true", help="with --from-json: print the tables as Markdown (README)")
    p.add_argument("--json", type=pathlib.Path, help="write rows and machine facts as JSON")
    p.add_argument("--csv", type=pathlib.Path, help="write rows as CSV")
    args = p.parse_args(argv)
    if args.markdown and not args.from_json:
        p.error("--markdown prints an earlier run: give it --from-json RUN.json")
    if args.from_json and not args.from_json.is_file():
        p.error(f"--from-json: no such file {args.from_json}")
    return args


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)


def load_suite(path: pathlib.Path, tags) -> tuple[list[dict], list[str]]:
    data = json.loads(path.read_text())
    shapes = [s for s in data["shapes"] if not tags or any(s["tag"].startswith(t) for t in tags)]
    return shapes, data.get("dtypes", ["bfloat16"])


def machine_facts() -> dict:
    import triton

    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                     memory_gib=round(props.total_memory / 2**30, 1))
        try:
            q = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,driver_version"
            out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout.strip().splitlines()
            facts["nvidia_smi"] = dict(zip(q.split(","), [v.strip() for v in out[0].split(",")])) if out else None
        except (OSError, subprocess.SubprocessError):
            facts["nvidia_smi"] = None
    return facts


HOST_SHIELD_CYCLES = 200_000
"""GPU clock cycles of the spin (``torch.cuda._sleep``) between each L2 flush and the timed call:
about 100 µs on an H200, so the host has enqueued the call before the GPU reaches its start event."""


def _event_times_ms(fn, rep: float, warmup: int = 3) -> list[float]:
    """Per-call GPU times (ms) of ``fn``: CUDA events around each call, L2 flushed before each, as
    ``triton.testing.do_bench`` does, plus a GPU spin after each flush. Without the spin, a call whose
    host path outlasts the flush (61 µs on the H200) is timed with the GPU idle, waiting for the host:
    measured on the H200, 40 µs of host time added to torch.matmul on a 10 µs 1000³ GEMM read as a 0.3x
    ratio under do_bench (``benchmarks/probe.py pairs``). With the spin both contenders' host paths
    are hidden; per-call host cost is measured separately (README, "Overhead")."""
    return _pair_times_ms((fn,), rep, warmup)[0]


def _bench_us(fn, rep: int) -> float:
    """Median µs of ``fn`` (see :func:`_event_times_ms`)."""
    return float(torch.tensor(_event_times_ms(fn, rep, warmup=25)).median()) * 1e3


def _pair_times_ms(fns, rep: float, warmup: int = 3) -> list[list[float]]:
    """Per-call GPU times (ms) of one or more contenders interleaved call by call: each sample flushes L2
    and spins the GPU (see :func:`_event_times_ms`) before every contender's call, in turn, the order
    reversed on every other sample, so each contender's calls follow the same work. ``rep``: ms of
    samples per contender. Timing whole batches of one contender after the other instead read the
    same torch.matmul call 5% slower in the first batch of each turn than in the second on 13-40 µs
    GEMMs (an A/A test, ``benchmarks/probe.py aa``; cause unknown), enough to decide a row."""
    from triton.runtime import driver

    cache = driver.active.get_empty_cache_for_benchmark()
    for fn in fns:
        for _ in range(warmup):
            fn()
    k = len(fns)

    def timed(n: int) -> list[list[float]]:
        ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
              for _ in range(n)]
        for i, row in enumerate(ev):
            for j in (range(k) if i % 2 == 0 else reversed(range(k))):
                driver.active.clear_cache(cache)
                torch.cuda._sleep(HOST_SHIELD_CYCLES)
                row[j][0].record()
                fns[j]()
                row[j][1].record()
        torch.cuda.synchronize()
        return [[row[j][0].elapsed_time(row[j][1]) for row in ev] for j in range(k)]

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = timed(4)  # also sizes the run: wall time per sample of every contender, flushes and spins included
    per_sample_ms = (time.perf_counter() - t0) * 1e3 / 4 / k
    rest = timed(max(2, int(rep / per_sample_ms)))
    return [f + r for f, r in zip(first, rest)]


def _bench_pair(f_torch, f_tri, rep: int, rounds: int = 10) -> tuple[float, float]:
    """Median µs of two contenders timed call by call in alternation (:func:`_pair_times_ms`), ``rep``
    ms in all per contender over ``rounds`` synchronized batches, so clock and neighbour drift on a
    shared GPU hits both alike."""
    times = ([], [])
    for _ in range(rounds):
        for t, new in zip(times, _pair_times_ms((f_torch, f_tri), max(rep / rounds, 3))):
            t.extend(new)
    return tuple(float(torch.tensor(t).median()) * 1e3 for t in times)


def _backend_label(d) -> str:
    if d.backend == "torch":
        return "torch:padded" if d.kernel == "padded" else "torch"
    return f"triton:{d.kernel}"


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy for a moment so its clocks leave idle before the first row is timed (the
    first row of a cold run measured torch.matmul at idle clocks otherwise)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _matmul_operands(shape: dict, dtype: torch.dtype, layout: str, gen) -> tuple:
    """Random (M, K) A and (K, N) B (B the transposed view of an (N, K) matrix for layout "nt")."""
    M, N, K = shape["M"], shape["N"], shape["K"]
    a = torch.randn(M, K, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
    if layout == "nt":
        return a, torch.randn(N, K, device="cuda", dtype=torch.float32, generator=gen).to(dtype).t()
    return a, torch.randn(K, N, device="cuda", dtype=torch.float32, generator=gen).to(dtype)


def _linear_operands(shape: dict, dtype: torch.dtype, gen) -> tuple:
    """Random x (M, K), weight (N, K) and bias (N,)."""
    M, N, K = shape["M"], shape["N"], shape["K"]
    return (torch.randn(M, K, device="cuda", generator=gen).to(dtype),
            torch.randn(N, K, device="cuda", generator=gen).to(dtype),
            torch.randn(N, device="cuda", generator=gen).to(dtype))


def bench_matmul_row(shape: dict, dtype: torch.dtype, args, gen) -> dict:
    import tritonmm
    from tritonmm.testing import error_report

    M, N, K = shape["M"], shape["N"], shape["K"]
    a, b = _matmul_operands(shape, dtype, args.layout, gen)
    flop = 2.0 * M * N * K
    row = {"tag": shape["tag"], "M": M, "N": N, "K": K, "dtype": str(dtype)[6:], "layout": args.layout}
    decision = tritonmm.explain(a, b)
    row["backend"] = _backend_label(decision)
    row["reason"] = decision.reason
    row["first_call_ms"] = _first_call_ms(lambda: tritonmm.matmul(a, b))
    row["torch_us"], row["tritonmm_us"] = _bench_pair(lambda: torch.matmul(a, b), lambda: tritonmm.matmul(a, b),
                                                      args.rep)
    if not args.no_kernel_only:
        # the Triton kernel alone: the tuned table's fastest Triton config for this shape where it
        # names one (also where cuBLAS won), else whatever @triton.autotune picks
        from . import shapes, tuned

        e = tuned.entry(a.device, dtype, shapes.plan(a, b))
        named = e and e.get("config") and e.get("kernel") in ("tma", "pointer", "splitk")
        force = ("triton", e["kernel"], e["config"]) if named else ("triton",)
        row["kernel_source"] = "tuned table" if len(force) > 1 else "autotuned"
        row["kernel_config"] = force[2] if len(force) > 1 else None
        with tritonmm.force_backend(*force):
            kd = tritonmm.explain(a, b)
            row["kernel"] = kd.kernel
            row["kernel_first_call_ms"] = _first_call_ms(lambda: tritonmm.matmul(a, b))
            row["kernel_us"] = _bench_us(lambda: tritonmm.matmul(a, b), args.rep)
            if not args.no_check:
                rep = error_report(tritonmm.matmul(a, b), a, b)
                row.update(kernel_ok=rep["ok"], kernel_err=rep["tri_err"], torch_err=rep["torch_err"])
    if not args.no_check:
        rep = error_report(tritonmm.matmul(a, b), a, b)
        row.update(ok=rep["ok"], err=rep["tri_err"], torch_err=rep["torch_err"])
    for key in ("torch", "tritonmm", "kernel"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = flop / row[f"{key}_us"] / 1e6
    row["ratio"] = row["torch_us"] / row["tritonmm_us"]
    if "kernel_us" in row:
        row["kernel_ratio"] = row["torch_us"] / row["kernel_us"]
    return row


def inductor_pass(rows: list[dict], work: list, args, progress=iter) -> None:
    """Add the Inductor columns to every row, after all torch.matmul / tritonmm timings are done.

    A separate pass: Inductor's autotuning leaves compile workers behind, whose CPU use disturbed
    the next row's timing of calls with Python work per call (measured on the H200: 18.2 against
    10.0 µs for the same cuBLAS call at 1024³ when interleaved). Operands are drawn anew (same shapes).
    """
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(1)
    for row, (shape, dtype) in progress(list(zip(rows, work))):
        if args.linear:
            x, w, bias = _linear_operands(shape, dtype, gen)
            bench_inductor(row, lambda x_, w=w, bias=bias: F.gelu(F.linear(x_, w, bias)), args, x)
        else:
            bench_inductor(row, torch.matmul, args, *_matmul_operands(shape, dtype, args.layout, gen))
        if "inductor_us" in row:
            row["inductor_tflops"] = 2.0 * shape["M"] * shape["N"] * shape["K"] / row["inductor_us"] / 1e6
        torch.cuda.empty_cache()


def bench_inductor(row: dict, fn, args, *inputs) -> None:
    """Add Inductor's max-autotune column to ``row``: ``fn`` compiled with only Triton GEMM templates.

    Records ``inductor_tune_s`` (first call: compile and autotune, seconds), ``inductor_us``,
    ``inductor_ratio`` (torch.matmul time / Inductor time) and ``vs_inductor`` (Inductor time /
    tritonmm time: above 1 means tritonmm is faster).
    """
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(max_autotune_gemm_backends="TRITON", max_autotune=True):
        compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            compiled(*inputs)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - e.g. no template fits: report, keep benchmarking
            row["inductor_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            return
        row["inductor_tune_s"] = time.perf_counter() - t0
        row["inductor_us"] = _bench_us(lambda: compiled(*inputs), args.rep)
    row["inductor_ratio"] = row["torch_us"] / row["inductor_us"]
    row["vs_inductor"] = row["inductor_us"] / row["tritonmm_us"]


def bench_linear_row(shape: dict, dtype: torch.dtype, args, gen) -> dict:
    import torch.nn.functional as F

    import tritonmm
    from tritonmm.testing import error_report

    M, N, K = shape["M"], shape["N"], shape["K"]
    x, w, bias = _linear_operands(shape, dtype, gen)
    row = {"tag": shape["tag"], "M": M, "N": N, "K": K, "dtype": str(dtype)[6:], "op": "linear+bias+gelu"}
    d = tritonmm.explain(x, w.t())
    row["backend"] = _backend_label(d)
    row["first_call_ms"] = _first_call_ms(lambda: tritonmm.linear(x, w, bias, "gelu"))
    row["torch_us"], row["tritonmm_us"] = _bench_pair(lambda: F.gelu(F.linear(x, w, bias)),
                                                      lambda: tritonmm.linear(x, w, bias, "gelu"), args.rep)
    with tritonmm.force_backend("triton"):
        tritonmm.linear(x, w, bias, "gelu")
        row["kernel_us"] = _bench_us(lambda: tritonmm.linear(x, w, bias, "gelu"), args.rep)
        out = tritonmm.linear(x, w, bias, "gelu")
    if not args.no_check:
        rep = error_report(out, x, w, ref_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias.double())),
                           torch_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias)), contract=F.linear)
        row.update(kernel_ok=rep["ok"], kernel_err=rep["tri_err"], torch_err=rep["torch_err"])
    flop = 2.0 * M * N * K
    for key in ("torch", "tritonmm", "kernel"):
        if f"{key}_us" not in row:
            continue
        row[f"{key}_tflops"] = flop / row[f"{key}_us"] / 1e6
    row["ratio"] = row["torch_us"] / row["tritonmm_us"]
    row["kernel_ratio"] = row["torch_us"] / row["kernel_us"]
    return row


def geomean(xs) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def shape_class(tag: str) -> str:
    return tag.split("-")[0]


def summarize(rows: list[dict]) -> list[dict]:
    """Geometric-mean ratios per (dtype, shape class) and per dtype overall."""
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        sub = [r for r in rows if r["dtype"] == dtype]
        classes = sorted({shape_class(r["tag"]) for r in sub}) + ["all"]
        for cls in classes:
            rs = sub if cls == "all" else [r for r in sub if shape_class(r["tag"]) == cls]
            entry = {"dtype": dtype, "class": cls, "n": len(rs), "ratio": geomean(r["ratio"] for r in rs),
                     "kernel_ratio": geomean(r.get("kernel_ratio") for r in rs),
                     "min_ratio": min(r["ratio"] for r in rs)}
            if any("vs_inductor" in r for r in rs):
                entry["vs_inductor"] = geomean(r.get("vs_inductor") for r in rs)
                entry["inductor_ratio"] = geomean(r.get("inductor_ratio") for r in rs)
            out.append(entry)
    return out


def _check(r: dict) -> str:
    """'ok', 'FAIL' (tritonmm's or the kernel's result outside the float64 bound) or '-' (not checked)."""
    ok = r.get("ok", r.get("kernel_ok"))
    return "-" if ok is None else ("ok" if ok and r.get("kernel_ok", True) else "FAIL")


def print_table(rows: list[dict], summary: list[dict]) -> None:
    head = (f"{'dtype':8} {'tag':16} {'M':>6} {'N':>6} {'K':>6} {'backend':14} {'tritonmm us':>11} {'TFLOP/s':>7} "
            f"{'torch us':>9} {'TFLOP/s':>7} {'ratio':>6} {'kernel us':>9} {'k.ratio':>7} {'check':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        check = _check(r)
        print(f"{r['dtype']:8} {r['tag']:16} {r['M']:>6} {r['N']:>6} {r['K']:>6} {r['backend']:14} "
              f"{r['tritonmm_us']:>11.1f} {r['tritonmm_tflops']:>7.1f} {r['torch_us']:>9.1f} "
              f"{r['torch_tflops']:>7.1f} {r['ratio']:>6.2f} {r.get('kernel_us', float('nan')):>9.1f} "
              f"{r.get('kernel_ratio', float('nan')):>7.2f} {check:>5}")
    if any("inductor_us" in r for r in rows):
        print("\nInductor max-autotune (Triton templates): time, tuning time, torch.matmul time / Inductor time, "
              "Inductor time / tritonmm time (>1: tritonmm faster)")
        for r in rows:
            if "inductor_us" in r:
                print(f"{r['dtype']:8} {r['tag']:16} {r['M']:>6} {r['N']:>6} {r['K']:>6} "
                      f"{r['inductor_us']:>9.1f} us {r['inductor_tune_s']:>6.1f} s "
                      f"{r['inductor_ratio']:>6.2f} {r['vs_inductor']:>6.2f}")
            elif "inductor_error" in r:
                print(f"{r['dtype']:8} {r['tag']:16} {r['M']:>6} {r['N']:>6} {r['K']:>6} "
                      f"Inductor failed: {r['inductor_error']}")
    inductor = any("vs_inductor" in s for s in summary)
    print("\ngeometric mean of torch.matmul time / tritonmm time (>1: tritonmm faster)")
    print(f"{'dtype':8} {'class':10} {'n':>3} {'dispatch':>8} {'kernel':>7} {'min':>6}"
          + (f" {'inductor':>8} {'vs ind.':>7}" if inductor else ""))
    for s in summary:
        print(f"{s['dtype']:8} {s['class']:10} {s['n']:>3} {s['ratio']:>8.3f} {s['kernel_ratio']:>7.3f} "
              f"{s['min_ratio']:>6.2f}"
              + (f" {s.get('inductor_ratio', float('nan')):>8.3f} {s.get('vs_inductor', float('nan')):>7.3f}"
                 if inductor else ""))


def plot(rows: list[dict], path: pathlib.Path, title: str = "") -> None:
    """TFLOP/s of tritonmm (after dispatch), torch.matmul, the Triton kernel alone and Inductor (when
    measured) against problem size (2·M·N·K FLOP), one panel per shape class; written with matplotlib.

    Raises:
        ImportError: matplotlib is missing (``pip install tritonmm[bench]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.NullFormatter below)

    classes = sorted({(r["dtype"], shape_class(r["tag"])) for r in rows})
    cols = min(3, len(classes))
    nrows = -(-len(classes) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False)
    series = [("tritonmm", "tritonmm (dispatch)", "o-"), ("torch", "torch.matmul (cuBLAS)", "s--"),
              ("kernel", "Triton kernel alone", "^:"), ("inductor", "Inductor max-autotune", "x-.")]
    for ax, (dtype, cls) in zip(axes.flat, classes):
        rs = sorted((r for r in rows if r["dtype"] == dtype and shape_class(r["tag"]) == cls),
                    key=lambda r: 2.0 * r["M"] * r["N"] * r["K"])
        flops = [2.0 * r["M"] * r["N"] * r["K"] for r in rs]
        for key, label, style in series:
            ys = [r.get(f"{key}_tflops") for r in rs]
            if any(y is not None for y in ys):
                ax.plot([f for f, y in zip(flops, ys) if y is not None], [y for y in ys if y is not None], style,
                        label=label, markersize=4)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no overlapping minor labels
        if flops and max(flops) < 10 * min(flops):  # within one decade there may be no major tick: label the data
            ticks = sorted(set(flops))
            ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
        ax.set_title(f"{cls} ({dtype})")
        ax.set_xlabel("problem size, 2·M·N·K FLOP")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(classes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.97) if title else None)  # leave the suptitle its own band
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows: list[dict], summary: list[dict], machine: dict) -> str:
    """The README's benchmark tables (summary per dtype and shape class, then every row) as Markdown,
    with the Inductor columns when the run has them (``--compare inductor``)."""
    smi = machine.get("nvidia_smi") or {}
    linear = any(str(r.get("op", "")).startswith("linear") for r in rows)
    ratio = ("F.gelu(F.linear) time / tritonmm.linear time" if linear else "torch.matmul time / tritonmm time")
    ind = any("vs_inductor" in r for r in rows)
    lines = [f"{machine.get('gpu', '?')} ({machine.get('sms', '?')} SMs, SM clock {smi.get('clocks.sm', '?')}), "
             f"torch {machine.get('torch', '?')}, triton {machine.get('triton', '?')}, CUDA {machine.get('cuda', '?')}, "
             f"{machine.get('date', '?')}. Ratio = {ratio} (> 1: tritonmm faster); "
             "kernel = the Triton kernel alone (dispatch forced to Triton: the tuned table's fastest Triton "
             "config where it has the shape, else autotuned)"
             + ("; vs Inductor = Inductor max-autotune time / tritonmm time." if ind else "."), "",
             "| dtype | class | n | geomean ratio | min ratio | kernel geomean |" + (" vs Inductor |" if ind else ""),
             "|---|---|---|---|---|---|" + ("---|" if ind else "")]
    for s in summary:
        lines.append(f"| {s['dtype']} | {s['class']} | {s['n']} | {s['ratio']:.3f} | {s['min_ratio']:.3f} | "
                     f"{s['kernel_ratio']:.3f} |" + (f" {s.get('vs_inductor') or float('nan'):.3f} |" if ind else ""))
    lines += ["", "| dtype | op | tag | M | N | K | backend | tritonmm µs | TFLOP/s | torch µs | TFLOP/s | ratio "
                  "| kernel ratio | check |" + (" Inductor µs | Inductor tuning s | vs Inductor |" if ind else ""),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if ind else "")]
    for r in rows:
        op = r.get("op", f"matmul {r.get('layout', 'nn')}")
        line = (f"| {r['dtype']} | {op} | {r['tag']} | {r['M']} | {r['N']} | {r['K']} | {r['backend']} | "
                f"{r['tritonmm_us']:.1f} | {r['tritonmm_tflops']:.0f} | {r['torch_us']:.1f} | "
                f"{r['torch_tflops']:.0f} | {r['ratio']:.2f} | {r.get('kernel_ratio', float('nan')):.2f} | "
                f"{_check(r)} |")
        if ind:
            line += (f" {r.get('inductor_us', float('nan')):.1f} | {r.get('inductor_tune_s', float('nan')):.1f} | "
                     f"{r.get('vs_inductor', float('nan')):.2f} |")
        lines.append(line)
    return "\n".join(lines)


def from_json(args) -> int:
    """Print (and plot, or write as CSV) an earlier run's JSON: no GPU needed.

    Returns 2, with a message, for a file that is not a ``--json`` run of this tool.
    """
    data = json.loads(args.from_json.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        print(f"python -m tritonmm.bench: error: {args.from_json} is not a --json run of python -m tritonmm.bench "
              "(no 'rows' list)", file=sys.stderr)
        return 2
    rows = data["rows"]
    machine = data.get("machine") or next((r.get("machine") for r in data.get("runs", []) if r.get("machine")), {})
    if args.markdown:
        print(markdown(rows, summarize(rows), machine))
    else:
        print_table(rows, summarize(rows))
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        m = machine
        plot(rows, args.plot, f"{m.get('gpu', '?')}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, "
                              f"{m.get('date', '')[:10]}")
        print(f"wrote {args.plot}")
    return 0


def cpu_check() -> int:
    """No GPU: run each kernel path through the interpreter on small problems and check them (and the
    padded path, cuBLAS on padded copies, as torch.mm on CPU)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.nn.functional as F

    import tritonmm
    from tritonmm.kernels import configs
    from tritonmm.testing import error_report, randn

    print("No CUDA GPU: running the Triton kernels through Triton's interpreter (TRITON_INTERPRET=1) "
          "on small problems and checking them against float64 references.")
    torch.manual_seed(0)
    failures = 0
    print(f"{'dtype':9} {'kernel':10} {'problem':24} {'max err':>10} {'bound':>10}  result")
    tma_split = dict(configs.interpreter_config("tma"), SPLIT_K=3, EPILOGUE_SUBTILE=0)  # 3 uneven K slices
    for dtype in DTYPES.values():
        for kernel in ("tma", "tma-splitk", "pointer", "splitk", "padded"):
            force = {"padded": ("torch", "padded"), "tma-splitk": ("triton", "tma", tma_split)}.get(kernel,
                                                                                                ("triton", kernel))
            for what in ("matmul 97x83x71", "linear+bias+gelu 45x61x53"):
                with tritonmm.force_backend(*force):
                    if what.startswith("matmul"):
                        a, b = randn(97, 71, dtype=dtype), randn(71, 83, dtype=dtype)
                        rep = error_report(tritonmm.matmul(a, b), a, b)
                    else:
                        x, w, bias = randn(45, 53, dtype=dtype), randn(61, 53, dtype=dtype), randn(61, dtype=dtype)
                        rep = error_report(
                            tritonmm.linear(x, w, bias, "gelu"), x, w,
                            ref_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias.double())),
                            torch_fn=lambda x_, w_: F.gelu(F.linear(x_, w_, bias)), contract=F.linear)
                failures += not rep["ok"]
                print(f"{str(dtype)[6:]:9} {kernel:10} {what:24} {rep['tri_err']:>10.2e} {rep['bound']:>10.2e}  "
                      f"{'ok' if rep['ok'] else 'FAIL'}")
    print(f"\n{'all checks passed' if not failures else f'{failures} checks FAILED'}. "
          "Timings need a CUDA GPU: run `python -m tritonmm.bench` on one.")
    return 1 if failures else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return from_json(args)
    if not torch.cuda.is_available():
        defaults = vars(parse_args([]))
        ignored = [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if v != defaults[k]]
        if ignored:
            print(f"No CUDA GPU: {', '.join(ignored)} ignored (they shape a GPU measurement; without a GPU the "
                  "benchmark runs only the interpreter check below).", file=sys.stderr)
        return cpu_check()
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience
        def tqdm(it, **kw):
            return it
    shapes, suite_dtypes = load_suite(args.shapes or default_suite(), args.tags)
    if args.linear:
        shapes = [s for s in shapes if s["tag"].startswith("llama8b")]
    dtypes = [DTYPES[d] for d in (args.dtype or suite_dtypes)]
    if torch.float32 in dtypes:
        torch.backends.cuda.matmul.allow_tf32 = True  # the suite's float32 rows are TF32 rows
    gen = torch.Generator(device="cuda").manual_seed(0)
    warm_up_gpu()
    rows = []
    work = [(s, d) for d in dtypes for s in shapes]
    for shape, dtype in tqdm(work, desc="bench", file=sys.stderr, mininterval=5):
        fn = bench_linear_row if args.linear else bench_matmul_row
        rows.append(fn(shape, dtype, args, gen))
        torch.cuda.empty_cache()
    if "inductor" in args.compare:
        inductor_pass(rows, work, args, lambda it: tqdm(it, desc="inductor", file=sys.stderr, mininterval=5))
    summary = summarize(rows)
    print_table(rows, summary)
    if args.plot:
        facts = machine_facts()
        plot(rows, args.plot, f"{facts.get('gpu')}, torch {facts['torch']}, triton {facts['triton']}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_facts(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows, "summary": summary}, indent=1))
    if args.csv:
        write_csv(rows, args.csv)
    bad = [r for r in rows if r.get("ok") is False or r.get("kernel_ok") is False]
    if bad:
        print(f"\n{len(bad)} rows FAILED the correctness check", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
