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


def test_tma_split_k_field_is_optional_and_checked():
    """A tma config may leave SPLIT_K out (tables from before split-K): it means one split."""
    old = {k: v for k, v in cfg.candidates("tma")[0].items() if k != "SPLIT_K"}
    cfg.validate("tma", old)
    assert cfg.complete("tma", old)["SPLIT_K"] == 1
    cfg.validate("tma", {**old, "SPLIT_K": 4})
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="SPLIT_K"):
            cfg.validate("tma", {**old, "SPLIT_K": bad})
    with pytest.raises(ValueError, match="fields"):  # only SPLIT_K is optional
        cfg.validate("tma", {k: v for k, v in old.items() if k != "EPILOGUE_SUBTILE"})
    with pytest.raises(ValueError, match="SPLIT_K"):  # the pointer split-K kernel still needs >= 2 splits
        cfg.validate("splitk", {**cfg.candidates("splitk")[0], "SPLIT_K": 1})


@pytest.mark.parametrize("M,N,K,split", [(128, 4096, 4096, True), (64, 6144, 4096, True), (128, 128256, 4096, False),
                                         (2048, 4096, 4096, False), (300, 512, 4096, False), (128, 4096, 64, False),
                                         (16, 4096, 14336, False)])
def test_prune_keeps_tma_split_k_only_for_few_tiles(M, N, K, split):
    """Split-K TMA configs are kept for M <= 256 with fewer unsplit tiles than SMs (a weight streamed
    by few tiles) and K of at least one BLOCK_K per split; elsewhere they would only add partial-sum
    traffic. Unsplit configs stay. (M = 16: every TMA tile is 4x too tall; the pointer split-K kernel
    serves decode.)"""
    rows = cfg.candidates("tma")
    kept = cfg.prune(rows, M=M, N=N, K=K, itemsize=2, out_itemsize=2, kernel="tma", smem_limit=232448,
                     num_sms=132, keep=len(rows))
    splits = [r for r in kept if r["SPLIT_K"] > 1]
    assert bool(splits) == split
    for r in splits:
        assert -(-M // r["BLOCK_M"]) * -(-N // r["BLOCK_N"]) < 132 and K >= r["SPLIT_K"] * r["BLOCK_K"]
    assert any(r["SPLIT_K"] == 1 for r in kept)


def _busy_slices(K, cfg, kernel):
    """Slices with work, by walking the kernels' own K loops (tritonmm/kernels/pointer.py, tma.py)."""
    s, bk = cfg["SPLIT_K"], cfg["BLOCK_K"]
    if kernel == "tma":  # K steps split*per .. min(split*per + per, k_tiles)
        k_tiles = -(-K // bk)
        per = -(-k_tiles // s)
        return sum(len(range(i * per, min(i * per + per, k_tiles))) > 0 for i in range(s))
    per = -(-(-(-K // s)) // bk) * bk  # pointer kernel: k_per_split elements, k_len = min(K - start, per)
    return sum(min(K - i * per, per) > 0 for i in range(s))


@pytest.mark.parametrize("kernel", ["splitk", "tma"])
def test_split_configs_keep_every_slice_busy(kernel):
    """Pruning drops a split-K config when one of its K slices would be empty (it would still store and
    sum a zero partial); the rule agrees with walking the kernels' K loops."""
    rows = [r for r in cfg.candidates(kernel) if r["SPLIT_K"] > 1]
    for K in (64, 100, 200, 256, 320, 1000, 1023, 4096, 14336):
        for r in rows:
            assert cfg.splits_all_busy(K, r, kernel) == (_busy_slices(K, r, kernel) == r["SPLIT_K"]), (K, r)
        if not any(cfg.splits_all_busy(K, r, kernel) for r in rows):
            continue  # K too short for any split: pruning falls back to the smallest config
        kept = cfg.prune(cfg.candidates(kernel), M=128, N=1024, K=K, itemsize=2, out_itemsize=2, kernel=kernel,
                         smem_limit=232448, num_sms=132, keep=100)
        assert all(_busy_slices(K, r, kernel) == r["SPLIT_K"] for r in kept if r["SPLIT_K"] > 1)
    assert not cfg.splits_all_busy(320, {"BLOCK_K": 64, "SPLIT_K": 4}, "tma")  # slices of 2, 2, 1 and 0 steps


def test_split_pool_key_separates_shapes_of_one_bucket():
    """K = 130 and 256 share a bucket, but 4 splits of BLOCK_K 64 only fit 256 (130 is 3 steps): the
    autotune key holds the pruned pool's split configs, so a config tuned for one is never run with the
    other's workspace."""
    from tritonmm.kernels import launch as km

    def pool(K):
        return cfg.prune(cfg.candidates("tma"), M=128, N=4096, K=K, itemsize=2, out_itemsize=2, kernel="tma",
                         smem_limit=232448, num_sms=132)

    assert cfg.bucket(130) == cfg.bucket(256)
    assert max(r["SPLIT_K"] for r in pool(256)) > max(r["SPLIT_K"] for r in pool(130))
    assert cfg.split_pool_key("tma", pool(130)) != cfg.split_pool_key("tma", pool(256))
    assert cfg.split_pool_key("tma", pool(4096)) != 0 and cfg.split_pool_key("tma", cfg.candidates("pointer")) == 0
    assert "SPLIT_POOL" in km.autotuned("tma").keys


def test_old_candidates_file_without_tma_split_k(tmp_path, monkeypatch):
    """A candidates.json from before split-K (7-field tma rows) still works: its rows mean one split."""
    data = json.loads((REPO / "configs" / "candidates.json").read_text())
    tma = data["tma"]
    i = tma["fields"].index("SPLIT_K")
    tma["fields"].pop(i)
    tma["configs"] = [row[:i] + row[i + 1:] for row in tma["configs"] if row[i] == 1]
    del data["interpreter"]["tma"]["SPLIT_K"]
    (tmp_path / "candidates.json").write_text(json.dumps(data))
    monkeypatch.setenv("TRITONMM_CONFIG_DIR", str(tmp_path))
    cfg._candidates_file.cache_clear()
    try:
        rows = cfg.candidates("tma")
        assert rows and all(r["SPLIT_K"] == 1 for r in rows)
        assert cfg.interpreter_config("tma")["SPLIT_K"] == 1
        import torch

        pick = cfg.heuristic("tma", 128, 4096, 4096, 2, 2, None, 4)
        assert pick["SPLIT_K"] == 1 and pick in rows
    finally:
        cfg._candidates_file.cache_clear()


@pytest.mark.parametrize("change", ["BLOCK_M=-32", "BLOCK_K=0", "BLOCK_M='32'", "BLOCK_M=24", "no interpreter",
                                    "a list", "corrupt", "short row"])
def test_a_candidate_list_that_cannot_launch_is_refused_with_its_name(tmp_path, monkeypatch, change):
    """A config directory's candidates.json is checked when read: a value Triton cannot launch (or one that launches
    a wrong kernel: a negative block size) raises ValueError naming the file, never a wrong result."""
    data = json.loads((REPO / "configs" / "candidates.json").read_text())
    if "=" in change:
        field, value = change.split("=")
        data["interpreter"]["pointer"][field] = eval(value)
    elif change == "no interpreter":
        del data["interpreter"]
    elif change == "short row":
        data["tma"]["configs"][0].pop()
    text = "[]" if change == "a list" else "{bad" if change == "corrupt" else json.dumps(data)
    (tmp_path / "candidates.json").write_text(text)
    monkeypatch.setenv("TRITONMM_CONFIG_DIR", str(tmp_path))
    cfg.clear()
    try:
        with pytest.raises(ValueError, match="candidates.json is not a valid candidate list"):
            cfg.candidates("pointer")
    finally:
        monkeypatch.delenv("TRITONMM_CONFIG_DIR")
        cfg.clear()
    assert cfg.candidates("pointer")


def test_clear_cache_reads_a_new_config_dir(tmp_path, monkeypatch):
    """README: a new config directory takes effect after ``tritonmm.clear_cache()``."""
    import tritonmm

    data = json.loads((REPO / "configs" / "candidates.json").read_text())
    shipped = data["interpreter"]["pointer"]["BLOCK_M"]
    data["interpreter"]["pointer"]["BLOCK_M"] = shipped // 2
    (tmp_path / "candidates.json").write_text(json.dumps(data))
    assert cfg.interpreter_config("pointer")["BLOCK_M"] == shipped
    monkeypatch.setenv("TRITONMM_CONFIG_DIR", str(tmp_path))
    try:
        tritonmm.clear_cache()
        assert cfg.interpreter_config("pointer")["BLOCK_M"] == shipped // 2
    finally:
        monkeypatch.delenv("TRITONMM_CONFIG_DIR")
        tritonmm.clear_cache()
    assert cfg.interpreter_config("pointer")["BLOCK_M"] == shipped


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
