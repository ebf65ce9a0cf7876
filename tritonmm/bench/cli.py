"""Benchmark: tritonmm against torch.matmul (cuBLAS), side by side in one run.

    python -m tritonmm.bench                      # public suite, every dtype it lists
    python -m tritonmm.bench --dtype bfloat16 --json out.json --csv out.csv
    python -m tritonmm.bench --linear             # fused linear+bias+GELU vs F.linear then F.gelu
    python -m tritonmm.bench --tags square odd    # a subset of the suite
    python -m tritonmm.bench --compare inductor   # add torch.compile max-autotune (Triton templates)
    python -m tritonmm.bench --plot bench.png     # TFLOP/s against problem size, per shape class
    python -m tritonmm.bench --from-json benchmarks/h200.json --plot bench.png   # no GPU needed
    python -m tritonmm.bench --from-json benchmarks/h200.json --markdown         # a run's tables as Markdown
    python -m tritonmm.bench --readme README.md   # the README's table, from the runs in benchmarks/ beside it
    python -m tritonmm.bench --model --json model.json   # a transformers Llama model: off / swap / patch
    python -m tritonmm.bench --first-sight               # first-sight tuning on six model families' layers

Per shape and dtype it prints tritonmm's time (µs) and TFLOP/s after dispatch, torch.matmul's,
their ratio (torch time / tritonmm time: above 1 means tritonmm is faster), the Triton kernel
alone (dispatch forced to Triton) and its ratio, the backend the dispatcher chose, and whether
the result matches a float64 reference as closely as torch.matmul's does. Times are medians of GPU
time measured as ``triton.testing.do_bench`` does (CUDA events, L2 flushed before each call), with
a GPU spin after each flush so host launch time is never counted (``_event_times_ms``), on N(0, 1)
data, never zeros;
torch.matmul and tritonmm are timed in alternation call by call (``_pair_times_ms``), so drift of a
shared GPU's clocks hits both alike and each follows the same work.

``--model`` runs a transformers Llama-architecture model with tritonmm off, swapped in and patched
in, alternated in one process (:mod:`tritonmm.bench.model`), and the per-call host cost of each entry point.

Without a GPU it runs small problems through Triton's interpreter on every kernel path, checks
them against float64 references and says that timings need a GPU (options that shape a GPU measurement,
``--json``, ``--csv``, ``--plot`` and the others, are ignored, with a note); ``--model`` runs a tiny model on
the CPU and prints the per-call rows. ``--mlp`` and ``--first-sight``, which have no CPU version, exit with
status 2 and a message, as ``python -m tritonmm.tune`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

import tritonmm

from ..tune.suite import DTYPES, default_suite, load_suite
from . import mlp, model, model_report, per_call, readme
from .cpu import cpu_check
from .gemm import bench_linear_row, bench_matmul_row, inductor_pass
from .model import CONFIGS
from .report import from_json, plot, print_table, summarize, write_csv
from .timing import machine_facts, warm_up_gpu


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
    p.add_argument("--readme", type=pathlib.Path, metavar="README.md",
                   help="rewrite the 'when it is faster' table in this README from the committed runs in the "
                        "benchmarks/ folder beside it (no GPU needed)")
    p.add_argument("--json", type=pathlib.Path, help="write rows and machine facts as JSON")
    p.add_argument("--csv", type=pathlib.Path, help="write rows as CSV")
    p.add_argument("--model", action="store_true",
                   help="the model benchmark: a transformers Llama model, tritonmm off / swap_linear / patch_linear / "
                        "fuse / off again (A/A)")
    p.add_argument("--model-configs", nargs="+", choices=list(CONFIGS), default=None,
                   help="with --model: which configs (default: small and llama3-8b-2l on a GPU, tiny without)")
    p.add_argument("--model-phases", nargs="+", choices=["eager", "train", "compile", "static", "per_call"], default=None,
                   help="with --model: which phases (default: all, the per-call rows last; compile and static need a GPU)")
    p.add_argument("--unfolded", action="store_true",
                   help="with --model: the eager and CUDA-graph phases also time fuse without the RMSNorm folds "
                        "(tritonmm.modules.norm_fold.FOLD off), as the mode fuse_unfolded")
    p.add_argument("--rounds", type=int, default=15, help="with --model / --mlp: rounds of alternation (default 15)")
    p.add_argument("--mlp", action="store_true",
                   help="the MLP-block benchmark: transformers' LlamaMLP eager vs tritonmm.fuse, the cuBLAS bound and "
                        "torch.compile (needs a GPU)")
    p.add_argument("--mlp-configs", nargs="+", choices=list(mlp.CONFIGS), default=None,
                   help="with --mlp: which MLPs (default: all)")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help=f"with --mlp: token counts M (default: {' '.join(map(str, mlp.TOKENS))})")
    p.add_argument("--first-sight", action="store_true",
                   help="first-sight tuning on the linear layers of six model families outside the suite: time per "
                        "new geometry, the decision against F.linear, a second process (needs a GPU)")
    args = p.parse_args(argv)
    if args.markdown and not args.from_json:
        p.error("--markdown prints an earlier run: give it --from-json RUN.json")
    if args.from_json and not args.from_json.is_file():
        p.error(f"--from-json: no such file {args.from_json}")
    if args.readme and not args.readme.is_file():
        p.error(f"--readme: no such file {args.readme}")
    return args


def model_main(args) -> int:
    """``--model``: the model benchmark (a tiny model on the CPU without a GPU)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        transformers = None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # tritonmm's host cost on the CPU: torch serves CPU tensors, as outside the tests
        os.environ["TRITON_INTERPRET"] = "0"
        tritonmm.clear_cache()
        torch.set_num_threads(1)
        print("No CUDA GPU: a tiny model on the CPU; these times show tritonmm's host cost per call, not GPU speed.",
              flush=True)
    if transformers is None:
        print("transformers is not installed (pip install transformers): per-call rows only", file=sys.stderr)
        result = {"phases": [], "per_call": per_call.per_call_rows(device)}
    else:
        if device.type == "cuda":
            warm_up_gpu()
        facts = machine_facts() if args.json else None

        def measured(rows):  # the phases so far, on disk: a run stopped later keeps them
            _write_json(args, {"phases": rows, "per_call": [], "partial": True}, facts)

        result = model.run(device, args.rounds, args.model_configs, args.model_phases, progress=_status,
                           measured=measured if args.json else None, unfolded=args.unfolded)
    model_report.print_report(result)
    if args.json:
        _write_json(args, result)
    return 0


