"""Tuned tables: choosing a winner per key, reading tables safely, and the dispatcher's use of them."""

import json

import pytest
import torch

from tritonmm.core import layout
from tritonmm.core.reference import randn
from tritonmm.core.shapes import plan
from tritonmm.dispatch import decide, tables, tuned
from tritonmm.dispatch.tuned import choose
from tritonmm.tune.measure import merge_measurements

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
    good.write_text(json.dumps({"format": tables.FORMAT, "entries": {}}))
    assert tables.read_table(good) is not None
    for name, text in [("corrupt", "{not json"), ("truncated", '{"format": 1, "entr'),
                       ("foreign", json.dumps({"format": 99, "entries": {}})), ("list", "[1, 2]")]:
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.warns(RuntimeWarning, match="ignoring tuned table"):
            assert tables.read_table(path) is None
    with pytest.warns(RuntimeWarning):
        assert tables.read_table(tmp_path / "missing.json") is None


@pytest.mark.parametrize("key, entry", [
    ("bfloat16:16:64:nt", {}), ("bfloat16:x:64:64:nt", {}), ("bfloat16:0:64:64:nt", {}),
    ("int8:16:64:64:nt", {}), ("bfloat16:16:64:64:xx", {}),
    ("bfloat16:16:64:64:nt", {"torch_us": None}), ("bfloat16:16:64:64:nt", {"torch_us": "5"}),
    ("bfloat16:16:64:64:nt", {"torch_us": True}), ("bfloat16:16:64:64:nt", {"torch_us": 10 ** 400}),
    ("bfloat16:16:64:64:nt", {"torch_us": float("nan")}), ("bfloat16:16:64:64:nt", {"torch_us": -1.0}),
    ("bfloat16:16:64:64:nt", {"triton_us": float("inf")}),
])
def test_read_table_rejects_entries_the_dispatcher_could_not_read(tmp_path, key, entry):
    """Keys and cuBLAS times are read on the dispatcher's path (``weight_used``, ``_table_decision``): a
    table holding a malformed one is refused when read, never failing a call later."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tables.FORMAT, "entries": {key: {
        "backend": "torch", "kernel": None, "config": None, "torch_us": 5.0, **entry}}}))
    with pytest.warns(RuntimeWarning, match="ignoring tuned table"):
        assert tables.read_table(path) is None


def test_read_table_refuses_a_triton_entry_without_its_time_and_deep_json(tmp_path):
    """A Triton entry's own time is read when a call is decided (the first-sight margin, the saving), and a deeply
    nested file exhausts the JSON parser's recursion: both are refused when read, the table's writer moves the
    second aside."""
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 4}
    path = tmp_path / "t.json"
    entry = {"backend": "triton", "kernel": "pointer", "config": cfg, "torch_us": 100.0, "first_sight_s": 0.2}
    for triton_us in (None, 10 ** 400):
        path.write_text(json.dumps({"format": tables.FORMAT, "entries": {"bfloat16:4096:4096:4096:nn": {
            **entry, "triton_us": triton_us}}}))
        with pytest.warns(RuntimeWarning, match="triton_us is not a number"):
            assert tables.read_table(path) is None
    path.write_text("[" * 100000)
    with pytest.warns(RuntimeWarning, match="ignoring tuned table"):
        assert tables.read_table(path) is None
    sig = {"capability": [9, 0], "sms": 132, "triton": "3.6.0"}
    with pytest.warns(RuntimeWarning, match="moved tuned table"):
        tables.merge_entries(path, sig, "H200", {"bfloat16:64:64:64:nn": {
            "backend": "torch", "kernel": None, "config": None, "torch_us": 5.0}})
    assert list(tables.read_table(path)["entries"]) == ["bfloat16:64:64:64:nn"]
    assert (tmp_path / "t.json.bad").read_text() == "[" * 100000


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_read_table_validates_every_named_config(tmp_path, backend):
    """An entry's config is checked also where cuBLAS won (the benchmark forces that config for its
    kernel-alone column): a malformed one rejects the table when it is read, not later."""
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 8,
           "EPILOGUE_SUBTILE": 0, "SPLIT_K": 0}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tables.FORMAT, "entries": {"bfloat16:128:64:64:nn": {
        "backend": backend, "kernel": "tma", "config": cfg, "triton_us": 1.0, "torch_us": 1.0}}}))
    with pytest.warns(RuntimeWarning, match="SPLIT_K"):
        assert tables.read_table(path) is None
    path.write_text(path.read_text().replace('"SPLIT_K": 0', '"SPLIT_K": 2'))
    assert tables.read_table(path) is not None


def test_lookup_gives_decisions(monkeypatch):
    a, b = randn(2048, 512, dtype=torch.bfloat16), randn(512, 1024, dtype=torch.bfloat16)
    p = plan(a, b)
    key = tuned.entry_key(torch.bfloat16, 2048, 1024, 512, "nn")
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 8,
           "EPILOGUE_SUBTILE": 0}
    table = {key: {"backend": "triton", "kernel": "tma", "config": cfg, "triton_us": 50.0, "torch_us": 75.0}}
    monkeypatch.setattr(tuned, "_table_for", lambda index: table)
    cuda = torch.device("cuda", 0)
    d = decide._from_table(cuda, torch.bfloat16, p)
    assert (d.backend, d.kernel, d.config) == ("triton", "tma", cfg) and "1.50x" in d.reason
    table[key] = {**table[key], "backend": "torch"}
    d = decide._from_table(cuda, torch.bfloat16, p)
    assert d.backend == "torch" and "cuBLAS kept (Triton measured 1.50x" in d.reason  # a gain inside the margin
    table[key] = {**table[key], "triton_us": 93.75}
    assert "cuBLAS measured faster (Triton 0.80x)" in decide._from_table(cuda, torch.bfloat16, p).reason
    assert decide._from_table(cuda, torch.float16, p).backend == "torch"  # float16 falls back to bfloat16's entry
    assert decide._from_table(cuda, torch.float32, p) is None  # no float32 entry
    assert decide._from_table(cuda, torch.bfloat16, plan(randn(3, 5, 5), randn(3, 5, 5))) is None  # batched


def test_triton_winner_must_save_more_than_a_launch_costs(monkeypatch):
    """A Triton entry that saves less GPU time than decide.TRITON_MIN_SAVING_US goes to cuBLAS, in the
    decision and in the fast path's everywhere-torch test alike."""
    a, b = randn(16, 512, dtype=torch.bfloat16), randn(512, 1024, dtype=torch.bfloat16)
    key = tuned.entry_key(torch.bfloat16, 16, 1024, 512, "nn")
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_stages": 4, "num_warps": 4}
    margin = decide.TRITON_MIN_SAVING_US
    table = {key: {"backend": "triton", "kernel": "pointer", "config": cfg, "triton_us": 10.0,
                   "torch_us": 10.0 + margin / 2}}
    monkeypatch.setattr(tuned, "_table_for", lambda index: table)
    cuda = torch.device("cuda", 0)
    d = decide._from_table(cuda, torch.bfloat16, plan(a, b))
    assert d.backend == "torch" and "saving less GPU time" in d.reason
    assert not tuned.has_kernel(cuda, torch.bfloat16, 16, 1024, 512, margin)
    table[key]["torch_us"] = 10.0 + 2 * margin
    assert decide._from_table(cuda, torch.bfloat16, plan(a, b)).backend == "triton"
    assert tuned.has_kernel(cuda, torch.bfloat16, 16, 1024, 512, margin)
    assert tuned.has_kernel(cuda, torch.bfloat16, 16, 1024, 512, margin)  # any layout: B as a weight too
    assert not tuned.has_kernel(cuda, torch.bfloat16, 32, 1024, 512, margin)  # another M bucket


