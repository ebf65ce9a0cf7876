"""The gated linear's kernel choice at decode sizes: table entries, first-sight measurement, their use."""

import json
import types

import pytest
import torch
from test_first_sight import fake_timing
from test_gated import assert_close_to_ref, operands

import tritonmm
from tritonmm.dispatch import first_sight, gated, gated_tuning, tables, tuned
from tritonmm.kernels import gated_launchers
from tritonmm.ops import gated as gated_op

CFG = dict(gated_launchers._candidates("pointer")[0])
KEY = "bfloat16:16:64:64:gated_silu"


def _entry(backend="triton", config=CFG, **kw):
    return {"backend": backend, "kernel": "pointer", "config": config, "torch_us": 10.0, "triton_us": 8.0, **kw}


@pytest.fixture(autouse=True)
def _fresh():
    tritonmm.clear_cache()
    yield
    tritonmm.clear_cache()


def _write(path, entries):
    table = {"format": tables.FORMAT, "capability": [9, 0], "sms": 132, "triton": "3.6.0", "entries": entries}
    path.write_text(json.dumps(table))
    return path


def test_gated_entries_are_table_entries_with_gated_configs(tmp_path):
    good = {KEY: _entry(), "float16:1:64:64:gated_gelu_tanh": _entry("torch", None, triton_us=None)}
    assert tables.parse_table(_write(tmp_path / "a.json", good))["entries"] == good
    bad_configs = [{**CFG, "SPLIT_K": 1}, {k: v for k, v in CFG.items() if k != "BLOCK_K"}, {**CFG, "BLOCK_M": 0}]
    for config in bad_configs:  # a plain GEMM's config, a missing field, a zero
        with pytest.raises(ValueError, match="gated pointer config"):
            tables.parse_table(_write(tmp_path / "b.json", {KEY: _entry(config=config)}))
    for key in ("bfloat16:16:64:64:gated_none", "bfloat16:16:64:64:gated_swish"):
        with pytest.raises(ValueError, match="is not dtype:M:N:K:layout"):
            tables.parse_table(_write(tmp_path / "c.json", {key: _entry()}))


def test_gated_entries_do_not_mark_weights_for_the_plain_gemm(monkeypatch):
    monkeypatch.setattr(tuned, "_table_for", lambda index: {KEY: _entry()})
    tuned.weight_used.cache_clear()
    assert not tuned.weight_used(0, (torch.bfloat16,), 64, 64, 0.0)
    monkeypatch.setattr(tuned, "_table_for", lambda index: {"bfloat16:16:64:64:nt": {**_entry(), "config": {
        **gated_launchers._plain_equivalent(CFG), "SPLIT_K": 1, "EPILOGUE_SUBTILE": 0}}})
    tuned.weight_used.cache_clear()
    assert tuned.weight_used(0, (torch.bfloat16,), 64, 64, 0.0)  # (the control: a plain entry does)
    tuned.weight_used.cache_clear()


def _fake_call(M=4, N=64, K=64, dtype=torch.bfloat16):
    """Stand-ins for a CUDA call's x2 and weight (choose reads their device, dtype and shapes only)."""
    x2 = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=torch.Size([M, K]))
    return x2, types.SimpleNamespace(shape=torch.Size([N, K]))


@pytest.fixture
def measuring(monkeypatch):
    """First-sight tuning on, an empty table, measurements recorded in ``calls`` (entry: ``result[0]``)."""
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "1")
    monkeypatch.delenv("TRITONMM_AUTOTUNE", raising=False)
    table, calls, result = {}, [], [_entry()]
    monkeypatch.setattr(tuned, "_table_for", lambda index: table)
    monkeypatch.setattr(first_sight, "_not_now", lambda: False)

    def measure_and_record(index, key, fn):
        first_sight._tried.add((index, key))
        calls.append(key)
        table[key] = result[0]
        return result[0]
    monkeypatch.setattr(first_sight, "measure_and_record", measure_and_record)
    return types.SimpleNamespace(table=table, calls=calls, result=result)


