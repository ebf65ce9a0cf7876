"""The README's "when it is faster" table, made from the committed benchmark JSON.

    python -m tritonmm.bench --readme README.md   # rewrite the table in README.md from benchmarks/*.json

The table sits between the lines :data:`BEGIN` and :data:`END` of the README; ``tests/test_bench.py``
checks that it equals what :func:`table` makes of the committed files, so it cannot drift from them.
Each row gathers rows of one file (:data:`SUITE`, :data:`MLP`, :data:`MODEL`) and shows the median and
range of their ratios (torch time / tritonmm time: > 1 when tritonmm is faster) and a verdict per row:
GPU and host times are compared with :data:`SAME`; model phases with the same phase's A/A control
(tritonmm off timed against itself), a mode being faster or slower only where the 95% intervals of
the two ratios do not overlap and the two ratios differ by more than :data:`MODEL_SAME`.
"""

from __future__ import annotations

import json
import pathlib
import statistics

from ..dispatch.decide import TRITON_MIN_SAVING_US

BEGIN = "<!-- table made by: python -m tritonmm.bench --readme README.md -->"
END = "<!-- end of table -->"
SUITE, MLP, MODEL = "h200.json", "h200_mlp.json", "h200_model.json"
SAME = (0.98, 1.02)
"""Ratios of GPU or host time inside this range read as "same": rows where both sides call the same
cuBLAS GEMM lie in it (``benchmarks/h200.json``, backend ``torch``), but for the few µs-long ones."""
MODEL_SAME = 0.01
"""Relative difference from the A/A control under which a model phase reads "same" whatever its interval:
CUDA-graph replays of identical work differ by up to about 1% with where their memory lies, with
intervals narrower than that (``benchmarks/h200_model.json``)."""


def _verdicts(marks: list[str]) -> str:
    """One verdict for a row from its points' marks ("faster", "same", "slower"), the commonest first."""
    if not marks:
        return "-"
    counts = sorted(((marks.count(m), m) for m in ("faster", "same", "slower") if m in marks), reverse=True)
    if len(counts) == 1:
        return counts[0][1]
    return ", ".join(f"{n} of {len(marks)} {m}" if i == 0 else f"{n} {m}" for i, (n, m) in enumerate(counts))


def _mark(ratio: float) -> str:
    return "faster" if ratio > SAME[1] else "slower" if ratio < SAME[0] else "same"


def _cell(ratios: list[float]) -> str:
    lo, hi = min(ratios), max(ratios)
    if f"{lo:.2f}" == f"{hi:.2f}":
        return f"{lo:.2f}x"
    return f"{statistics.median(ratios):.2f}x ({lo:.2f}-{hi:.2f})"


def _row(what: str, ratios: list[float], verdict: str | None = None) -> str:
    """A row of GPU- or host-timed ratios, each marked by :data:`SAME` unless ``verdict`` is given."""
    verdict = verdict or _verdicts([_mark(x) for x in ratios])
    return f"| {what} | {_cell(ratios) if ratios else '-'} | {verdict} |"


def _triton_now(r: dict) -> bool:
    """Whether a suite row served by a Triton kernel saved ``TRITON_MIN_SAVING_US``: the dispatcher sends such
    a GEMM to Triton today; the others go to cuBLAS."""
    return r["backend"].startswith("triton") and r["torch_us"] - r["tritonmm_us"] >= TRITON_MIN_SAVING_US


def _suite_rows(data: dict) -> list[str]:
    """Rows of the shape suite by the path the dispatcher takes; a Triton row saving less than
    ``TRITON_MIN_SAVING_US`` goes to cuBLAS now and is left out."""
    rows = data["rows"]
    padded = [r["ratio"] for r in rows if r["backend"] == "torch:padded"]
    triton = [r["ratio"] for r in rows if _triton_now(r)]
    cublas = [r["ratio"] for r in rows if r["backend"] == "torch"]
    return [
        _row("`matmul` / `linear`: large GEMMs whose K or N is not a multiple of 16 bytes", padded),
        _row("`matmul` / `linear`: GEMMs the tuned table sends to a Triton kernel", triton),
        _row("`matmul` / `linear`: every other GEMM (cuBLAS on both sides)", cublas, "same (one cuBLAS call)"),
    ]


def _per_call_rows(data: dict) -> list[str]:
    rows = [r for r in data.get("per_call", []) if r["torch"] in ("F.linear", "torch.matmul")
            and r["tritonmm"] in ("tritonmm.linear", "tritonmm.matmul")]
    ratios = [r["torch_us"] / r["tritonmm_us"] for r in rows]
    return [_row("`linear` / `matmul` called directly: host time per call", ratios)]


