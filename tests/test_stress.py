"""The soak script itself: runs, reports, and fails when results are wrong."""

import json

import torch

import tritonmm
from tritonmm import stress


def test_stress_runs_clean(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")  # what main() would set; restored after the test
    out = tmp_path / "s.json"
    assert stress.main(["--calls", "24", "--geometries", "6", "--max-dim", "40", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["calls"] == 24 and summary["mismatches"] == 0 and summary["errors"] == 0
    assert sum(summary["paths"].values()) == 24


def test_stress_reports_wrong_results(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")
    real = tritonmm.matmul
    monkeypatch.setattr(tritonmm, "matmul", lambda a, b: real(a, b) * (1 + 2**-6))  # a 1.6% error
    out = tmp_path / "s.json"
    assert stress.main(["--calls", "12", "--geometries", "4", "--max-dim", "40", "--seed", "5",
                        "--json", str(out)]) == 1
    assert json.loads(out.read_text())["mismatches"] > 0


def test_stress_geometries_cover_the_space():
    import random

    rng = random.Random(0)
    pool = [stress.make_geometry(rng, 64, gpu=True) for _ in range(300)]
    assert {g["op"] for g in pool} == {"matmul", "linear"}
    assert {g["dtype"] for g in pool} == {"bfloat16", "float16", "float32"}
    assert {g["kernel"] for g in pool} >= {"tma", "pointer", "splitk"}
    assert any(g["batch_b"] for g in pool) and any(g["vec"] for g in pool) and any(g["slice"] for g in pool)
    case = stress.make_case(pool[0], torch.device("cpu"), torch.Generator().manual_seed(0))
    assert case["a"].dtype == getattr(torch, pool[0]["dtype"])