def _status(message: str) -> None:
    """The model benchmark's progress, to stderr: what it measures now (``model <config>: <phase>``, ``measuring
    ...``), not the table's lines, which its report prints once at the end."""
    if message.startswith(("model ", "measuring ")):
        print(message, file=sys.stderr, flush=True)


def _write_json(args, result: dict, facts: dict | None = None) -> None:
    """``result`` with the machine's facts (``facts``, else read now) and the arguments, to ``args.json``
    (replaced whole: a reader never sees half a file)."""
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(json.dumps({"machine": facts or machine_facts(),
                               "args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1))
    os.replace(tmp, args.json)


def mlp_main(args) -> int:
    """``--mlp``: the MLP-block benchmark (GPU only: without one it says so and returns 2)."""
    if not torch.cuda.is_available():
        print("python -m tritonmm.bench --mlp times GPU kernels on a CUDA GPU; none is available here. CPU tests "
              "cover the fused kernels' values (pytest tests/test_gated.py).", file=sys.stderr)
        return 2
    warm_up_gpu()
    rows = mlp.run(torch.device("cuda"), args.rounds, args.mlp_configs, args.tokens,
                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    mlp.print_report(rows)
    if args.json:
        _write_json(args, {"rows": rows})
    return 0


def first_sight_main(args) -> int:
    """``--first-sight``: first-sight tuning measured (GPU only: without one it says so and returns 2)."""
    if not torch.cuda.is_available():
        print("python -m tritonmm.bench --first-sight measures GPU kernels on a CUDA GPU; none is available here. "
              "CPU tests cover its decisions and table (pytest tests/test_first_sight.py).", file=sys.stderr)
        return 2
    from . import first_sight

    warm_up_gpu()
    result = first_sight.run(progress=lambda m: print(m, file=sys.stderr, flush=True))
    first_sight.print_report(result)
    if args.json:
        _write_json(args, result)
    return 0 if result["summary"]["all_ok"] else 1


def readme_main(args) -> int:
    """``--readme``: the README's table rewritten from the committed runs (status 2 where they cannot be read)."""
    try:
        changed = readme.update(args.readme)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"python -m tritonmm.bench: error: --readme {args.readme}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"{args.readme}: table {'rewritten' if changed else 'already current'}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.readme:
        return readme_main(args)
    if args.from_json:
        return from_json(args)
    if args.first_sight:
        return first_sight_main(args)
    if args.model:
        return model_main(args)
    if args.mlp:
        return mlp_main(args)
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
    try:
        shapes, suite_dtypes = load_suite(args.shapes or default_suite(), args.tags)
    except ValueError as exc:
        print(f"python -m tritonmm.bench: error: {exc}", file=sys.stderr)
        return 2
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
    facts = machine_facts() if args.plot or args.json else None
    if args.plot:
        plot(rows, args.plot, f"{facts.get('gpu')}, torch {facts['torch']}, triton {facts['triton']}")
    if args.json:
        _write_json(args, {"rows": rows, "summary": summary}, facts)
    if args.csv:
        write_csv(rows, args.csv)
    bad = [r for r in rows if r.get("ok") is False or r.get("kernel_ok") is False]
    if bad:
        print(f"\n{len(bad)} rows FAILED the correctness check", file=sys.stderr)
    return 1 if bad else 0