def test_layout_tag_and_key():
    w = randn(64, 32)
    assert layout.tag(plan(randn(8, 32), w.t())) == "nt"
    assert layout.tag(plan(randn(32, 8).t(), randn(32, 64))) == "tn"
    assert tuned.entry_key(torch.bfloat16, 100, 64, 32, "nn") == "bfloat16:128:64:32:nn"


def test_m_equal_1_has_its_own_key_and_falls_back_to_the_bucket(monkeypatch):
    """M = 1 (GEMV) is tuned apart from M = 2-16; a table without an M = 1 entry (written before M = 1
    had its own key) serves it from the M <= 16 bucket; own dtype before sibling at each M key."""
    assert tuned.entry_key(torch.bfloat16, 1, 64, 32, "nn") == "bfloat16:1:64:32:nn"
    assert tuned.entry_key(torch.bfloat16, 2, 64, 32, "nn") == "bfloat16:16:64:32:nn"
    assert tuned.entry_key(torch.bfloat16, 16, 64, 32, "nn") == "bfloat16:16:64:32:nn"
    assert tuned.lookup_keys(torch.float16, 1, 64, 32, "nt") == [
        "float16:1:64:32:nt", "bfloat16:1:64:32:nt", "float16:16:64:32:nt", "bfloat16:16:64:32:nt"]
    assert tuned.lookup_keys(torch.float32, 5, 64, 32, "nn") == ["float32:16:64:32:nn"]
    cuda = torch.device("cuda", 0)
    gemv, small = plan(randn(1, 32), randn(32, 64)), plan(randn(16, 32), randn(32, 64))
    table = {"bfloat16:16:64:32:nn": {"backend": "torch", "kernel": None, "config": None, "torch_us": 1.0}}
    monkeypatch.setattr(tuned, "_table_for", lambda index: table)
    assert tuned.entry(cuda, torch.bfloat16, gemv) is table["bfloat16:16:64:32:nn"]
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_stages": 4, "num_warps": 4, "SPLIT_K": 2}
    table["bfloat16:1:64:32:nn"] = {"backend": "triton", "kernel": "splitk", "config": cfg, "triton_us": 10.0,
                                    "torch_us": 40.0}
    assert decide._from_table(cuda, torch.float16, gemv).kernel == "splitk"  # M = 1 entry, sibling dtype
    assert decide._from_table(cuda, torch.bfloat16, small).backend == "torch"  # M = 16 keeps the bucket entry
    table["float16:16:64:32:nn"] = {"backend": "torch", "kernel": None, "config": None, "torch_us": 1.0}
    assert decide._from_table(cuda, torch.float16, gemv).kernel == "splitk"  # M = 1 key before the dtype's bucket


