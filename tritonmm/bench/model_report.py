"""The model benchmark's reports (:mod:`tritonmm.bench.model`): its progress lines, the terminal table and Markdown."""

from __future__ import annotations

UNFOLDED = "fuse_unfolded"  # fuse without the RMSNorm folds (norm_fold.FOLD off): eager and CUDA-graph phases, where asked


def _line(r: dict) -> str:
    nan = float("nan")
    return (f"{r['config']:14} {r['phase']:48} {r['off_ms']:>9.3f} "
            + " ".join(f"{r.get(f'{m}_ratio', nan):>6.3f}" for m in ("swap", "patch", "fuse", "control"))
            + (f"  fuse_unfolded {r[f'{UNFOLDED}_ratio']:.3f}" if f"{UNFOLDED}_ratio" in r else ""))


_HEADER = (f"{'config':14} {'phase':48} {'off ms':>9} {'swap':>6} {'patch':>6} {'fuse':>6} {'A/A':>6}  "
           "(off time / on time)")


def print_report(result: dict) -> None:
    print(_HEADER)
    for r in result["phases"]:
        print(_line(r))
    if not result["per_call"]:
        return
    print("\nper call (µs): torch call, tritonmm call (medians over rounds), cost over torch (median over pairs of "
          "rounds in opposite orders of the difference), ratio torch / (torch + cost)")
    for r in result["per_call"]:
        print(f"{r['row']:52} {r['torch']:>14} {r['torch_us']:>8.2f}  {r['tritonmm']:>16} {r['tritonmm_us']:>8.2f}  "
              f"{r['over_us']:>+6.2f}  {r['ratio']:.3f}" + (f"  [{r['weight_plan']}]" if "weight_plan" in r else ""))


def markdown(result: dict) -> str:
    """The model phases as a markdown table (`bench --from-json RUN.json --markdown`)."""
    cols = {"swap": "swap_linear", "patch": "patch_linear", "fuse": "fuse", UNFOLDED: "fuse, no RMSNorm fold",
            "control": "off again (A/A)"}
    cols = {m: t for m, t in cols.items() if m != UNFOLDED or any(f"{UNFOLDED}_ratio" in r for r in result["phases"])}
    lines = ["| model | phase | off ms | " + " | ".join(cols.values()) + " |", "|---" * (3 + len(cols)) + "|"]

    def cell(r, m):
        lo_hi = r.get(f"{m}_interval")
        return "-" if f"{m}_ratio" not in r else f"{r[f'{m}_ratio']:.3f}x" + (
            f" ({lo_hi[0]:.3f}-{lo_hi[1]:.3f})" if lo_hi else "")

    for r in result["phases"]:
        lines.append(f"| {r['config']} | {r['phase']} | {r['off_ms']:.2f} | {' | '.join(cell(r, m) for m in cols)} |")
    lines += ["", "| per call | torch µs | tritonmm µs | over |", "|---|---|---|---|"]
    for r in result["per_call"]:
        lines.append(f"| {r['row']} ({r['torch']} vs {r['tritonmm']}) | {r['torch_us']:.1f} | {r['tritonmm_us']:.1f} | "
                     f"{r['over_us']:+.2f} µs |")
    return "\n".join(lines)
