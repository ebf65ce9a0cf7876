"""Ahead-of-time tuning: the GEMM geometries a model runs (tritonmm.capture), this machine's tables
(tuned.user_dir) over the shipped ones, and the tuner's work list."""

import json

import pytest
import torch
from torch import nn

import tritonmm
from tritonmm.dispatch import tables, tuned
from tritonmm.tune import capture, measure
from tritonmm.tune import cli as tune_cli


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16, bias=False)).to(dtype)


def _expected(batch_rows: int, grad_input: bool) -> set:
    """Forward: x @ W.T per layer ("nt"); backward: grad @ W per layer whose input needs a gradient ("nn")."""
    rows = {("float32", batch_rows, 48, 32, "nt"), ("float32", batch_rows, 16, 48, "nt"),
            ("float32", batch_rows, 48, 16, "nn")}  # the second layer's input gradient
    if grad_input:
        rows.add(("float32", batch_rows, 32, 48, "nn"))
    return rows


def _got(suite) -> set:
    return {(s["dtype"], s["M"], s["N"], s["K"], s["layout"]) for s in suite["shapes"]}


@pytest.mark.parametrize("integration", ["plain", "swap", "patch"])
@pytest.mark.parametrize("grad_input", [False, True])
def test_geometries_of_forward_and_backward(integration, grad_input):
    model = _mlp()
    x = torch.randn(2, 5, 32, requires_grad=grad_input)  # leading dims fold into M = 10
    if integration == "swap":
        tritonmm.swap_linear(model)
    if integration == "patch":
        tritonmm.patch_linear()
    try:
        suite = capture.geometries(model, x)
    finally:
        if integration == "patch":
            tritonmm.unpatch_linear()
    got = _got(suite)
    assert _expected(10, grad_input) <= got
    # the rest are weight gradients grad.T @ input, (out, in, rows): listed where torch gives A row-major,
    # counted as skipped where A is a transposed view; one per layer (and the first layer's bias: none)
    weight_grads = {("float32", 48, 32, 10, "nn"), ("float32", 16, 48, 10, "nn")}
    assert got - _expected(10, grad_input) <= weight_grads
    assert len(got - _expected(10, grad_input)) + suite["skipped_transposed_a"] == 2
    assert all(p.grad is None for p in model.parameters()) and x.grad is None  # nothing accumulated
    json.dumps(suite)  # saves as a shape suite


def test_geometries_without_grad_are_forward_only_and_count_calls():
    model = _mlp()
    with torch.no_grad():
        suite = capture.geometries(model, torch.randn(3, 32))
        capture.geometries(model, torch.randn(3, 32))
    assert _got(suite) == {("float32", 3, 48, 32, "nt"), ("float32", 3, 16, 48, "nt")}
    assert {s["calls"] for s in suite["shapes"]} == {1} and suite["skipped_transposed_a"] == 0


def test_geometries_of_matmul_layouts_and_model_loss():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 40))

        def forward(self, a, b):
            out = tritonmm.matmul(a, self.w) + torch.matmul(a, b.t())[:, :1]  # B row-major, then transposed
            return type("Out", (), {"loss": out.sum(), "logits": out})()

    m = WithLoss()
    suite = capture.geometries(m, torch.randn(6, 24, requires_grad=True), torch.randn(8, 24))
    got = _got(suite)
    assert ("float32", 6, 40, 24, "nn") in got and ("float32", 6, 8, 24, "nt") in got
    assert ("float32", 6, 24, 40, "nt") in got  # grad_a = grad @ w.T: B is w read transposed


def _table(triton, entries):
    return json.dumps({"format": tables.FORMAT, "device": "GPU", "capability": [9, 0], "sms": 132,
                       "triton": triton, "torch": "2.11", "entries": entries})


def test_user_tables_override_the_shipped_ones_and_count_as_measured(tmp_path, monkeypatch):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir()
    user.mkdir()
    key, other = (tuned.entry_key(torch.bfloat16, 512, n, 1024, "nt") for n in (2048, 4096))
    cublas = {"backend": "torch", "kernel": None, "config": None, "torch_us": 10.0}
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 4, "num_warps": 4}
    triton = {"backend": "triton", "kernel": "pointer", "config": cfg, "torch_us": 100.0, "triton_us": 50.0}
    (shipped / "a.json").write_text(_table("9.9.9", {key: cublas, other: cublas}))
    (user / "b.json").write_text(_table("9.9.9", {key: triton}))
    monkeypatch.setattr(tuned, "tuned_dir", lambda: shipped)
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(user))
    monkeypatch.setattr(tuned, "device_signature", lambda device: {"capability": [9, 0], "sms": 132,
                                                                   "triton": "9.9.9"})
    got = tuned._read_tables(0)
    assert got[key]["backend"] == "triton" and got[other]["backend"] == "torch"
    monkeypatch.setattr(tuned, "_table_for", lambda index: got)
    dev = torch.device("cuda", 0)
    assert tuned.measured(dev, torch.bfloat16, 512, 2048, 1024, "nt")
    assert not tuned.measured(dev, torch.bfloat16, 512, 2048, 1024, "nn")
    assert not tuned.measured(dev, torch.float16, 512, 2048, 1024, "nt")  # a sibling dtype is no measurement
    prior = {other: tuned.prior_entry(cublas, "3.6.0")}
    monkeypatch.setattr(tuned, "_table_for", lambda index: prior)
    assert not tuned.measured(dev, torch.bfloat16, 512, 4096, 1024, "nt")  # a prior is measured again


