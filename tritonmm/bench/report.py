"""Reports of a run: summaries, the terminal table, Markdown for the README, CSV and a plot."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import sys


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)


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
    try:
        suite = _render(args, json.loads(args.from_json.read_text()))
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
        print(f"python -m tritonmm.bench: error: {args.from_json} is not a --json run of python -m tritonmm.bench "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if suite is None:  # a --model or --mlp run, printed
        return 0
    rows, machine = suite  # a suite run: its table printed, then what the options write
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        m = machine
        plot(rows, args.plot, f"{m.get('gpu', '?')}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, "
                              f"{m.get('date', '')[:10]}")
        print(f"wrote {args.plot}")
    return 0


def _render(args, data):
    """Print the run ``data``: None for a --model or --mlp run, (rows, machine) for a suite run.

    Raises:
        ValueError: ``data`` is neither.
    """
    if isinstance(data, dict) and isinstance(data.get("phases"), list):  # a --model run
        from .model_report import markdown as model_markdown
        from .model_report import print_report

        print(model_markdown(data) if args.markdown else "", end="\n" if args.markdown else "")
        if not args.markdown:
            print_report(data)
        return None
    if isinstance(data, dict) and isinstance(data.get("rows"), list) and data["rows"] and "tokens" in data["rows"][0]:
        from . import mlp  # a --mlp run

        if args.markdown:
            print(mlp.markdown(data["rows"]))
        else:
            mlp.print_report(data["rows"])
        return None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("no 'rows' list")
    rows = data["rows"]
    machine = data.get("machine") or next((r.get("machine") for r in data.get("runs", []) if r.get("machine")), {})
    if args.markdown:
        print(markdown(rows, summarize(rows), machine))
    else:
        print_table(rows, summarize(rows))
    return rows, machine
