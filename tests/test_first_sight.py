"""First-sight tuning: which GEMMs it measures, how it decides, and the machine's table it writes.

The measurement itself runs here under the interpreter with a fake GPU timer; on the H200,
tests/test_gpu.py measures real geometries (time per geometry, a second process, never slower)."""

import json
import multiprocessing
import warnings

import pytest
import torch

import tritonmm
from tritonmm.core import layout
from tritonmm.core.reference import randn
from tritonmm.core.shapes import plan
from tritonmm.dispatch import decide, first_sight, runners, tables, tuned
from tritonmm.kernels import configs as cfg

SIG = {"capability": [9, 0], "sms": 132, "triton": "3.6.0"}
CUDA0 = torch.device("cuda", 0)


def _entry(torch_us=100.0, **extra):
    return {"backend": "torch", "kernel": None, "config": None, "torch_us": torch_us, **extra}


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "1")
    monkeypatch.delenv("TRITONMM_AUTOTUNE", raising=False)


def test_switches(on, monkeypatch):
    assert first_sight.enabled()
    for off in ("0", "off", "false"):
        monkeypatch.setenv("TRITONMM_FIRST_SIGHT", off)
        assert not first_sight.enabled()
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "sometimes")
    with pytest.raises(ValueError, match="TRITONMM_FIRST_SIGHT"):
        first_sight.enabled()
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "1")
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")  # no benchmarking at all
    assert not first_sight.enabled()


def test_only_large_half_precision_gemms_are_worth_measuring():
    bf = torch.bfloat16
    assert first_sight.worth_tuning(4096, 4096, 4096, bf)
    assert not first_sight.worth_tuning(512, 2816, 1024, bf)  # a small model's prefill: host-paced
    assert not first_sight.worth_tuning(16, 14336, 4096, bf)  # decode of an 8B MLP projection: 117 MB
    assert first_sight.worth_tuning(1, 128256, 4096, bf)  # decode of a large vocabulary head: 1 GB
    assert not first_sight.worth_tuning(4096, 4095, 4096, bf) and not first_sight.worth_tuning(4096, 4096, 4100, bf)
    assert not first_sight.worth_tuning(4096, 4096, 4096, torch.float32)
    assert not first_sight.worth_tuning(4096, 4096, 4096, torch.float64)


def test_pending_skips_what_must_not_be_measured(on, monkeypatch):
    state = {"compiling": False, "capturing": False}
    monkeypatch.setattr(first_sight.modes, "is_compiling", lambda: state["compiling"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    big = [(4096, 4096, 4096, "nt")]
    assert first_sight.pending(CUDA0, torch.bfloat16, big) == big  # (no table on this machine)
    assert first_sight.pending(torch.device("cpu"), torch.bfloat16, big) == []
    assert first_sight.pending(CUDA0, torch.bfloat16, [(16, 64, 64, "nt")]) == []
    for what in state:  # compile tracing, CUDA-graph capture: the table serves, the next eager call measures
        state[what] = True
        assert first_sight.pending(CUDA0, torch.bfloat16, big) == [] and first_sight.deferred(CUDA0, torch.bfloat16, big)
        state[what] = False
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):  # a mode would see the measurement's own calls
        assert first_sight.pending(CUDA0, torch.bfloat16, big) == [] and first_sight.deferred(CUDA0, torch.bfloat16, big)
    assert not first_sight.deferred(CUDA0, torch.bfloat16, big)
    assert first_sight.pending(CUDA0, torch.bfloat16, [(4096, 4100, 4096, "nt")]) == []  # unaligned: rule 5 decides
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "0")
    assert first_sight.pending(CUDA0, torch.bfloat16, big) == []
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "1")
    key = tuned.entry_key(torch.bfloat16, *big[0])
    monkeypatch.setattr(tuned, "_table_for", lambda index: {key: _entry()})  # measured: nothing to do
    assert first_sight.pending(CUDA0, torch.bfloat16, big) == []
    monkeypatch.setattr(tuned, "_table_for", lambda index: {key: _entry(prior="3.5.0")})  # a prior: checked again
    assert first_sight.pending(CUDA0, torch.bfloat16, big) == big
    padded = {**_entry(prior="3.5.0"), "kernel": "padded"}  # ... unless it names the padded path (not Triton's)
    monkeypatch.setattr(tuned, "_table_for", lambda index: {key: padded})
    assert first_sight.pending(CUDA0, torch.bfloat16, big) == []
    sibling = tuned.entry_key(torch.float16, *big[0])  # float16 and bfloat16 stand in for each other
    monkeypatch.setattr(tuned, "_table_for", lambda index: {sibling: _entry()})
    assert first_sight.pending(CUDA0, torch.bfloat16, big) == []