def test_user_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path / "t"))
    assert tuned.user_dir() == tmp_path / "t"
    monkeypatch.delenv("TRITONMM_TUNED_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert tuned.user_dir() == tmp_path / "c" / "tritonmm" / "tuned"


def test_clear_cache_rereads_the_tables(monkeypatch):
    reads = []
    monkeypatch.setattr(tuned, "_read_tables", lambda index: reads.append(index) or {})
    tritonmm.clear_cache()
    tuned._table_for(0)
    tuned._table_for(0)
    assert reads == [0]
    tritonmm.clear_cache()
    tuned._table_for(0)
    assert reads == [0, 0]
    tritonmm.clear_cache()


def test_work_list_uses_a_rows_own_dtype_and_layout():
    args = tune_cli.parse_args(["--dtype", "float16", "bfloat16", "--layout", "nn"])
    shapes = [{"tag": "a", "M": 1, "N": 2, "K": 3},
              {"tag": "model", "M": 4, "N": 5, "K": 6, "dtype": "float32", "layout": "nt"}]
    work = [(s["tag"], d, lay) for s, d, lay in measure._work(shapes, args)]
    assert work == [("a", torch.float16, "nn"), ("a", torch.bfloat16, "nn"), ("model", torch.float32, "nt")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_tune_model_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        tritonmm.tune_model(_mlp(), torch.randn(2, 32))


@pytest.mark.gpu
def test_tune_model_measures_once_and_the_dispatcher_reads_it(tmp_path, monkeypatch):
    """On the GPU: the first call measures the model's GEMM into this machine's table, a second call
    measures nothing, and the dispatcher decides that geometry from the new entry."""
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path))
    tritonmm.clear_cache()
    model = nn.Linear(512, 1536, device="cuda", dtype=torch.half)
    x = torch.randn(64, 512, device="cuda", dtype=torch.half)
    try:
        with torch.no_grad():
            first = tritonmm.tune_model(model, x)
            assert first["measured"] == first["geometries"] == 1 and first["table"].parent == tmp_path
            second = tritonmm.tune_model(model, x)
        assert second["measured"] == 0 and second["table"] is None
        assert tuned.measured(x.device, torch.half, 64, 1536, 512, "nt")
        assert tritonmm.explain(x, model.weight.t()).reason.startswith("tuned table")
    finally:
        monkeypatch.undo()
        tritonmm.clear_cache()


@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [False, True])
def test_geometries_record_fused_mlps_gated_linears(bias):
    """A fused MLP's gate and up projections are one gated linear (tritonmm::gated_linear): recorded with its
    activation and biases; its down projection as a GEMM."""
    from test_gated import MLP

    torch.manual_seed(0)
    model = tritonmm.fuse(MLP(hidden=32, inter=48, act=nn.GELU(), bias=bias), pack=False)
    with torch.no_grad():
        suite = capture.geometries(model, torch.randn(2, 3, 32))
    assert suite["gated"] == [{"M": 6, "N": 48, "K": 32, "dtype": "float32", "activation": "gelu", "bias": bias,
                               "calls": 1}]
    assert ("float32", 6, 32, 48, "nt") in _got(suite)
    suite = capture.geometries(_mlp(), torch.randn(2, 32))
    assert suite["gated"] == []


def test_geometries_find_example_inputs_in_tuples_and_dicts():
    """An example input that requires grad inside a tuple, list or dict gets its input-gradient GEMM recorded."""
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(32, 48), nn.Linear(24, 16)

        def forward(self, inputs, extra):
            return self.first(inputs["x"][0]).sum() + self.second(extra[1]).sum()

    torch.manual_seed(0)
    x, y = torch.randn(5, 32, requires_grad=True), torch.randn(3, 24, requires_grad=True)
    suite = capture.geometries(Nested(), {"x": (x,)}, extra=[torch.randn(2), y])
    got = _got(suite)
    assert ("float32", 5, 32, 48, "nn") in got and ("float32", 3, 24, 16, "nn") in got  # grad @ W per input
    assert x.grad is None and y.grad is None