def _mlp_rows(data: dict) -> list[str]:
    rows = data["rows"]
    out = []
    for what, key, sel in (("forward", "fused_ratio", lambda t: t <= 16),
                           ("forward", "fused_ratio", lambda t: t > 16),
                           ("forward + backward", "train_fused_ratio", lambda t: True)):
        picked = [r for r in rows if sel(r["tokens"]) and key in r]
        if not picked:
            continue
        tokens = sorted({r["tokens"] for r in picked})
        span = f"{tokens[0]}-{tokens[-1]}" if len(tokens) > 1 else f"{tokens[0]}"
        ratios = [r[key] for r in picked]
        marks = [_mlp_mark(r, key) for r in picked]
        out.append(_row(f"`fuse`, one Llama MLP's {what}, {span} tokens", ratios, _verdicts(marks)))
    return out


def _mlp_mark(r: dict, key: str) -> str:
    """An MLP row's mark: by :data:`SAME` widened to the row's A/A control (a copy of the eager module timed as one
    more contender, 10th to 90th percentile of its per-round ratio) where the run has one."""
    again = key.replace("fused_ratio", "again")
    lo, hi = min(SAME[0], r.get(f"{again}_low", 1.0)), max(SAME[1], r.get(f"{again}_high", 1.0))
    return "faster" if r[key] > hi else "slower" if r[key] < lo else "same"


def _phase_mark(p: dict, mode: str) -> str:
    """A model phase's mark for ``mode`` against the phase's A/A control, by their 95% intervals."""
    if "control_ratio" not in p:  # a run without the A/A control
        return _mark(p[f"{mode}_ratio"])
    ratio, control = p[f"{mode}_ratio"], p["control_ratio"]
    lo, hi = p.get(f"{mode}_interval") or (ratio, ratio)
    c_lo, c_hi = p.get("control_interval") or (control, control)
    if lo > c_hi and ratio > control * (1 + MODEL_SAME):
        return "faster"
    return "slower" if hi < c_lo and ratio < control * (1 - MODEL_SAME) else "same"


def _model_rows(data: dict) -> list[str]:
    phases = data["phases"]
    out = []
    for what, modes, sel in (
            ("`swap_linear` / `patch_linear` in a Llama model, every phase", ("swap", "patch"), lambda ph: True),
            ("`fuse` in a Llama model: CUDA-graph replay", ("fuse",), lambda ph: ph.startswith("cuda-graph")),
            ("`fuse` in a Llama model: eager, training step, `torch.compile`", ("fuse",),
             lambda ph: not ph.startswith("cuda-graph"))):
        picked = [(p, m) for p in phases if sel(p["phase"]) for m in modes if f"{m}_ratio" in p]
        if not picked:
            continue
        ratios = [p[f"{m}_ratio"] for p, m in picked]
        control = sorted({p["control_ratio"] for p, _ in picked if "control_ratio" in p})
        aa = f"; A/A {control[0]:.2f}-{control[-1]:.2f}" if control else ""
        out.append(f"| {what} | {_cell(ratios)}{aa} | {_verdicts([_phase_mark(p, m) for p, m in picked])} |")
    return out


def _versions(*runs: dict) -> str:
    """The GPUs and versions the runs were measured on, once each."""
    seen = []
    for run in runs:
        m = run.get("machine") or {}
        v = f"{m.get('gpu', '?').replace('NVIDIA ', '')}, torch {str(m.get('torch', '?')).split('+')[0]}, " \
            f"triton {m.get('triton', '?')}"
        if v not in seen:
            seen.append(v)
    return "; ".join(seen)


def table(bench_dir: pathlib.Path) -> str:
    """The README's table (with its caption) from the runs in ``bench_dir``.

    Raises:
        OSError, ValueError, KeyError: a run is missing or is not one of ``python -m tritonmm.bench``.
    """
    suite, mlp, model = (json.loads((bench_dir / name).read_text()) for name in (SUITE, MLP, MODEL))
    gone = sum(r["backend"].startswith("triton") and not _triton_now(r) for r in suite["rows"])
    lines = [f"Measured on {_versions(suite, mlp, model)}, bf16 unless noted (`benchmarks/{SUITE}` adds float16 "
             f"and float32; `{MLP}`, `{MODEL}`). Speed-up: torch time / tritonmm time, the median and range "
             f"over that file's rows; times within {SAME[0]:.2f}-{SAME[1]:.2f}x count as the same, MLP rows "
             "and model phases within their A/A control too (torch timed against itself)."
             + (f" Left out: {gone} suite rows a Triton kernel served when measured, which go to cuBLAS now."
                if gone else ""),
             "",
             "| use | speed-up | verdict |",
             "|---|---|---|"]
    lines += _suite_rows(suite) + _per_call_rows(model) + _mlp_rows(mlp) + _model_rows(model)
    return "\n".join(lines)


def update(readme: pathlib.Path, bench_dir: pathlib.Path | None = None) -> bool:
    """Rewrite the table between :data:`BEGIN` and :data:`END` in ``readme`` from ``bench_dir`` (default: the
    ``benchmarks`` folder beside it). Returns whether the file changed.

    Raises:
        ValueError: the README lacks the two marker lines, in order.
    """
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{readme}: no table between the lines {BEGIN!r} and {END!r}")
    new = text[:start + len(BEGIN)] + "\n" + table(bench_dir or readme.parent / "benchmarks") + "\n" + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text
