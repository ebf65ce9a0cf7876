"""Candidate configs as data, pruning, buckets, the configs/ lookup and lean import."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tritonmm.kernels import configs as cfg

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_candidates_are_data_and_complete():
    for kernel in cfg.KERNELS:
        rows = cfg.candidates(kernel)
        assert rows, kernel
        for row in rows:
            assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_stages", "num_warps"} <= row.keys()
            assert all(row[k] >= 16 and row[k] & (row[k] - 1) == 0 for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        assert cfg.interpreter_config(kernel)["BLOCK_M"] >= 16


def test_to_triton_round_trip():
    row = cfg.candidates("tma")[0]
    assert cfg.from_triton(cfg.to_triton(row)) == row


@pytest.mark.parametrize("x,b", [(0, 16), (1, 16), (16, 16), (17, 32), (4095, 4096), (4096, 4096), (4097, 8192)])
def test_bucket(x, b):
    assert cfg.bucket(x) == b


def test_prune_shared_memory_and_tile_size():
    rows = cfg.candidates("pointer")
    kept = cfg.prune(rows, M=4096, N=4096, K=4096, itemsize=2, out_itemsize=2, kernel="pointer",
                     smem_limit=100_000, num_sms=132)
    assert kept and all(cfg.smem_bytes(r, 2, 2, "pointer") <= 100_000 for r in kept)
    assert len(kept) < len(rows)
    small = cfg.prune(rows, M=1, N=4096, K=4096, itemsize=2, out_itemsize=2, kernel="pointer",
                      smem_limit=232448, num_sms=132)
    assert small and all(r["BLOCK_M"] <= 32 for r in small)  # no 128-row tiles for one row of output
    # nothing fits: the smallest config is kept rather than none
    assert len(cfg.prune(rows, M=64, N=64, K=64, itemsize=4, out_itemsize=4, kernel="pointer",
                         smem_limit=1, num_sms=132)) == 1


def test_wave_quantization_ranking():
    # 2304 x 1536 on 132 SMs: 128x128 tiles make 216 tiles = 1.64 waves; efficiency below 128x256's
    eff = cfg.wave_efficiency(2304, 1536, {"BLOCK_M": 128, "BLOCK_N": 128}, 132)
    assert 0 < eff < 1
    assert cfg.wave_efficiency(132 * 128, 128, {"BLOCK_M": 128, "BLOCK_N": 128}, 132) == 1.0


def test_config_dir_env_override(tmp_path, monkeypatch):
    (tmp_path / "candidates.json").write_text((REPO / "configs" / "candidates.json").read_text())
    monkeypatch.setenv("TRITONMM_CONFIG_DIR", str(tmp_path))
    assert cfg.config_dir() == tmp_path
    monkeypatch.setenv("TRITONMM_CONFIG_DIR", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="TRITONMM_CONFIG_DIR"):
        cfg.config_dir()


def test_shipped_suite_matches_public_one():
    shipped = json.loads((REPO / "configs" / "shapes.json").read_text())
    assert {s["tag"].split("-")[0] for s in shipped["shapes"]} >= {"square", "llama8b", "odd", "wave", "tile"}


def test_import_is_lean():
    """import tritonmm: no CUDA initialisation, no Triton import, no file read."""
    code = (
        "import sys, torch, tritonmm\n"
        "from tritonmm.kernels import configs\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert configs._candidates_file.cache_info().currsize == 0, 'configs read'\n"
        "print('lean')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0 and "lean" in out.stdout, out.stderr