def test_geometries_leave_the_models_buffers_and_the_random_state_as_they_were():
    """The recorded pass runs in the model's mode (train here: BatchNorm updates its running statistics and
    Dropout draws random numbers); afterwards the buffers and torch's random state are as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 8))
    before = {name: b.clone() for name, b in model.named_buffers()}
    buffers = dict(model.named_buffers())
    x = torch.randn(6, 32) + 3
    state = torch.get_rng_state()
    suite = capture.geometries(model, x)
    assert ("float32", 6, 16, 32, "nt") in _got(suite) and model.training
    for name, b in model.named_buffers():
        assert b is buffers[name] and torch.equal(b, before[name]), name
    assert torch.equal(torch.get_rng_state(), state)


FAKE_SIG = {"capability": [8, 9], "sms": 7, "triton": "9.9.9"}  # no shipped table matches it
FAKE_TABLE = tables.table_name(FAKE_SIG, "GPU")


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """tune_model and ``python -m tritonmm.tune --user`` on a CPU machine: a GPU named "GPU" whose measurements
    (``measured``: the problems measured) take no time; this machine's tables in ``tmp_path / "user"``."""
    measured = []

    def measure_shape(shape, dtype, layout, args, gen):
        measured.append((shape["M"], shape["N"], shape["K"]))
        return {"tag": shape["tag"], "M": shape["M"], "N": shape["N"], "K": shape["K"],
                "dtype": str(dtype).removeprefix("torch."), "layout": layout, "torch_us": 12.0, "configs": []}

    generator = torch.Generator
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch, "Generator", lambda device=None: generator())
    monkeypatch.setattr(tuned, "device_signature", lambda device: dict(FAKE_SIG))
    monkeypatch.setattr(measure, "measure_shape", measure_shape)
    tritonmm.clear_cache()
    yield measured
    monkeypatch.undo()
    tritonmm.clear_cache()


def _tune_user(tmp_path):
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps({"shapes": [{"tag": "model", "M": 4, "N": 16, "K": 32, "dtype": "float32",
                                             "layout": "nt"}]}))
    return tune_cli.main(["--shapes", str(suite), "--user"])


def _tune_model():
    with torch.no_grad():
        return tritonmm.tune_model(nn.Linear(32, 16), torch.randn(4, 32))


NEW_KEY = tuned.entry_key(torch.float32, 4, 16, 32, "nt")


@pytest.mark.parametrize("how", ["tune --user", "tune_model"])
def test_tuning_keeps_the_valid_entries_of_a_table_with_an_invalid_one(fake_gpu, tmp_path, how):
    """As first-sight tuning's merge: a table entry that no longer validates is dropped with a warning, the
    others kept, and the new entries and measurements added."""
    cublas = {"backend": "torch", "kernel": None, "config": None, "torch_us": 10.0}
    stale = {"backend": "triton", "kernel": "pointer", "config": {"BLOCK_M": 64}, "torch_us": 10.0, "triton_us": 5.0}
    valid = {f"bfloat16:{m}:64:64:nt": cublas for m in (1, 16, 32, 64, 128)}
    path = tmp_path / "user" / FAKE_TABLE
    path.parent.mkdir()
    path.write_text(json.dumps({"format": tables.FORMAT, "device": "GPU", **FAKE_SIG, "torch": "2.13",
                                "entries": {**valid, "bfloat16:256:64:64:nt": stale}, "measurements": []}))
    with pytest.warns(RuntimeWarning, match="bfloat16:256:64:64:nt"):
        assert (_tune_user(tmp_path) if how == "tune --user" else _tune_model()["measured"]) in (0, 1)
    assert fake_gpu == [(4, 16, 32)]
    table = json.loads(path.read_text())
    assert set(table["entries"]) == {*valid, NEW_KEY}
    assert [(r["M"], r["N"], r["K"]) for r in table["measurements"]] == [(4, 16, 32)]


@pytest.mark.parametrize("how", ["tune --user", "tune_model"])
def test_tuning_moves_a_corrupt_table_aside(fake_gpu, tmp_path, how):
    path = tmp_path / "user" / FAKE_TABLE
    path.parent.mkdir()
    path.write_text('{"format": 1, "entries": {')
    with pytest.warns(RuntimeWarning, match="moved tuned table"):
        _tune_user(tmp_path) if how == "tune --user" else _tune_model()
    assert path.with_name(path.name + ".bad").read_text() == '{"format": 1, "entries": {'
    assert set(json.loads(path.read_text())["entries"]) == {NEW_KEY}


def test_tuning_into_an_unwritable_directory(fake_gpu, tmp_path, monkeypatch, capsys):
    """tune_model warns and keeps its entries in this process, as first-sight tuning does; ``tune --user`` says so
    before measuring and exits 2."""
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the directory should be")
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(blocked))
    assert _tune_user(tmp_path) == 2 and fake_gpu == []
    assert "cannot write" in capsys.readouterr().err
    with pytest.warns(RuntimeWarning, match="hold in this process"):
        result = _tune_model()
    assert fake_gpu == [(4, 16, 32)] and result["measured"] == 1 and result["table"] is None
    assert tuned.measured(torch.device("cuda", 0), torch.float32, 4, 16, 32, "nt")
    assert _tune_model()["measured"] == 0  # the entry holds in this process
