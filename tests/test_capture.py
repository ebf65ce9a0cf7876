"""Ahead-of-time tuning: the GEMM geometries a model runs (tritonmm.capture), this machine's tables
(tuned.user_dir) over the shipped ones, and the tuner's work list."""

import json

import pytest
import torch
from torch import nn

import tritonmm
from tritonmm import capture, tune, tuned


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
    return json.dumps({"format": tuned.FORMAT, "device": "GPU", "capability": [9, 0], "sms": 132,
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
    args = tune.parse_args(["--dtype", "float16", "bfloat16", "--layout", "nn"])
    shapes = [{"tag": "a", "M": 1, "N": 2, "K": 3},
              {"tag": "model", "M": 4, "N": 5, "K": 6, "dtype": "float32", "layout": "nt"}]
    work = [(s["tag"], d, lay) for s, d, lay in tune._work(shapes, args)]
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
