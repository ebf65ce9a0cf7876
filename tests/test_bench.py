"""The benchmark's bookkeeping (no timing here): summaries, the JSON replay, the plot, the CPU check."""

import json
import pathlib
import statistics

import pytest

from tritonmm import bench


def _row(tag, ratio, kernel_ratio, vs_inductor=None, M=64, N=64, K=64):
    row = {"tag": tag, "M": M, "N": N, "K": K, "dtype": "bfloat16", "backend": "torch", "tritonmm_us": 10.0,
           "torch_us": 10.0 * ratio, "kernel_us": 10.0 * ratio / kernel_ratio, "ratio": ratio,
           "kernel_ratio": kernel_ratio, "tritonmm_tflops": 1.0, "torch_tflops": 1.0 / ratio,
           "kernel_tflops": 1.0}
    if vs_inductor is not None:
        row.update(inductor_us=10.0 * vs_inductor, vs_inductor=vs_inductor, inductor_ratio=ratio / vs_inductor,
                   inductor_tune_s=3.0, inductor_tflops=1.0 / vs_inductor)
    return row


def test_summary_geometric_means_per_class():
    rows = [_row("square-a", 2.0, 4.0, 1.5), _row("square-b", 0.5, 1.0, 1.5, M=128), _row("odd-a", 3.0, 3.0, 2.0)]
    summary = {(s["class"]): s for s in bench.summarize(rows)}
    assert summary["square"]["ratio"] == pytest.approx(1.0) and summary["square"]["kernel_ratio"] == pytest.approx(2.0)
    assert summary["square"]["min_ratio"] == 0.5 and summary["square"]["vs_inductor"] == pytest.approx(1.5)
    assert summary["all"]["n"] == 3 and summary["all"]["ratio"] == pytest.approx(3.0 ** (1 / 3))