def test_choose_needs_the_min_gain_on_every_shape():
    group = [shape(1, 10.0, [(A, 9.95)]), shape(16, 10.0, [(A, 5.0)])]  # 1.005x and 2x
    assert choose(group)["backend"] == "triton"
    assert choose(group, min_gain=1.01)["backend"] == "torch"
    assert choose([shape(16, 10.0, [(A, 5.0)])], min_gain=1.99)["backend"] == "triton"
    padded = {"M": 300, "N": 302, "K": 301, "torch_us": 10.0, "configs": [{"kernel": "padded", "config": None, "us": 9.9}]}
    assert choose([padded])["kernel"] == "padded" and choose([padded], min_gain=1.02)["kernel"] is None


def test_redecide_rewrites_entries_from_stored_measurements(tmp_path, capsys):
    from tritonmm.tune.cli import main

    def record(M, torch_us, us):
        r = shape(M, torch_us, [(A, us)])
        return {**r, "dtype": "bfloat16", "layout": "nn", "N": 64, "K": 64,
                "configs": [{**c, "config": {**c["config"], "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3,
                                             "num_warps": 4}} for c in r["configs"][:1]]}

    measured = [record(1, 10.0, 9.0), record(16, 10.0, 9.9), record(100, 10.0, 5.0)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tables.FORMAT, "entries": {}, "measurements": measured}))
    assert main(["--redecide", "--min-gain", "1.05", "--out", str(path)]) == 0
    entries = json.loads(path.read_text())["entries"]
    assert {k: e["backend"] for k, e in entries.items()} == {
        "bfloat16:1:64:64:nn": "triton", "bfloat16:16:64:64:nn": "torch", "bfloat16:128:64:64:nn": "triton"}
    assert tables.read_table(path) is not None  # still a valid table
    assert main(["--redecide", "--min-gain", "2.5", "--out", str(path)]) == 0
    assert all(e["backend"] == "torch" for e in json.loads(path.read_text())["entries"].values())
    assert main(["--redecide", "--out", str(tmp_path)]) == 2  # a directory is not a table
    assert main(["--redecide", "--out", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "typo" / "dir" / "t.json", tmp_path / "afile" / "t.json"):  # nothing made, a message
        assert main(["--redecide", "--out", str(out)]) == 2 and not (tmp_path / "typo").exists()
    written = path.read_text()
    one = {**measured[0], "M": 300}  # a key of its own
    bad = [{**one, "configs": [{**one["configs"][0], "config": {**one["configs"][0]["config"], "BLOCK_M": 48}}]},
           {**one, "dtype": "float64"}, {**one, "configs": [{**one["configs"][0], "us": "5"}]},
           {k: v for k, v in one.items() if k != "configs"}, 1]  # (BLOCK_M 48 cannot launch)
    for record_ in bad:  # refused with a message and nothing written, never a table its reader then ignores
        table = json.loads(written)
        path.write_text(json.dumps({**table, "measurements": table["measurements"] + [record_]}))
        before = path.read_text()
        capsys.readouterr()
        assert main(["--redecide", "--out", str(path)]) == 2
        assert "nothing written" in capsys.readouterr().err and path.read_text() == before


def test_redecide_takes_the_table_lock(tmp_path, monkeypatch):
    """Entries that first-sight tuning merges in another process while a table is re-decided are not lost: both
    hold the table's lock while they read and write it."""
    from tritonmm.tune.cli import main

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tables.FORMAT, "entries": {}, "measurements": [
        {**shape(16, 10.0, [({**A, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 4}, 5.0)]),
         "dtype": "bfloat16", "layout": "nn"}]}))
    held = []
    real = tables.locked

    def locked(p):
        held.append(p)
        return real(p)

    monkeypatch.setattr(tables, "locked", locked)
    read = tables.read_table

    def read_table(p):  # the read happens under the lock
        assert held == [path]
        return read(p)

    monkeypatch.setattr(tables, "read_table", read_table)
    assert main(["--redecide", "--out", str(path)]) == 0
    assert held == [path]


