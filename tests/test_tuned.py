"""Tuned tables: choosing a winner per key, reading tables safely, and the dispatcher's use of them."""

import json

import pytest
import torch

from tritonmm import tuned
from tritonmm.shapes import plan
from tritonmm.testing import randn
from tritonmm.tune import choose, merge_measurements

A = {"BLOCK_M": 16, "BLOCK_N": 64}
B = {"BLOCK_M": 32, "BLOCK_N": 64}


def shape(M, torch_us, times):
    return {"M": M, "N": 64, "K": 64, "torch_us": torch_us,
            "configs": [{"kernel": "pointer", "config": c, "us": t} for c, t in times] +
                       [{"kernel": "pointer", "config": {"BLOCK_M": 64}, "failed": "boom"}]}


def test_choose_best_total_normalized_time():
    # A is best on the first shape by a little, B on the second by a lot: B wins overall
    group = [shape(1, 10.0, [(A, 5.0), (B, 5.5)]), shape(16, 10.0, [(A, 9.0), (B, 6.0)])]
    e = choose(group)
    assert e["backend"] == "triton" and e["config"] == B and e["triton_us"] == 6.0


def test_choose_cublas_when_any_shape_is_slower():
    group = [shape(1, 10.0, [(A, 5.0)]), shape(16, 4.0, [(A, 6.0)])]
    assert choose(group)["backend"] == "torch"


def test_choose_decides_on_the_paired_timing():
    # the sweep saw A win (5 vs 10 us); the alternating head-to-head of A against torch says torch
    lose = shape(1, 10.0, [(A, 5.0), (B, 7.0)])
    lose["paired"] = {"kernel": "pointer", "config": A, "torch_us": 8.0, "us": 8.5}
    e = choose([lose])
    assert e["backend"] == "torch" and e["config"] == A and e["triton_us"] == 8.5 and e["torch_us"] == 8.0
    win = shape(1, 4.0, [(A, 5.0)])  # and the other way round
    win["paired"] = {"kernel": "pointer", "config": A, "torch_us": 6.0, "us": 5.5}
    assert choose([win])["backend"] == "triton"
    # a pairing of another config than the group's pick is ignored
    other = shape(1, 10.0, [(A, 5.0), (B, 7.0)])
    other["paired"] = {"kernel": "pointer", "config": B, "torch_us": 1.0, "us": 9.0}
    assert choose([other])["backend"] == "triton" and choose([other])["triton_us"] == 5.0


def test_merge_keeps_one_measurement_per_problem():
    def m(M, us, layout="nn", dtype="bfloat16"):
        return {"dtype": dtype, "M": M, "N": 64, "K": 32, "layout": layout, "torch_us": us}

    old = [m(1, 1.0), m(2, 2.0), m(2, 2.5, layout="nt"), m(3, 3.0, dtype="float16")]
    new = [m(2, 9.0), m(4, 4.0)]
    got = merge_measurements(old, new)
    assert [(r["M"], r["layout"], r["dtype"], r["torch_us"]) for r in got] == [
        (1, "nn", "bfloat16", 1.0), (2, "nt", "bfloat16", 2.5), (3, "nn", "float16", 3.0),
        (2, "nn", "bfloat16", 9.0), (4, "nn", "bfloat16", 4.0)]


def test_choose_nothing_ran():
    assert choose([shape(1, 10.0, [])])["backend"] == "torch"


def test_read_table_rejects_bad_files(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"format": tuned.FORMAT, "entries": {}}))
    assert tuned.read_table(good) is not None
    for name, text in [("corrupt", "{not json"), ("truncated", '{"format": 1, "entr'),
                       ("foreign", json.dumps({"format": 99, "entries": {}})), ("list", "[1, 2]")]:
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.warns(RuntimeWarning, match="ignoring tuned table"):
            assert tuned.read_table(path) is None
    with pytest.warns(RuntimeWarning):
        assert tuned.read_table(tmp_path / "missing.json") is None


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_read_table_validates_every_named_config(tmp_path, backend):
    """An entry's config is checked also where cuBLAS won (the benchmark forces that config for its
    kernel-alone column): a malformed one rejects the table when it is read, not later."""
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 8,
           "EPILOGUE_SUBTILE": 0, "SPLIT_K": 0}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuned.FORMAT, "entries": {"bfloat16:128:64:64:nn": {
        "backend": backend, "kernel": "tma", "config": cfg, "triton_us": 1.0, "torch_us": 1.0}}}))
    with pytest.warns(RuntimeWarning, match="SPLIT_K"):
        assert tuned.read_table(path) is None
    path.write_text(path.read_text().replace('"SPLIT_K": 0', '"SPLIT_K": 2'))
    assert tuned.read_table(path) is not None


def test_lookup_gives_decisions(monkeypatch):
    a, b = randn(2048, 512, dtype=torch.bfloat16), randn(512, 1024, dtype=torch.bfloat16)
    p = plan(a, b)
    key = tuned.entry_key(torch.bfloat16, 2048, 1024, 512, "nn")
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 8,
           "EPILOGUE_SUBTILE": 0}
    table = {key: {"backend": "triton", "kernel": "tma", "config": cfg, "triton_us": 10.0, "torch_us": 12.0}}
    monkeypatch.setattr(tuned, "_table_for", lambda index: table)
    cuda = torch.device("cuda", 0)
    d = tuned.lookup(cuda, torch.bfloat16, p)
    assert (d.backend, d.kernel, d.config) == ("triton", "tma", cfg) and "1.20x" in d.reason
    table[key] = {**table[key], "backend": "torch"}
    assert tuned.lookup(cuda, torch.bfloat16, p).backend == "torch"
    assert tuned.lookup(cuda, torch.float16, p).backend == "torch"  # float16 falls back to bfloat16's entry
    assert tuned.lookup(cuda, torch.float32, p) is None  # no float32 entry
    assert tuned.lookup(cuda, torch.bfloat16, plan(randn(3, 5, 5), randn(3, 5, 5))) is None  # batched


def test_layout_tag_and_key():
    w = randn(64, 32)
    assert tuned.layout_tag(plan(randn(8, 32), w.t())) == "nt"
    assert tuned.layout_tag(plan(randn(32, 8).t(), randn(32, 64))) == "tn"
    assert tuned.entry_key(torch.bfloat16, 100, 64, 32, "nn") == "bfloat16:128:64:32:nn"