def test_from_json_prints_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    data = {"machine": {"gpu": "test"}, "rows": [_row("square-a", 2.0, 4.0, 1.5), _row("odd-a", 3.0, 3.0)]}
    path, png = tmp_path / "run.json", tmp_path / "run.png"
    path.write_text(json.dumps(data))
    assert bench.main(["--from-json", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "square" in out and "vs ind." in out and "Inductor time / tritonmm time" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_tables_carry_the_check(tmp_path, capsys):
    bad = dict(_row("square-a", 2.0, 4.0), ok=False, kernel_ok=True)
    good = dict(_row("odd-a", 3.0, 3.0), ok=True, kernel_ok=True, layout="nt")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"machine": {"gpu": "G", "sms": 7, "date": "d"}, "rows": [bad, good]}))
    assert bench.main(["--from-json", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| bfloat16 | matmul")]
    assert rows[0].endswith("| FAIL |") and rows[1].endswith("| ok |") and "matmul nt" in rows[1]
    summary = [line for line in out if line.startswith("| bfloat16 | all |")]
    assert summary == ["| bfloat16 | all | 2 | 2.449 | 2.000 | 3.464 |"]  # geomeans of (2, 3) and (4, 3)
    assert out[0].startswith("G (7 SMs")


def test_from_json_csv_and_argument_errors(tmp_path, capsys):
    path, table = tmp_path / "run.json", tmp_path / "run.csv"
    path.write_text(json.dumps({"rows": [_row("square-a", 2.0, 4.0), _row("odd-a", 3.0, 3.0)]}))
    assert bench.main(["--from-json", str(path), "--csv", str(table)]) == 0
    assert len(table.read_text().splitlines()) == 3
    with pytest.raises(OSError, match="nonexistent"):  # an error of the output, named as such
        bench.main(["--from-json", str(path), "--csv", str(tmp_path / "nonexistent" / "x.csv")])
    for argv in (["--markdown"], ["--from-json", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    assert "--from-json" in capsys.readouterr().err


def test_cpu_check_runs_every_kernel_path(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU check runs without a GPU")
    assert bench.cpu_check() == 0
    out = capsys.readouterr().out
    assert out.count(" ok") == 30 and "FAIL" not in out  # 3 dtypes x 5 paths x (matmul, linear)
    assert out.count("padded") == 6 and out.count("tma-splitk") == 6


def test_cpu_check_runs_the_interpreter_whatever_triton_interpret_said():
    """With TRITON_INTERPRET=0 the check still runs each kernel through the interpreter (and says so); a path the
    interpreter did not run (here: tritonmm told it was interpreting while Triton was not) fails the check."""
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU check runs without a GPU")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-m", "tritonmm.bench"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "TRITON_INTERPRET=0 set to 1" in run.stdout and run.stdout.count(" ok") == 30
    fake = ("import tritonmm.core.env as e; e.interpreting = lambda: True\n"
            "from tritonmm.bench.cpu import cpu_check; raise SystemExit(cpu_check())")
    run = subprocess.run([sys.executable, "-c", fake], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stdout.count("  FAIL\n") == 30  # every row, linears too


def test_main_without_gpu_names_the_flags_it_ignores(monkeypatch, capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("without a GPU only")
    monkeypatch.setattr(bench.cli, "cpu_check", lambda: 0)  # (what cli.main calls)
    assert bench.main(["--dtype", "float32", "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "--dtype, --json ignored" in err and not (tmp_path / "r.json").exists()
    assert bench.main([]) == 0
    assert "ignored" not in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_run_writes_json_and_csv_without_plot(tmp_path):
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps({"dtypes": ["bfloat16"], "shapes": [
        {"tag": "odd", "M": 300, "N": 301, "K": 302}, {"tag": "square", "M": 512, "N": 512, "K": 512}]}))
    out, table = tmp_path / "out.json", tmp_path / "out.csv"
    assert bench.main(["--shapes", str(suite), "--rep", "5", "--json", str(out), "--csv", str(table)]) == 0
    data = json.loads(out.read_text())
    assert [(r["M"], r["N"], r["K"]) for r in data["rows"]] == [(300, 301, 302), (512, 512, 512)]
    assert all(r["ok"] and r["kernel_ok"] for r in data["rows"])
    assert all(r["torch_us"] > 0 and r["tritonmm_us"] > 0 for r in data["rows"])
    assert data["machine"]["gpu"] and len(table.read_text().splitlines()) == 3


def test_inductor_columns_come_from_a_separate_pass(monkeypatch):
    """Inductor runs after every torch.matmul / tritonmm timing, once per row, on operands of the row's shape."""
    import torch

    from tritonmm.bench import gemm

    events = []
    monkeypatch.setattr(gemm, "_matmul_operands", lambda shape, dtype, layout, gen: (
        torch.ones(shape["M"], shape["K"]), torch.ones(shape["K"], shape["N"])))

    def fake_inductor(row, fn, args, *inputs):
        events.append((row["M"], tuple(inputs[0].shape), tuple(inputs[1].shape)))
        row["inductor_us"] = 2.0
        row["vs_inductor"] = row["inductor_us"] / row["tritonmm_us"]

    monkeypatch.setattr(gemm, "bench_inductor", fake_inductor)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch, "Generator", lambda device: type("G", (), {"manual_seed": lambda self, s: self})())
    rows = [_row("odd", 1.0, 1.0, M=3, N=5, K=7), _row("square", 1.0, 1.0, M=4, N=4, K=4)]
    work = [({"M": 3, "N": 5, "K": 7}, torch.bfloat16), ({"M": 4, "N": 4, "K": 4}, torch.bfloat16)]
    args = bench.parse_args(["--compare", "inductor"])
    bench.inductor_pass(rows, work, args)
    assert events == [(3, (3, 7), (7, 5)), (4, (4, 4), (4, 4))]
    assert rows[0]["inductor_tflops"] == pytest.approx(2 * 3 * 5 * 7 / 2.0 / 1e6)
    assert rows[1]["vs_inductor"] == pytest.approx(0.2)


def test_markdown_inductor_columns_and_bad_json(tmp_path, capsys):
    rows = [_row("square-a", 2.0, 4.0, 1.5), _row("odd-a", 0.9871, 3.0, 2.0)]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"runs": [{"machine": {"gpu": "GPU-X"}}], "rows": rows}))
    assert bench.main(["--from-json", str(run), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "GPU-X" in out and "vs Inductor" in out and "| 0.987 |" in out  # min ratio to 3 decimals
    assert "| 15.0 | 3.0 | 1.50 |" in out  # Inductor µs, tuning s, Inductor time / tritonmm time
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"floor": []}))
    assert bench.main(["--from-json", str(bad)]) == 2
    assert "not a --json run" in capsys.readouterr().err
    for text in ("{not json", "", "[" * 100000, '{"rows": [{}]}', '{"rows": [1, 2]}', '{"phases": [1]}',
                 '{"rows": [{"tokens": 1}]}'):  # errors of the file, never a traceback
        bad.write_text(text)
        assert bench.main(["--from-json", str(bad)]) == 2
        assert "not a --json run" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{bad", "[1, 2]", "{}", '{"shapes": {"a": 1}}',
                                  '{"shapes": [{"M": 1, "N": 1, "K": 1}]}',
                                  '{"shapes": [{"tag": "x", "M": -64, "N": 1, "K": 1}]}',
                                  '{"shapes": [{"tag": "x", "M": "64", "N": 1, "K": 1}]}',
                                  '{"shapes": [{"tag": "x", "M": 1, "N": 1, "K": 1, "dtype": "float64"}]}',
                                  '{"shapes": [{"tag": "x", "M": 1, "N": 1, "K": 1, "layout": "tt"}]}',
                                  '{"shapes": [], "dtypes": ["int8"]}'])
def test_a_shape_suite_that_is_not_one_is_refused_with_its_name(tmp_path, text):
    path = tmp_path / "suite.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="suite.json"):
        bench.load_suite(path, None)
    with pytest.raises(ValueError, match="suite.json"):
        bench.load_suite(tmp_path / "missing" / "suite.json", ["x"])
    shapes, dtypes = bench.load_suite(bench.default_suite(), ["square"])
    assert shapes and all(s["tag"].startswith("square") for s in shapes) and dtypes


def test_model_benchmark_on_the_cpu(tmp_path, monkeypatch, capsys):
    """--model without a GPU: a tiny transformers Llama off / swapped / patched and the per-call rows,
    every ratio off time / on time, written as JSON and replayed as Markdown."""
    pytest.importorskip("transformers")
    import torch

    if torch.cuda.is_available():
        pytest.skip("the GPU run is the H200 step `model`")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored after the run, which turns it off for itself
    out = tmp_path / "model.json"
    assert bench.main(["--model", "--rounds", "2", "--model-phases", "eager", "per_call", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    phases = {r["phase"] for r in data["phases"]}
    assert {"eager prefill 1 x 16", "eager decode 1 seq x 4 tokens"} <= phases
    for r in data["phases"]:
        assert r["off_ms"] > 0 and r["swap_ratio"] > 0 and r["patch_ratio"] > 0 and r["control_ratio"] > 0
    rows = {r["row"] for r in data["per_call"]}
    assert {"nn.Linear, no_grad", "F.linear, grad", "matmul, grad", "A/A, no_grad", "A/A, grad"} <= rows
    assert all(r["torch_us"] > 0 and r["tritonmm_us"] > 0 for r in data["per_call"])
    plans = {r["row"]: r.get("weight_plan") for r in data["per_call"]}  # CPU weights: torch serves every GEMM
    assert plans["F.linear, grad"] == plans["matmul, no_grad"] == "free for every GEMM"
    printed = capsys.readouterr()  # the phase table once (the report, stdout); progress names the phases (stderr)
    both = printed.out + printed.err
    assert both.count("(off time / on time)") == 1 and both.count("eager prefill 1 x 16") == 1
    assert "model tiny: eager" in printed.err
    assert bench.main(["--from-json", str(out), "--markdown"]) == 0
    assert "| tiny | eager prefill 1 x 16 |" in capsys.readouterr().out


def test_model_benchmark_times_fuse_without_the_fold_where_asked(tmp_path, monkeypatch, capsys):
    """--unfolded: the eager phases also time fuse without the RMSNorm folds (its own mode and column), fusing with
    the switch off and leaving it as it was; fuse itself folds (the default)."""
    pytest.importorskip("transformers")
    import torch

    import tritonmm
    from tritonmm.modules import norm_fold

    if torch.cuda.is_available():
        pytest.skip("the GPU run is the H200 step `model`")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fuse, folding = tritonmm.fuse, []

    def spy(model, *args, **kwargs):
        out = fuse(model, *args, **kwargs)
        folding.append(any("_tritonmm_folds" in type(m).__dict__ for m in model.modules()))
        return out

    monkeypatch.setattr(tritonmm, "fuse", spy)
    out = tmp_path / "model.json"
    assert bench.main(["--model", "--rounds", "1", "--model-phases", "eager", "--unfolded", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["phases"]
    assert rows and all(r["fuse_unfolded_ratio"] > 0 and r["fuse_ratio"] > 0 for r in rows)
    assert True in folding and False in folding and norm_fold.FOLD is True
    assert "fuse_unfolded" in capsys.readouterr().out
    assert bench.main(["--from-json", str(out), "--markdown"]) == 0
    assert "| fuse, no RMSNorm fold |" in capsys.readouterr().out


def test_prefill_keeps_the_last_positions_logits_only():
    """The model benchmark's prefill computes what generate's does: the last position's logits, equal to the
    full forward's last row; a forward without the argument gets no keyword."""
    pytest.importorskip("transformers")
    import torch

    from tritonmm.bench.model import build_model, prefill_kwargs

    model = build_model("tiny", torch.device("cpu"), torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    kw = prefill_kwargs(model)
    assert kw in ({"logits_to_keep": 1}, {"num_logits_to_keep": 1})
    with torch.no_grad():
        full, last = model(ids, use_cache=False).logits, model(ids, use_cache=False, **kw).logits
    assert full.shape == (2, 7, model.config.vocab_size) and last.shape == (2, 1, model.config.vocab_size)
    torch.testing.assert_close(last, full[:, -1:])
    assert prefill_kwargs(torch.nn.Linear(2, 2)) == {}


def test_model_benchmark_keeps_the_phases_of_a_run_cut_short(tmp_path, monkeypatch):
    """--json holds every phase measured so far (marked partial) when the run stops before its end; without
    ``per_call`` among the phases the per-call rows are not measured."""
    pytest.importorskip("transformers")
    import torch

    from tritonmm.bench import model

    if torch.cuda.is_available():
        pytest.skip("the GPU run is the H200 step `model`")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "per_call_rows", cut)
    out = tmp_path / "model.json"
    assert bench.main(["--model", "--rounds", "1", "--model-phases", "eager", "--json", str(out)]) == 0
    data = json.loads(out.read_text())  # per-call rows not asked for: none measured, the run complete
    assert data["per_call"] == [] and "partial" not in data and data["phases"]
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--model", "--rounds", "1", "--model-phases", "eager", "per_call", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["partial"] is True and data["per_call"] == [] and "machine" in data
    assert {r["phase"] for r in data["phases"]} >= {"eager prefill 1 x 16", "eager decode 1 seq x 4 tokens"}
    assert not list(tmp_path.glob("*.tmp"))


def test_alternate_times_each_sample_warm_with_the_collector_paused_and_an_a_a_control(monkeypatch):
    """Each timed sample follows one untimed call of its own mode and runs with gc paused; each round starts
    with an untimed sample of its first mode; the order rotates by one place per round, rounds are rounded up
    to whole blocks, and ``off`` gets a second contender (``control``) running the same calls."""
    import gc

    import torch

    from tritonmm.bench import model

    log = []

    def run(name):
        def fn():
            log.append((name, gc.isenabled()))
        return fn

    entered = []

    def ctx(name):
        import contextlib

        @contextlib.contextmanager
        def c():
            entered.append(name)
            yield
        return c

    runs = {"off": (ctx("off"), run("off")), "swap": (ctx("swap"), run("swap"))}
    monkeypatch.setattr(model, "SAMPLE_MS", 0.0)  # samples of exactly ``iters`` calls
    assert gc.isenabled()
    times = model.alternate(runs, torch.device("cpu"), rounds=2, iters=2, warmup=1)  # 2 -> one block of 3
    assert gc.isenabled()
    assert set(times) == {"off", "swap", "control"} and all(len(v) == 3 for v in times.values())
    per_round = 2 + 3 * 3  # the round's untimed first sample, then per mode one warm call and iters = 2 calls
    timed = log[len(log) - 3 * per_round:]
    assert all(not enabled for _, enabled in timed)
    rounds = [timed[i:i + per_round] for i in range(0, len(timed), per_round)]
    firsts = []
    for r in rounds:
        assert r[0][0] == r[1][0] == r[2][0]  # the untimed sample is the first mode's
        samples = [r[i:i + 3] for i in range(2, per_round, 3)]
        assert all(len({n for n, _ in sample}) == 1 for sample in samples)  # warm call and sample: one mode
        firsts.append([s[0][0] for s in samples])
    # control runs off's calls; the order rotates: off, swap, control / swap, control, off / control, off, swap
    assert firsts == [["off", "swap", "off"], ["swap", "off", "off"], ["off", "off", "swap"]]
    assert entered[-4:] == ["off", "off", "off", "swap"]  # in the mode's context, the untimed sample too


def test_a_place_effect_within_rounds_cancels_in_the_ratio():
    """Three identical contenders, the first in a round 10% faster and the last 3% slower: every contender
    takes every place equally often and each time is divided by its place's factor, so the ratio reads 1.0;
    a mode 5% faster reads 1.05."""
    from tritonmm.bench import model

    place = [1.0, 1.1, 1.133]
    times = {"off": [], "control": [], "swap": []}
    for r in range(6):
        order = ["off", "control", "swap"][r % 3:] + ["off", "control", "swap"][:r % 3]
        for i, m in enumerate(order):
            times[m].append(place[i] / (1.05 if m == "swap" else 1.0))
    row = model._row("phase", "cfg", times)
    assert row["control_ratio"] == pytest.approx(1.0) and row["rounds_ms"]["off"] == [round(t, 4) for t in times["off"]]
    assert row["swap_ratio"] == pytest.approx(1.05)
    assert row["off_ms"] == pytest.approx(1.1)
    naive = statistics.median(o / c for o, c in zip(times["off"], times["control"]))
    assert naive != pytest.approx(1.0, abs=0.02)  # a median of raw per-round ratios would not cancel it


def test_median_interval_is_the_binomial_order_statistics():
    """95% intervals for a median from binomial tables (p = 1/2): n = 30 -> the 10th and 21st order
    statistics, n = 12 -> the 3rd and 10th; with 5 values no pair reaches 95%, so the extremes."""
    import random

    from tritonmm.bench.timing import median_interval

    values = list(range(1, 31))
    random.Random(0).shuffle(values)
    assert median_interval(values) == (10, 21)
    assert median_interval([float(v) for v in range(12, 0, -1)]) == (3.0, 10.0)
    assert median_interval([5, 1, 4, 2, 3]) == (1, 5)
    assert median_interval(range(1, 31), confidence=0.5) != (10, 21)  # narrower at lower confidence


def test_model_rows_carry_an_interval_around_each_ratio(tmp_path, capsys):
    """Each mode's ratio comes with its interval (containing it), and the Markdown table shows it."""
    from tritonmm.bench import model, model_report

    times = {m: [] for m in ("off", "swap", "control")}
    for r in range(12):
        for m in times:
            times[m].append((1.0 + 0.01 * ((r * 7) % 5)) / (1.1 if m == "swap" else 1.0))
    row = model._row("phase", "cfg", times)
    for m in ("swap", "control"):
        lo, hi = row[f"{m}_interval"]
        assert lo <= row[f"{m}_ratio"] <= hi
    assert row["swap_ratio"] == pytest.approx(1.1)
    table = model_report.markdown({"phases": [row], "per_call": []})
    assert f"{row['swap_ratio']:.3f}x ({row['swap_interval'][0]:.3f}-{row['swap_interval'][1]:.3f})" in table


def test_per_call_cost_cancels_the_place_in_a_round(monkeypatch):
    """Two identical contenders, whichever runs first in a round 10% faster: the cost over torch reads 0,
    where a median of within-round differences over an odd number of rounds would read the majority's order;
    a contender 1 µs slower per call reads +1. Samples run with the garbage collector paused."""
    import gc

    import torch

    from tritonmm.bench import per_call

    collector = []

    def fake(extra):
        state = {"n": 0}
        cost = {"torch": 10.0, "ours": 10.0 + extra}

        def wall_ms(fn, device, calls):
            collector.append(gc.isenabled())
            state["n"] += 1
            first = state["n"] % 2 == 1
            return cost[fn()] * (0.9 if first else 1.0) / 1e3
        return wall_ms

    fns = {"torch": lambda: "torch", "ours": lambda: "ours"}
    monkeypatch.setattr(per_call, "wall_ms", fake(0.0))
    same = per_call.per_call_us(fns, torch.device("cpu"), rounds=41, calls=1)
    assert same["over"] == pytest.approx(0.0, abs=1e-9) and same["torch"] == pytest.approx(same["ours"])
    monkeypatch.setattr(per_call, "wall_ms", fake(1.0))
    slower = per_call.per_call_us(fns, torch.device("cpu"), rounds=41, calls=1)
    assert slower["over"] == pytest.approx(0.95)  # 1 µs, of which the faster first place takes 10% half the time
    assert gc.isenabled() and collector and not any(collector)  # paused within the rounds only


def test_mlp_benchmark_without_a_gpu_and_its_json(tmp_path, capsys):
    """--mlp needs a GPU (it says so and exits 2); a --mlp JSON replays as a table and as Markdown."""
    import torch

    if not torch.cuda.is_available():
        assert bench.main(["--mlp"]) == 2
        assert "none is available" in capsys.readouterr().err
    row = {"config": "tinyllama", "hidden": 2048, "intermediate": 5632, "tokens": 16, "eager_ms": 0.1,
           "fused_ms": 0.05, "fused_ratio": 2.0, "unpacked_ratio": 1.8, "kernel_ratio": 1.9, "bound_ratio": 2.1,
           "compile_ratio": 0.5}
    run = tmp_path / "mlp.json"
    run.write_text(json.dumps({"machine": {}, "rows": [row]}))
    assert bench.main(["--from-json", str(run), "--markdown"]) == 0
    assert "| tinyllama (2048 / 5632) | 16 | 0.100 | 2.00x | 1.80x | 1.90x | 2.10x | 0.50x | - |" in capsys.readouterr().out
    assert bench.main(["--from-json", str(run)]) == 0
    assert "tinyllama" in capsys.readouterr().out


def test_commands_without_a_cpu_version_exit_2_without_a_gpu(capsys):
    """One rule, stated in the README: a command with nothing to run on the CPU exits 2 with a message; the shape
    benchmark runs its interpreter check and ignores the options of a GPU measurement."""
    import torch

    from tritonmm.tune import cli as tune_cli

    if torch.cuda.is_available():
        pytest.skip("the rule without a GPU")
    for argv, main in ((["--mlp"], bench.main), (["--first-sight"], bench.main), ([], tune_cli.main)):
        assert main(argv) == 2, argv
        assert "CUDA GPU; none is available here" in capsys.readouterr().err, argv
    readme = " ".join((pathlib.Path(__file__).parents[1] / "README.md").read_text().split())
    assert "ignores the options of a GPU measurement (`--json`, `--csv`, `--plot` among them" in readme
    assert "(`bench --mlp`, `bench --first-sight`, `python -m tritonmm.tune`) exit with status 2" in readme


@pytest.mark.parametrize("name", ["h200.json", "h200_model.json", "h200_mlp.json"])
def test_committed_runs_print_as_markdown(name, capsys):
    """The committed runs behind the README's table print as Markdown (``--from-json ... --markdown``)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    assert bench.main(["--from-json", str(root / "benchmarks" / name), "--markdown"]) == 0
    assert capsys.readouterr().out.strip().count("\n") > 10


def test_model_report_without_per_call_rows_prints_no_per_call_section(capsys):
    from tritonmm.bench import model_report

    model_report.print_report({"phases": [], "per_call": []})
    assert "per call" not in capsys.readouterr().out
    model_report.print_report({"phases": [], "per_call": [{"row": "F.linear, grad", "torch": "F.linear",
                                                           "torch_us": 1.0, "tritonmm": "tritonmm.linear",
                                                           "tritonmm_us": 1.5, "over_us": 0.5, "ratio": 2 / 3}]})
    assert "per call" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_static_cache_decode_phase_on_the_cpu(monkeypatch):
    """The compiled static-cache decode phase (tiny model, CPU): the cache rewound before each sample (else its
    write position runs past the cache's end: 64 + 3 slots here), a row with fuse's and the A/A control's ratios.
    Traced whole (``fullgraph``) by Dynamo as the phase asks, compiled by AOTAutograd without Inductor's C++ code
    generation (minutes on a cold cache)."""
    import torch

    from tritonmm.bench import model

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, mode=None, **kw: compile_(m, backend="aot_eager", **kw))
    rows = model.static_decode_phase("tiny", torch.device("cpu"), 2, batches=(2,), new_tokens=3)
    assert [r["phase"] for r in rows] == ["compiled static-cache decode 2 seq x 3 tokens"]
    for r in rows:
        assert r["off_ms"] > 0 and r["fuse_ratio"] > 0 and r["control_ratio"] > 0
        assert len(r["rounds_ms"]["fuse"]) == len(r["rounds_ms"]["off"]) >= 2