def test_choose_breaks_ties_by_measurement_order():
    """do_bench medians step in 32 ns, so two configs can tie: the first measured wins (the one
    measure_shape pairs against torch.matmul), whatever the hash seed."""
    assert choose([shape(1, 10.0, [(A, 5.0), (B, 5.0)])])["config"] == A
    assert choose([shape(1, 10.0, [(B, 5.0), (A, 5.0)])])["config"] == B


def test_table_of_another_triton_release_is_a_prior(tmp_path, monkeypatch):
    """Same GPU kind, other Triton release: cuBLAS and padded entries hold, Triton winners only with
    PRIOR_MIN_GAIN (else cuBLAS, the config kept as a hint), an exact-release table wins per key, a
    table of another GPU kind is ignored; explain's reason says the entry is a prior."""
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 8,
           "EPILOGUE_SUBTILE": 0}
    big, small, exact = (tuned.entry_key(torch.bfloat16, 2048, n, 512, "nn") for n in (1024, 2048, 4096))
    win = lambda gain: {"backend": "triton", "kernel": "tma", "config": cfg, "triton_us": 100.0,  # noqa: E731
                        "torch_us": 100.0 / (1 - gain)}

    def table(triton, sms, entries):
        return json.dumps({"format": tables.FORMAT, "device": "GPU", "capability": [9, 0], "sms": sms,
                           "triton": triton, "torch": "2.11", "entries": entries})

    (tmp_path / "a.json").write_text(table("3.6.0", 132, {big: win(0.3), small: win(0.05), exact: win(0.3)}))
    (tmp_path / "b.json").write_text(table("9.9.9", 132, {exact: {"backend": "torch", "kernel": None,
                                                                  "config": None, "torch_us": 1.0}}))
    (tmp_path / "c.json").write_text(table("3.6.0", 114, {small: win(0.5)}))  # another GPU kind
    monkeypatch.setattr(tuned, "tuned_dir", lambda: tmp_path)
    monkeypatch.setattr(tuned, "device_signature", lambda device: {"capability": [9, 0], "sms": 132,
                                                                   "triton": "9.9.9"})
    got = tuned._read_tables(0)
    assert got[big]["backend"] == "triton" and got[big]["prior"] == "3.6.0"
    assert got[small]["backend"] == "torch" and got[small]["config"] == cfg and got[small]["prior"] == "3.6.0"
    assert got[exact]["backend"] == "torch" and "prior" not in got[exact]
    monkeypatch.setattr(tuned, "_table_for", lambda index: got)
    d = decide._from_table(torch.device("cuda", 0), torch.bfloat16,
                             plan(randn(2048, 512, dtype=torch.bfloat16), randn(512, 1024, dtype=torch.bfloat16)))
    assert d.backend == "triton" and "measured with triton 3.6.0, used as a prior" in d.reason