def test_choose_measures_a_new_geometry_once(measuring, monkeypatch):
    x2, w = _fake_call()
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (CFG, True)
    assert measuring.calls == [KEY]  # (M = 4: the M <= 16 bucket)
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (CFG, True)
    assert len(measuring.calls) == 1  # the entry serves
    measuring.result[0] = _entry("torch")
    x2, w = _fake_call(M=1)
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == ("torch", True)
    assert measuring.calls[-1] == "bfloat16:1:64:64:gated_silu"
    # an entry of another kernel's config does not serve this kernel: autotuning does
    x2, w = _fake_call(M=4, N=128)
    measuring.result[0] = {**_entry(), "kernel": "tma"}
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (None, True)


def test_choose_waits_out_capture_and_modes_and_reads_priors_again(measuring, monkeypatch):
    x2, w = _fake_call()
    monkeypatch.setattr(first_sight, "_not_now", lambda: True)
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (None, False)  # nothing kept: measured later
    measuring.table[KEY] = {**_entry(), "prior": "3.5.0"}
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (CFG, False)  # the prior serves meanwhile
    monkeypatch.setattr(first_sight, "_not_now", lambda: False)
    measuring.result[0] = _entry("torch")
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == ("torch", True)
    assert measuring.calls == [KEY]


@pytest.mark.parametrize("env", [{"TRITONMM_FIRST_SIGHT": "0"}, {"TRITONMM_AUTOTUNE": "0"}])
def test_with_first_sight_off_entries_serve_and_nothing_is_measured(measuring, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    x2, w = _fake_call()
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (None, True)
    measuring.table[KEY] = _entry("torch")
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == ("torch", True)
    x2, w = _fake_call(dtype=torch.float16)  # the sibling dtype's entry
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == ("torch", True)
    assert measuring.calls == []


def test_cpu_tensors_take_no_table(measuring):
    x, wg, *_ = operands(4, 64, 64, torch.bfloat16)
    assert gated_tuning.choose("pointer", x, wg, False, "silu") == (None, True)
    assert measuring.calls == []


def _spy_launchers(monkeypatch):
    built = []
    real = gated_launchers.gated_launcher

    def spy(*args):
        built.append(args[-1])  # the config
        return real(*args)
    monkeypatch.setattr(gated_launchers, "gated_launcher", spy)
    return built


@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [False, True])
def test_a_torch_decision_runs_the_torch_expression_also_on_replay(monkeypatch, bias):
    decisions = []
    monkeypatch.setattr(gated_tuning, "choose", lambda *a: decisions.append(a[-1]) or ("torch", True))
    built = _spy_launchers(monkeypatch)
    x, wg, wu, bg, bu = operands(3, 48, 32, torch.float32, bias)
    want = gated.reference(x, wg, wu, bg, bu, "gelu")
    for _ in range(3):  # the first call decides, the next ones replay (gated_op._fast)
        torch.testing.assert_close(tritonmm.gated_linear(x, wg, wu, bg, bu, "gelu"), want, rtol=0, atol=0)
    assert decisions == ["gelu"] and built == [] and len(gated_op._fast) == 1
    # with gradients: the torch expression's values and gradients
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu) + ((bg, bu) if bias else ())]
    out = tritonmm.gated_linear(*leaves[:3], *(leaves[3:] or (None, None)), "gelu")
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref = gated.reference(*ref_leaves[:3], *(ref_leaves[3:] or (None, None)), "gelu")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for got, exp in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, exp.grad, rtol=1e-5, atol=1e-5)  # (backward: gated_grads)
    assert built == []