def test_forcing_turns_it_off_but_auto_does_not(on, monkeypatch):
    calls = []
    monkeypatch.setattr(first_sight, "pending", lambda device, dtype, todo: calls.append(todo) or [])
    monkeypatch.setattr(first_sight, "deferred", lambda device, dtype, todo: False)
    from tritonmm.ops import routes
    todo = [(4096, 4096, 4096, "nt")]
    monkeypatch.setenv("TRITONMM_BACKEND", "auto")
    monkeypatch.setenv("TRITONMM_KERNEL", "auto")
    routes._first_sight(todo, torch.bfloat16, CUDA0)
    assert calls == [todo]
    monkeypatch.setenv("TRITONMM_BACKEND", "torch")
    routes._first_sight(todo, torch.bfloat16, CUDA0)
    monkeypatch.delenv("TRITONMM_BACKEND")
    with tritonmm.force_backend("triton"):
        routes._first_sight(todo, torch.bfloat16, CUDA0)
    assert calls == [todo]


def test_recorded_entries_replace_the_table_other_threads_read(tmp_path, monkeypatch):
    monkeypatch.setattr(tuned, "device_signature", lambda device: SIG)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path))
    monkeypatch.setitem(tuned._tables, 0, {"bfloat16:16:64:64:nt": _entry()})
    before = tuned._tables[0]
    path = tuned.record(CUDA0, {"bfloat16:4096:64:64:nt": _entry(first_sight_s=0.2)})
    assert tuned._tables[0] is not before and set(before) == {"bfloat16:16:64:64:nt"}  # the old dict untouched
    assert set(tuned._tables[0]) == {"bfloat16:16:64:64:nt", "bfloat16:4096:64:64:nt"}
    assert path.name == "h200-sm90-132sms-triton3.6.0.json" and "bfloat16:4096:64:64:nt" in _table(path)["entries"]


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_problems_are_the_gemms_the_dispatcher_decides(op, monkeypatch):
    """The (M, N, K, layout) first sight measures for a call and its backward are the ones the
    dispatcher looks up when that call runs, forward and both gradients."""
    seen = []
    real = decide.decide
    monkeypatch.setattr(decide, "decide", lambda p, dtype, device: seen.append(
        (p.M, p.N, p.K, layout.tag(p))) or real(p, dtype, device))
    runners.clear_cache()
    tritonmm.clear_cache()
    x = randn(2, 12, 40).requires_grad_()
    if op == "linear":
        w = randn(56, 40).requires_grad_()
        out = tritonmm.linear(x, w)
        want = first_sight.linear_problems(24, 56, 40, "nt", True)
    else:
        w = randn(40, 56).requires_grad_()
        out = tritonmm.matmul(x, w)
        want = first_sight.problems(24, 56, 40, "nn", True)
    out.backward(randn(*out.shape))  # a contiguous gradient, as a loss's backward gives
    assert sorted(set(seen)) == sorted(want)
    assert first_sight.problems(8, 16, 32, "nt", False) == [(8, 16, 32, "nt")]


class _Clock:
    def __init__(self, step):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def fake_timing(monkeypatch, times, step):
    """Fake GPU times for first_sight.race: ``times`` = [the torch call, then each checked contender in order,
    which keeps its time in the head-to-head]; and a clock advancing ``step`` s per reading."""
    known = {}

    def fake_times(fns, rep_ms):
        for fn in fns:
            fn()
        if len(fns) > 2 or not known:
            known.update({id(fn): times[1 + i] for i, fn in enumerate(fns[1:])})
        return [times[0]] + [known[id(fn)] for fn in fns[1:]]
    monkeypatch.setattr(first_sight, "_times", fake_times)
    monkeypatch.setattr(first_sight, "_clock", _Clock(step))


