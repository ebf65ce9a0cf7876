"""The README, benchmarks/README.md, docs/design.md and the CHANGELOG: the README's table is made from the
committed runs, the documents stay short and name only files that exist."""

import pathlib
import re
import shutil

import pytest

import tritonmm
from tritonmm import bench
from tritonmm.bench import readme

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _table_in(text: str) -> str:
    return text[text.index(readme.BEGIN) + len(readme.BEGIN):text.index(readme.END)].strip()


def test_readme_table_is_made_from_the_committed_runs():
    """``python -m tritonmm.bench --readme README.md`` would leave the README as it is."""
    assert _table_in((ROOT / "README.md").read_text()) == readme.table(BENCH)


def test_readme_option_rewrites_the_table(tmp_path, capsys):
    shutil.copytree(BENCH, tmp_path / "benchmarks", ignore=shutil.ignore_patterns("*.png", "diagnostics"))
    doc = tmp_path / "README.md"
    doc.write_text(f"# x\n\n{readme.BEGIN}\nstale\n{readme.END}\n\nafter\n")
    assert bench.main(["--readme", str(doc)]) == 0
    assert "rewritten" in capsys.readouterr().out
    text = doc.read_text()
    assert _table_in(text) == readme.table(BENCH) and text.startswith("# x\n\n") and text.endswith("\n\nafter\n")
    assert bench.main(["--readme", str(doc)]) == 0
    assert "already current" in capsys.readouterr().out and doc.read_text() == text
    doc.write_text("# no markers\n")
    assert bench.main(["--readme", str(doc)]) == 2
    assert "no table between" in capsys.readouterr().err


def test_readme_table_marks_rows_against_their_spread():
    """GPU-timed ratios within ``SAME`` read as the same; a model phase is faster or slower only where its
    interval and its A/A control's do not overlap and the two differ by more than ``MODEL_SAME``."""
    assert [readme._mark(x) for x in (0.97, 0.99, 1.01, 1.03)] == ["slower", "same", "same", "faster"]
    phase = {"fuse_ratio": 1.05, "fuse_interval": [1.04, 1.06], "control_ratio": 1.0, "control_interval": [0.99, 1.01]}
    assert readme._phase_mark(phase, "fuse") == "faster"
    assert readme._phase_mark({**phase, "fuse_ratio": 1.005, "fuse_interval": [1.0045, 1.006],
                               "control_interval": [0.999, 1.001]}, "fuse") == "same"  # apart, but under 1%
    assert readme._phase_mark({**phase, "fuse_interval": [0.98, 1.06]}, "fuse") == "same"
    assert readme._phase_mark({**phase, "fuse_ratio": 0.95, "fuse_interval": [0.94, 0.96]}, "fuse") == "slower"
    row = {"fused_ratio": 0.96, "again_low": 0.9, "again_high": 1.1, "train_fused_ratio": 1.03}
    assert readme._mlp_mark(row, "fused_ratio") == "same"  # inside its A/A control's spread
    assert readme._mlp_mark({**row, "fused_ratio": 1.12}, "fused_ratio") == "faster"
    assert readme._mlp_mark(row, "train_fused_ratio") == "faster"  # no A/A control: SAME alone
    assert readme._mlp_mark({**row, "train_fused_ratio": 1.01, "train_again_low": 0.9}, "train_fused_ratio") == "same"
    assert readme._verdicts(["same", "faster", "same"]) == "2 of 3 same, 1 faster"
    assert readme._verdicts(["faster", "faster"]) == "faster"


def test_readme_is_short_with_install_and_quick_start_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:40])
    assert "when not to use it" in head and "pip install" in head
    assert re.search(r"```python\n(.*\n)*.*tritonmm\.fuse\(model\)(.*\n)*```", head)


def test_benchmarks_hold_the_product_runs_and_a_short_readme():
    """At most 15 entries at the top of benchmarks/, each named in its README of at most 60 lines, as is every
    diagnostic in benchmarks/diagnostics/."""
    text = (BENCH / "README.md").read_text()
    assert len(text.splitlines()) <= 60
    top = sorted(p.name for p in BENCH.iterdir() if not p.name.startswith((".", "__")))
    assert len(top) <= 15, top
    unnamed = [n for n in top if n not in ("README.md", "diagnostics") and f"`{n}`" not in text]
    unnamed += [p.name for p in (BENCH / "diagnostics").iterdir()
                if not p.name.startswith((".", "__")) and f"`{p.stem}" not in text]
    assert not unnamed, unnamed


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "benchmarks/README.md"])
def test_documents_name_only_files_that_exist(doc):
    """Paths from the repository root; in benchmarks/README.md also bare file names, in benchmarks/ or its
    diagnostics/."""
    text = (ROOT / doc).read_text()
    missing = [n for n in re.findall(r"((?:benchmarks|configs|docs|examples|tests)/[\w./]*\w)", text)
               if not (ROOT / n).exists()]
    if doc == "benchmarks/README.md":
        missing += [n for n in re.findall(r"`(h200[\w.]*\.(?:json|png|py|sh))`", text)
                    if not (BENCH / n).exists() and not (BENCH / "diagnostics" / n).exists()]
    assert not missing, missing


def test_changelog_has_the_release_of_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    heads = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert heads[0] == ("Unreleased", "") and heads[1][0] == tritonmm.__version__ and heads[1][1]
    assert f'version = "{tritonmm.__version__}"' in (ROOT / "pyproject.toml").read_text()
    release = text.split(f"## [{tritonmm.__version__}]")[1].split("\n## [")[0]
    long = [line for line in release.splitlines() if len(line) > 170]
    assert not long, long