@pytest.mark.interpreter
def test_a_config_decision_builds_that_config_and_a_deferred_one_is_not_kept(monkeypatch):
    cfg = {**CFG, "BLOCK_N": 16, "BLOCK_K": 32}
    answer = [(cfg, True)]
    monkeypatch.setattr(gated_tuning, "choose", lambda *a: answer[0])
    built = _spy_launchers(monkeypatch)
    x, wg, wu, bg, bu = operands(5, 40, 48, torch.float32)
    with torch.no_grad():
        assert_close_to_ref(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
        assert_close_to_ref(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
    assert built == [cfg]  # built once, then replayed
    # a measurement due later (capture): the call is served, nothing kept, the next call asks again
    answer[0] = (None, False)
    x, wg, wu, bg, bu = operands(6, 40, 48, torch.float32)
    for _ in range(2):
        with torch.no_grad():
            assert_close_to_ref(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
    assert built[1:] == [None, None]  # (no config: the launcher's own, autotuned or the heuristic's)
    # a kernel or config the caller names is not looked up
    answer[0] = ("torch", True)
    h, _, _ = gated.forward(x, wg, wu, None, None, "silu", False, kernel="pointer")
    assert_close_to_ref(h, x, wg, wu)
    assert len(built) == 4


def _measure(monkeypatch, times, corrupt=None, step=0.01):
    """gated_tuning.measure on CPU tensors (interpreter) with fake GPU times: ``times`` = [torch expression,
    then each checked candidate by index]."""
    built = []
    real = gated_launchers.gated_launcher

    def building(*args):
        launch = real(*args)
        built.append(args[-1])
        if corrupt is not None and len(built) - 1 == corrupt:
            def wrong(x, wg, wu, bg, bu, h, g, u):
                launch(x, wg, wu, bg, bu, h, g, u)
                h.add_(1.0)
            return wrong
        return launch
    monkeypatch.setattr(gated_launchers, "gated_launcher", building)
    fake_timing(monkeypatch, times, step)
    return gated_tuning.measure(torch.device("cpu"), torch.bfloat16, 4, 128, 128, "silu", keep=3), built


@pytest.mark.interpreter
def test_measure_keeps_the_kernel_only_where_it_is_faster(monkeypatch):
    entry, built = _measure(monkeypatch, [20.0, 19.0, 15.0, 17.0])
    assert [c["BLOCK_M"] for c in built] == sorted(c["BLOCK_M"] for c in built)  # the least padding first
    assert len(built) == 3 and entry["backend"] == "triton" and entry["config"] == built[1]
    assert entry["torch_us"] == 20.0 and entry["triton_us"] == 15.0
    # the second candidate computes a wrong result: it is not timed (the checked ones take the times in order)
    entry, built = _measure(monkeypatch, [20.0, 19.0, 15.0], corrupt=1)
    assert len(built) == 3 and entry["backend"] == "triton" and entry["config"] == built[2]
    entry, _ = _measure(monkeypatch, [20.0, 21.0, 20.0, 25.0])  # none faster: the torch expression
    assert entry["backend"] == "torch"
    # a whole entry, as the table takes it
    tables._check_entry("bfloat16:16:128:128:gated_silu", entry)


def test_tune_measures_only_what_no_table_of_this_release_holds(measuring, monkeypatch):
    dev = torch.device("cuda", 0)
    assert gated_tuning.tune(dev, torch.bfloat16, 4, 64, 64, "silu") is not None
    assert measuring.calls == [KEY]
    assert gated_tuning.tune(dev, torch.bfloat16, 4, 64, 64, "silu") is None  # recorded: held
    assert gated_tuning.tune(dev, torch.float16, 4, 64, 64, "silu") is None  # the sibling dtype's entry holds
    assert gated_tuning.tune(dev, torch.float32, 4, 64, 64, "silu") is None  # not a first-sight dtype
    measuring.table["bfloat16:16:128:64:gated_relu"] = {**_entry(), "prior": "3.5.0"}
    assert gated_tuning.tune(dev, torch.bfloat16, 4, 128, 64, "relu") is not None  # a prior: measured again
    assert gated_tuning.tune(dev, torch.bfloat16, 4, 128, 64, "relu") is None  # once per process
    assert measuring.calls == [KEY, "bfloat16:16:128:64:gated_relu"]


def test_threads_deciding_one_new_geometry_agree(measuring, monkeypatch):
    """The second thread's first call waits for the first thread's measurement and takes its decision."""
    import threading
    import time

    barrier = threading.Barrier(2)
    monkeypatch.setattr(first_sight, "_not_now", lambda: barrier.wait() and False)  # both past the first checks
    measuring.result[0] = _entry("torch")
    real = first_sight.measure_and_record

    def slow(index, key, fn):
        time.sleep(0.2)
        return real(index, key, fn)
    monkeypatch.setattr(first_sight, "measure_and_record", slow)
    x2, w = _fake_call()
    out = []
    threads = [threading.Thread(target=lambda: out.append(gated_tuning.choose("pointer", x2, w, False, "silu")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [("torch", True)] * 2 and measuring.calls == [KEY]


@pytest.mark.parametrize("field, value", [("num_warps", 3), ("num_warps", 64), ("BLOCK_N", 48), ("BLOCK_K", 96),
                                          ("num_stages", 9)])
def test_configs_that_cannot_launch_are_rejected(field, value):
    with pytest.raises(ValueError, match="cannot launch"):
        tables._check_entry(KEY, _entry(config={**CFG, field: value}))
    plain = {**gated_launchers._plain_equivalent(CFG), "SPLIT_K": 1, "EPILOGUE_SUBTILE": 0, field: value}
    with pytest.raises(ValueError, match="cannot launch"):
        tables._check_entry("bfloat16:16:64:64:nt", {**_entry(config=plain), "kernel": "tma"})


def test_a_prior_narrow_kernel_win_leaves_the_choice_to_autotuning(measuring, monkeypatch):
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "0")
    x2, w = _fake_call()
    measuring.table[KEY] = tuned.prior_entry(_entry(torch_us=10.0, triton_us=9.0), "3.5.0")  # 1.11x: below 15%
    assert measuring.table[KEY]["backend"] == "torch"
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (None, True)
    measuring.table[KEY] = tuned.prior_entry(_entry("torch", torch_us=10.0, triton_us=12.0), "3.5.0")
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == ("torch", True)
    measuring.table[KEY] = tuned.prior_entry(_entry(torch_us=10.0, triton_us=5.0), "3.5.0")  # 2x: kept
    assert gated_tuning.choose("pointer", x2, w, False, "silu") == (CFG, True)


def test_one_row_takes_its_own_key_whatever_n_and_k(measuring):
    measuring.table["bfloat16:16:1:64:gated_silu"] = _entry("torch")
    dev = torch.device("cuda", 0)
    assert gated_tuning.entry(dev, torch.bfloat16, 1, 1, 64, "silu") is None
    assert gated_tuning.entry(dev, torch.bfloat16, 2, 1, 64, "silu")["backend"] == "torch"
    measuring.table["bfloat16:1:1:1:gated_silu"] = _entry()
    assert gated_tuning.entry(dev, torch.bfloat16, 1, 1, 1, "silu")["backend"] == "triton"


@pytest.mark.interpreter
def test_a_deferred_config_that_fails_is_not_kept(monkeypatch):
    """A decision that could not be measured (capture) whose config fails to launch: served by torch, warned,
    and the geometry is decided again at the next call."""
    from tritonmm.dispatch.runners import KernelFailedWarning
    from tritonmm.kernels.launch import LAUNCH_FAILURES

    bad = {**CFG, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_stages": 1}
    answers = [(bad, False), ("torch", True)]
    calls = []
    monkeypatch.setattr(gated_tuning, "choose", lambda *a: calls.append(1) or answers[len(calls) - 1])
    real = gated_launchers.gated_launcher

    def failing(*args):
        launch = real(*args)

        def run(*a):
            if args[-1] is bad:
                raise LAUNCH_FAILURES[0]("out of resources")
            return launch(*a)
        return run
    monkeypatch.setattr(gated_launchers, "gated_launcher", failing)
    x, wg, wu, _, _ = operands(3, 32, 32, torch.float32)
    with torch.no_grad(), pytest.warns(KernelFailedWarning):
        assert_close_to_ref(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
    with torch.no_grad():
        torch.testing.assert_close(tritonmm.gated_linear(x, wg, wu), gated.reference(x, wg, wu), rtol=0, atol=0)
    assert len(calls) == 2


@pytest.mark.interpreter
def test_measure_stops_compiling_at_its_own_budget(monkeypatch):
    # each clock reading moves a fifth of gated_tuning's budget on (two readings per config): the third config
    # would end past it at the second's compile time; at the plain GEMM's shorter budget only one would compile
    assert gated_tuning.COMPILE_BUDGET_S > first_sight.COMPILE_BUDGET_S
    entry, built = _measure(monkeypatch, [20.0, 15.0, 16.0], step=gated_tuning.COMPILE_BUDGET_S / 5)
    assert len(built) == 2 and entry["backend"] == "triton" and entry["config"] == built[0]