def _measure(monkeypatch, times, step=0.01, corrupt=None, M=32, N=48, K=64):
    """first_sight.measure on CPU tensors (interpreter), with fake GPU times: ``times`` (torch_us first,
    then each compiled candidate's µs, by index) and a clock advancing ``step`` s per reading."""
    built = []
    build = runners.build

    def counting_build(p, decision, dtype, device):
        built.append(decision.config)
        run = build(p, decision, dtype, device)
        if corrupt is not None and len(built) - 1 == corrupt:
            return lambda a, b, bias: run(a, b, bias) + 1.0  # a wrong result
        return run

    monkeypatch.setattr(runners, "build", counting_build)
    fake_timing(monkeypatch, times, step)
    entry = first_sight.measure(torch.device("cpu"), torch.bfloat16, M, N, K, "nt")
    return entry, built


@pytest.mark.interpreter
def test_measure_picks_a_checked_candidate_only_by_the_tuners_margin(monkeypatch):
    n = len(first_sight.candidates(plan(randn(32, 64, dtype=torch.bfloat16),
                                        randn(48, 64, dtype=torch.bfloat16).t()), torch.bfloat16,
                                   torch.device("cpu")))
    assert n >= 2
    times = [100.0] + [90.0 - i for i in range(n)]  # the last candidate is fastest
    entry, built = _measure(monkeypatch, times)
    assert len(built) == n and entry["backend"] == "triton" and entry["config"] == built[-1]
    assert entry["torch_us"] == 100.0 and entry["triton_us"] == 90.0 - (n - 1)
    # the fastest candidate computes a wrong result: it is not timed, the next fastest wins
    entry, built = _measure(monkeypatch, [100.0] + [90.0 - i for i in range(n - 1)], corrupt=n - 1)
    assert entry["config"] == built[-2]
    # inside the margin (first_sight.MIN_GAIN, 1.05x): cuBLAS, the candidate kept as a hint
    for us in (99.5, 97.0):  # 1.005x, 1.03x
        entry, _ = _measure(monkeypatch, [100.0] + [us] * n)
        assert entry["backend"] == "torch" and entry["config"] is not None
    entry, _ = _measure(monkeypatch, [100.0] + [94.0] * n)  # 1.064x
    assert entry["backend"] == "triton"


@pytest.mark.interpreter
def test_measure_stops_compiling_at_the_budget_and_skips_short_gemms(monkeypatch):
    n = 99
    # each reading of the clock moves it on by a fifth of the budget (two readings per candidate): the
    # third candidate would end past the budget at the second's compile time, so it is not compiled
    step = first_sight.COMPILE_BUDGET_S / 5
    entry, built = _measure(monkeypatch, [100.0] + [50.0] * n, step=step)
    assert len(built) == 2 and entry["backend"] == "triton"
    entry, built = _measure(monkeypatch, [first_sight.MIN_TORCH_US - 1], step=0.0)
    assert built == [] and entry["backend"] == "torch" and "too short" in entry["note"]
    d = decide._table_decision({**entry, "first_sight_s": 0.1}, None, torch.bfloat16, "tuned table (first sight)")
    assert d.backend == "torch" and "too short" in d.reason


def test_first_sight_entries_read_as_such(monkeypatch):
    key = tuned.entry_key(torch.bfloat16, 2048, 1024, 512, "nn")
    config = cfg.candidates("tma")[0]
    win = {"backend": "triton", "kernel": "tma", "config": config, "torch_us": 200.0, "triton_us": 150.0,
           "first_sight_s": 0.4}
    monkeypatch.setattr(tuned, "_table_for", lambda index: {key: win})
    d = decide._from_table(CUDA0, torch.bfloat16, plan(randn(2048, 512, dtype=torch.bfloat16),
                                                         randn(512, 1024, dtype=torch.bfloat16)))
    assert d.backend == "triton" and d.config == config and "measured at first sight" in d.reason


def test_first_sight_entries_written_with_a_smaller_margin_are_held_to_the_current_one(monkeypatch):
    """A first-sight Triton entry at 1.02x (the margin was 1.01x) goes to cuBLAS, also for the weight plans;
    an offline-tuned entry at the same figures keeps Triton."""
    key = tuned.entry_key(torch.bfloat16, 2048, 1024, 512, "nn")
    win = {"backend": "triton", "kernel": "tma", "config": cfg.candidates("tma")[0], "torch_us": 1020.0,
           "triton_us": 1000.0}
    p = plan(randn(2048, 512, dtype=torch.bfloat16), randn(512, 1024, dtype=torch.bfloat16))
    try:
        for first, backend in ((True, "torch"), (False, "triton")):
            entry = {**win, "first_sight_s": 0.4} if first else win
            monkeypatch.setattr(tuned, "_table_for", lambda index: {key: entry})
            tuned.weight_used.cache_clear()
            d = decide._from_table(CUDA0, torch.bfloat16, p)
            assert d.backend == backend and ("first-sight tuning's margin" in d.reason) == first, str(d)
            assert tuned.weight_used(0, (torch.bfloat16,), 1024, 512, decide.TRITON_MIN_SAVING_US) == (not first)
    finally:
        tuned.weight_used.cache_clear()


def _table(path):
    return json.loads(path.read_text())


def test_merge_creates_updates_and_bounds_the_table(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "t.json"
    tables.merge_entries(path, SIG, "GPU", {"bfloat16:16:64:64:nt": _entry(first_sight_s=0.1)})
    got = tables.read_table(path)
    assert got["triton"] == "3.6.0" and list(got["entries"]) == ["bfloat16:16:64:64:nt"]
    tables.merge_entries(path, SIG, "GPU", {"bfloat16:32:64:64:nt": _entry()})  # not first sight: never dropped
    monkeypatch.setattr(tables, "MAX_FIRST_SIGHT", 3)
    for m in (64, 128, 256, 512):
        tables.merge_entries(path, SIG, "GPU", {f"bfloat16:{m}:64:64:nt": _entry(first_sight_s=0.1)})
    keys = list(_table(path)["entries"])
    assert "bfloat16:16:64:64:nt" not in keys and "bfloat16:64:64:64:nt" not in keys  # the oldest went
    assert set(keys) == {"bfloat16:32:64:64:nt", "bfloat16:128:64:64:nt", "bfloat16:256:64:64:nt",
                         "bfloat16:512:64:64:nt"}
    tables.merge_entries(path, SIG, "GPU", {"bfloat16:128:64:64:nt": _entry(7.0, first_sight_s=0.1)})
    assert list(_table(path)["entries"])[-1] == "bfloat16:128:64:64:nt"  # re-measured: the newest
    with pytest.raises(ValueError, match="backend"):
        tables.merge_entries(path, SIG, "GPU", {"bfloat16:1:64:64:nt": {"backend": "cuda"}})
    assert "bfloat16:1:64:64:nt" not in _table(path)["entries"]
    assert sorted(p.name for p in path.parent.iterdir()) == [".t.json.lock", "t.json"]  # no temporary file left


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "entries": {"k": {"backend": "tr', "", "[1, 2]",
                                     "[" * 100_000,
                                     json.dumps({"format": 1, "capability": [8, 0], "sms": 108, "triton": "3.6.0",
                                                 "entries": {}}),
                                     json.dumps({"format": 1, **SIG, "triton": "3.5.0", "entries": {}})])
def test_a_corrupt_truncated_or_foreign_file_is_moved_aside_with_one_warning(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tables.merge_entries(path, SIG, "GPU", {"bfloat16:16:64:64:nt": _entry()})
    assert len(caught) == 1 and "moved tuned table" in str(caught[0].message)
    assert (tmp_path / "t.json.bad").read_text() == content  # kept for the user to look at
    got = tables.read_table(path)
    assert got["capability"] == [9, 0] and got["triton"] == "3.6.0" and list(got["entries"]) == ["bfloat16:16:64:64:nt"]


def test_an_invalid_entry_is_dropped_and_the_others_kept(tmp_path):
    path = tmp_path / "t.json"
    bad = {"backend": "triton", "kernel": "pointer", "config": {"BLOCK_M": 7}, "torch_us": 1.0, "triton_us": 0.5}
    path.write_text(json.dumps({"format": 1, **SIG, "entries": {f"bfloat16:{m}:64:64:nt": _entry() for m in (1, 16)}
                                | {"bfloat16:32:64:64:nt": bad}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tables.merge_entries(path, SIG, "GPU", {"bfloat16:64:64:64:nt": _entry()})
    assert len(caught) == 1 and "dropping" in str(caught[0].message)
    assert set(_table(path)["entries"]) == {"bfloat16:1:64:64:nt", "bfloat16:16:64:64:nt", "bfloat16:64:64:64:nt"}


def test_another_triton_releases_table_beside_it_is_left_alone(tmp_path):
    other = tmp_path / "h200-sm90-132sms-triton3.5.0.json"
    text = json.dumps({"format": 1, **SIG, "triton": "3.5.0", "entries": {"bfloat16:16:64:64:nt": _entry(3.0)}})
    other.write_text(text)
    tables.merge_entries(tmp_path / "h200-sm90-132sms-triton3.6.0.json", SIG, "GPU",
                        {"bfloat16:16:64:64:nt": _entry()})
    assert other.read_text() == text


def _writer(path, start, count):
    for i in range(start, start + count):
        tables.merge_entries(path, SIG, "GPU", {f"bfloat16:{i}:64:64:nt": _entry(first_sight_s=0.1)})


def test_concurrent_processes_keep_every_entry(tmp_path):
    path = tmp_path / "t.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, 1000 * p + 1, 20)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(tables.read_table(path)["entries"]) == 80


@pytest.fixture
def gpu_table(on, tmp_path, monkeypatch):
    """First-sight tuning on, this machine's table in an empty directory."""
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path))
    tritonmm.clear_cache()
    yield tmp_path
    tritonmm.clear_cache()


def _cuda(*shape):
    return randn(*shape, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_gpu_a_new_geometry_is_measured_once_per_machine(gpu_table):
    from tritonmm.core.reference import assert_matches_reference

    x, w = _cuda(3000, 4096), _cuda(5000, 4096)
    assert "first-sight" in tritonmm.explain(x, w.t()).reason
    before = first_sight.stats["measured"]
    assert_matches_reference(tritonmm.linear(x, w), x, w.t())
    assert first_sight.stats["measured"] == before + 1
    (path,) = gpu_table.glob("*.json")
    entry = tables.read_table(path)["entries"][tuned.entry_key(torch.bfloat16, 3000, 5000, 4096, "nt")]
    assert entry["first_sight_s"] > 0 and entry["torch_us"] > 0
    assert "measured at first sight" in tritonmm.explain(x, w.t()).reason
    assert_matches_reference(tritonmm.linear(x, w), x, w.t())
    assert first_sight.stats["measured"] == before + 1  # decided: not measured again
    # with gradients: the input's gradient GEMM too (2500 x 4096 x 4800), and the gradients are right; the
    # weight's (4800 x 4096 x 2500) has a K of 2500 bf16 elements, not whole 16-byte units: rule 5 decides it
    xg, wg = _cuda(2500, 4096).requires_grad_(), _cuda(4800, 4096).requires_grad_()
    g = _cuda(2500, 4800)
    tritonmm.linear(xg, wg).backward(g)
    assert first_sight.stats["measured"] == before + 3
    assert_matches_reference(xg.grad, g, wg.detach())
    assert_matches_reference(wg.grad, g.t(), xg.detach())
    # a second process with this table measures nothing
    code = ("import torch, tritonmm; from tritonmm.dispatch import first_sight; "
            "x = torch.randn(3000, 4096, device='cuda', dtype=torch.bfloat16); "
            "w = torch.randn(5000, 4096, device='cuda', dtype=torch.bfloat16); tritonmm.linear(x, w); "
            "print(first_sight.stats['measured'])")
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITONMM_TUNED_DIR": str(gpu_table), "TRITONMM_FIRST_SIGHT": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0"


@pytest.mark.gpu
def test_gpu_nothing_is_measured_in_capture_or_compile_and_the_next_eager_call_measures(gpu_table):
    x, w = _cuda(2800, 4096), _cuda(4400, 4096)
    before = first_sight.stats["measured"]
    compiled = torch.compile(lambda x, w: tritonmm.linear(x, w), fullgraph=True)
    want = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(compiled(x, w), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tritonmm.linear(x, w)
    graph.replay()
    torch.testing.assert_close(y, want)
    assert first_sight.stats["measured"] == before
    torch.testing.assert_close(tritonmm.linear(x, w), want)
    assert first_sight.stats["measured"] == before + 1


@pytest.mark.parametrize("reason, noted", [
    ("not in this GPU's tuned table: cuBLAS", True),
    ("tuned table (measured with triton 3.5.0, used as a prior): measured 1.30x cuBLAS", True),
    ("tuned table: cuBLAS measured faster (Triton 0.90x)", False),
])
def test_explain_says_when_a_measurement_is_due(reason, noted, monkeypatch):
    decision = decide.Decision("torch", None, reason)
    monkeypatch.setattr(runners, "lookup", lambda *args: runners.Prepared(decision, None))
    monkeypatch.setattr(first_sight, "pending", lambda device, dtype, todo: todo)
    got = tritonmm.explain(randn(64, 64), randn(64, 64)).reason
    assert got.startswith(reason) and ("first-sight tuning" in got) == noted
