"""The gated linear on a GPU: the gated GEMM kernels and the cuBLAS + product path, M from 1 to 16384, every
candidate config, gradients, compile, CUDA graphs."""

import copy

import pytest
import torch

import tritonmm
from tritonmm.core.reference import EPS, randn
from tritonmm.dispatch import gated
from tritonmm.kernels import gated_launchers
from tritonmm.ops import gated as gated_op

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _operands(M, N, K, dtype=BF16, bias=False):
    x = randn(M, K, dtype=dtype, device="cuda")
    wg = (randn(N, K, device="cuda") / K**0.5).to(dtype)
    wu = (randn(N, K, device="cuda") / K**0.5).to(dtype)
    bg, bu = (randn(N, dtype=dtype, device="cuda"), randn(N, dtype=dtype, device="cuda")) if bias else (None, None)
    return x, wg, wu, bg, bu


def _check(h, x, wg, wu, bg=None, bu=None, act="silu"):
    """Within twice the torch expression's own error against float64, plus one output rounding."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ref = gated.reference(d(x), d(wg), d(wu), d(bg), d(bu), act)
    torch_err = (gated.reference(x, wg, wu, bg, bu, act).double() - ref).abs().max().item()
    err = (h.double() - ref).abs().max().item()
    assert not h.isnan().any()
    assert err <= 2 * torch_err + EPS[x.dtype] * ref.abs().max().item(), (err, torch_err)


@pytest.mark.parametrize("M", [1, 7, 16, 100, 512, 4096, 16384])
def test_values_over_m(M, monkeypatch):
    """The gated GEMM kernels at every M, and the public call (those kernels up to GATED_MAX_M rows and in the
    no-grad kernel band, cuBLAS projections and the one-pass product above)."""
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")  # the heuristic's config: no autotuning per M here
    x, wg, wu, _, _ = _operands(M, 5632, 2048)
    _check(gated.forward(x, wg, wu, None, None, "silu", False, kernel=gated.choose_kernel(x, wg, wu))[0], x, wg, wu)
    _check(tritonmm.gated_linear(x, wg, wu), x, wg, wu)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_every_candidate_config(kernel):
    M, N, K = 300, 700, 1024
    x, wg, wu, bg, bu = _operands(M, N, K, bias=True)
    for cfg in gated_launchers._candidates(kernel):
        h, g, u = (torch.full((M, N), float("nan"), dtype=BF16, device="cuda") for _ in range(3))
        launch = gated_launchers.gated_launcher(kernel, M, N, K, K, K, K, BF16, x.device, (1, 1), True, "silu",
                                                config=cfg)
        try:
            launch(x, wg, wu, bg, bu, h, g, u)
        except Exception as e:  # a config pruning keeps must run; others may exceed shared memory
            pool = gated_launchers.prune(kernel, [cfg], M, N, K, 2, tritonmm.core.device.smem_limit(x.device),
                                         tritonmm.core.device.num_sms(x.device), keep=1)
            assert pool != [cfg], f"{cfg} kept by pruning but failed: {e}"
            continue
        _check(h, x, wg, wu, bg, bu)
        torch.testing.assert_close(g, torch.nn.functional.linear(x, wg, bg), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_autotuned_launch(kernel):
    M = 16 if kernel == "pointer" else 1000
    x, wg, wu, _, _ = _operands(M, 1536, 1024)
    h, _, _ = gated.forward(x, wg, wu, None, None, "gelu_tanh", False, kernel=kernel)
    _check(h, x, wg, wu, act="gelu_tanh")


@pytest.mark.parametrize("M", [16, 600])
@pytest.mark.parametrize("act", gated_op.GATED_ACTIVATIONS)
def test_gradients_on_gpu(M, act, monkeypatch):
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)  # the product path at 600 rows too
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", 0)
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)
    x, wg, wu, _, _ = _operands(M, 640, 512)
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu)]
    out = tritonmm.gated_linear(*leaves, activation=act)  # the gated kernel at 16 rows, cuBLAS + product at 600
    grad = randn(*out.shape, dtype=BF16, device="cuda")
    out.backward(grad)
    refs = [t.detach().double().requires_grad_() for t in leaves]
    gated.reference(*refs, activation=act).backward(grad.double())
    for t, r in zip(leaves, refs):
        rel = (t.grad.double() - r.grad).norm() / r.grad.norm()
        assert rel < 2e-2, rel


def test_fused_llama_mlp_eager_compiled_and_graphed(monkeypatch):
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)  # the product path at 512 rows too
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", 0)
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816)).cuda().to(BF16)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    ref = copy.deepcopy(mlp).double()
    compiled = torch.compile(fused, fullgraph=True)
    for rows in (8, 256):  # 16 rows: the gated kernel serves; 512: cuBLAS projections and the product pass
        x = randn(2, rows, 1024, dtype=BF16, device="cuda")
        with torch.no_grad():
            want = ref(x.double()).to(BF16)
            for got in (fused(x), compiled(x)):
                torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
            static = x.clone()
            fused(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fused(static)
            static.copy_(randn(*x.shape, dtype=BF16, device="cuda"))  # replay reads the new input
            graph.replay()
            torch.testing.assert_close(out, ref(static.double()).to(BF16), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("rows", [32, 128, 512, 2048])
def test_fused_mlp_without_autograd_in_the_kernel_band(rows, monkeypatch, tmp_path):
    """Above GATED_MAX_M rows, up to KERNEL_MAX_FLOPS_NO_GRAD per projection, a fused MLP's no-grad calls: the first
    eager call measures the gated kernel against the torch expression (an entry in this GPU's table), and eager
    calls, a CUDA-graph replay and a compiled call give float64's values."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    from tritonmm.dispatch import gated_tuning

    assert gated.kernel_rows(rows, 2816, 1024, False) and rows > gated.GATED_MAX_M
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "1")
    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path))  # (an empty table: measured at the first call)
    torch.manual_seed(0)
    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816)).cuda().to(BF16)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    ref = copy.deepcopy(mlp).double()
    tritonmm.clear_cache()
    x = randn(1, rows, 1024, dtype=BF16, device="cuda")
    with torch.no_grad():
        want = ref(x.double()).to(BF16)
        for _ in range(2):  # the second call replays the bound geometry
            torch.testing.assert_close(fused(x), want, rtol=3e-2, atol=3e-2)
        assert gated_tuning.entry(x.device, BF16, rows, 2816, 1024, "silu") is not None
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(static)
        static.copy_(randn(*x.shape, dtype=BF16, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, ref(static.double()).to(BF16), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(torch.compile(fused, fullgraph=True)(x), want, rtol=3e-2, atol=3e-2)
    tritonmm.clear_cache()  # (the table read from tmp_path)


@pytest.mark.parametrize("rows", [16, 64])
def test_float32_calls_follow_a_changed_matmul_precision(rows):
    """TF32 where torch.matmul would use it, as the setting stands at each call: a geometry first run under
    "high" and then under "highest" is exact to float32 there (and the other way round)."""
    x = randn(rows, 1024, device="cuda")
    wg, wu = (randn(1024, 1024, device="cuda") / 32 for _ in range(2))
    ref = gated.reference(x.double(), wg.double(), wu.double())
    old = torch.get_float32_matmul_precision()
    errors = {}
    try:
        for precision in ("high", "highest", "high"):
            torch.set_float32_matmul_precision(precision)
            with torch.no_grad():
                for _ in range(2):  # the second call replays
                    out = tritonmm.gated_linear(x, wg, wu)
            errors.setdefault(precision, []).append(((out.double() - ref).abs().max() / ref.abs().max()).item())
    finally:
        torch.set_float32_matmul_precision(old)
    assert max(errors["highest"]) < 1e-5 < min(errors["high"]), errors


@pytest.mark.parametrize("M", [1, 16, 512, 4096, 16384])
def test_packed_fused_mlp_over_m_with_gradients_and_autocast(M):
    """fuse packs gate and up: bf16 weights, forward and backward against float64; fp32 weights under bf16
    autocast against the module under autocast, gradients in fp32."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    from tritonmm.dispatch import gated_cublas

    torch.manual_seed(0)
    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632)).cuda()
    for weights in ("bf16", "fp32 autocast"):
        base = copy.deepcopy(mlp).to(BF16) if weights == "bf16" else copy.deepcopy(mlp)
        fused = tritonmm.fuse(copy.deepcopy(base))
        assert gated_cublas.packed(fused.gate_proj.weight, fused.up_proj.weight) is not None
        ref = copy.deepcopy(base).double() if weights == "bf16" else base
        x = randn(M, 2048, dtype=BF16, device="cuda")
        dout = randn(M, 2048, dtype=BF16, device="cuda")
        xs = [x.clone().requires_grad_(), x.double().requires_grad_() if weights == "bf16" else x.clone().requires_grad_()]
        with torch.autocast("cuda", dtype=BF16, enabled=weights != "bf16"):
            outs = [fused(xs[0]), ref(xs[1])]
        for o in outs:
            o.backward(dout.to(o.dtype))
        pairs = [(outs[0].detach(), outs[1].detach()), (xs[0].grad, xs[1].grad),
                 (fused.gate_proj.weight.grad, ref.gate_proj.weight.grad), (fused.up_proj.weight.grad, ref.up_proj.weight.grad)]
        for i, (got, want) in enumerate(pairs):
            assert not got.isnan().any(), (weights, i)
            assert got.dtype == (BF16 if weights == "bf16" else (BF16 if i < 2 else torch.float32)), (weights, i)
            rel = (got.double() - want.double()).norm() / want.double().norm()
            assert rel < 2e-2, (weights, i, rel)


@pytest.mark.parametrize("M", [1, 16, 512, 16384])
def test_fused_sequential_linear_activation_over_m(M, monkeypatch):
    """fuse on Sequential(Linear, GELU, Linear, SiLU): automatic dispatch and the forced Triton kernel (the
    activation in its epilogue) against the unfused modules in float64, with gradients."""
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(2048, 5632), torch.nn.GELU(), torch.nn.Linear(5632, 2048),
                              torch.nn.SiLU()).cuda()
    ref = copy.deepcopy(seq).double()
    fused = tritonmm.fuse(copy.deepcopy(seq).to(BF16))
    x = randn(M, 2048, device="cuda")
    want = ref(x.double())
    for forced in (False, True):
        xb = x.to(BF16).requires_grad_()
        with tritonmm.force_backend("triton") if forced else torch.enable_grad():
            out = fused(xb)
        assert out.dtype == BF16 and not out.isnan().any()
        torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)
        out.float().sum().backward()
        assert xb.grad is not None and not xb.grad.isnan().any()
    xd = x.double().requires_grad_()
    ref(xd).sum().backward()
    torch.testing.assert_close(xb.grad.double(), xd.grad, rtol=5e-2, atol=5e-2)


def test_decode_geometry_is_measured_once_per_machine_never_in_capture(tmp_path, monkeypatch):
    """First-sight tuning of the gated kernel (gated_tuning): one measurement per geometry, within one to two
    seconds (more where the kernels compile on a fresh machine), recorded in this machine's table; none in CUDA-graph
    capture; a second process measures nothing."""
    import json
    import os
    import subprocess
    import sys

    from tritonmm.dispatch import first_sight, gated_tuning, tables

    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path))
    monkeypatch.setenv("TRITONMM_FIRST_SIGHT", "1")
    monkeypatch.delenv("TRITONMM_AUTOTUNE", raising=False)
    tritonmm.clear_cache()
    x, wg, wu, _, _ = _operands(3, 5632, 2048)
    before = first_sight.stats["measured"]
    with torch.no_grad():
        _check(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
        assert first_sight.stats["measured"] == before + 1
        _check(tritonmm.gated_linear(x, wg, wu), x, wg, wu)
    assert first_sight.stats["measured"] == before + 1
    (path,) = tmp_path.glob("*.json")
    entry = tables.read_table(path)["entries"]["bfloat16:16:5632:2048:gated_silu"]
    print(json.dumps(entry))
    assert entry["first_sight_s"] < 3.0 and entry["torch_us"] > 0
    assert gated_tuning.entry(x.device, BF16, 3, 5632, 2048, "silu") == entry
    # inside capture: nothing measured, the call served; the next eager call measures
    x1, wg1, wu1, _, _ = _operands(1, 4096, 2048)
    heuristic = gated_launchers.heuristic("pointer", 1, 4096, 2048, BF16, x1.device)
    gated.forward(x1, wg1, wu1, None, None, "silu", False, kernel="pointer", config=heuristic)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        h = tritonmm.gated_linear(x1, wg1, wu1)
    graph.replay()
    _check(h, x1, wg1, wu1)
    assert first_sight.stats["measured"] == before + 1
    with torch.no_grad():
        _check(tritonmm.gated_linear(x1, wg1, wu1), x1, wg1, wu1)
    assert first_sight.stats["measured"] == before + 2
    code = ("import torch, tritonmm; from tritonmm.dispatch import first_sight; "
            "x = torch.randn(3, 2048, device='cuda', dtype=torch.bfloat16); "
            "w = torch.randn(5632, 2048, device='cuda', dtype=torch.bfloat16); tritonmm.gated_linear(x, w, w.clone()); "
            "print(first_sight.stats['measured'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITONMM_TUNED_DIR": str(tmp_path), "TRITONMM_FIRST_SIGHT": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0"
    tritonmm.clear_cache()


def test_tune_model_measures_a_fused_mlps_decode_geometry_once(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    from tritonmm.dispatch import gated_tuning

    monkeypatch.setenv("TRITONMM_TUNED_DIR", str(tmp_path))
    tritonmm.clear_cache()
    torch.manual_seed(0)
    mlp = tritonmm.fuse(LlamaMLP(transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816)).cuda().to(BF16))
    x = randn(1, 4, 1024, dtype=BF16, device="cuda")
    with torch.no_grad():
        first = tritonmm.tune_model(mlp, x)
        assert first["gated"] == 1 and first["measured"] >= 1 and first["table"].parent == tmp_path
        assert first["entries"] >= 1
        assert gated_tuning.entry(x.device, BF16, 4, 2816, 1024, "silu")["first_sight_s"] > 0
        assert tritonmm.tune_model(mlp, x)["measured"] == 0
        want = gated.reference(x.double(), mlp.gate_proj.weight.double(), mlp.up_proj.weight.double())
        torch.testing.assert_close(mlp.down_proj.weight.double() @ want[0].t(), mlp(x)[0].double().t(),
                                   rtol=3e-2, atol=3e-2)
    tritonmm.clear_cache()


def _packed_operands(M, N, K):
    x = randn(M, K, dtype=BF16, device="cuda")
    w = (randn(2 * N, K, device="cuda") / K**0.5).to(BF16)
    return x, w, w[:N], w[N:]


@pytest.mark.parametrize("save", [False, True], ids=["h", "save"])
def test_packed_kernel_every_candidate_config(save):
    """The gated GEMM on packed weights with each candidate config: every config pruning keeps runs, H is within
    the torch expression's error, [G | U] equals the cuBLAS GEMM's within bf16 rounding."""
    from tritonmm.kernels import packed_launchers as pl

    M, N, K = 300, 712, 1032
    x, w, wg, wu = _packed_operands(M, N, K)
    kept = pl.prune(list(pl._candidates()), M, N, K, 2, False, save, tritonmm.core.device.smem_limit(x.device),
                    tritonmm.core.device.num_sms(x.device), keep=100)
    assert kept
    for cfg in kept:
        h = torch.full((M, N), float("nan"), dtype=BF16, device="cuda")
        gu = torch.full((M, 2 * N), float("nan"), dtype=BF16, device="cuda") if save else None
        pl.packed_launcher(M, N, K, K, K, BF16, x.device, save, "silu", config=cfg)(x, w, h, gu)
        _check(h, x, wg, wu)
        if save:
            torch.testing.assert_close(gu, torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-2)


def test_packed_backward_kernel_every_candidate_config():
    from tritonmm.kernels import packed_launchers as pl

    M, N, K = 300, 712, 1032
    gu = randn(M, 2 * N, dtype=BF16, device="cuda")
    dy, wd = randn(M, K, dtype=BF16, device="cuda"), (randn(K, N, device="cuda") / N**0.5).to(BF16)
    g, u = gu[:, :N].double().requires_grad_(), gu[:, N:].double().requires_grad_()
    dg, du = torch.autograd.grad(torch.nn.functional.silu(g) * u, (g, u), dy.double() @ wd.double())
    kept = pl.prune(list(pl._candidates()), M, N, K, 2, True, False, tritonmm.core.device.smem_limit(dy.device),
                    tritonmm.core.device.num_sms(dy.device), keep=100)
    assert kept
    for cfg in kept:
        dgu = torch.full((M, 2 * N), float("nan"), dtype=BF16, device="cuda")
        pl.packed_backward_launcher(M, N, K, K, N, BF16, dy.device, "silu", config=cfg)(dy, wd, gu, dgu)
        assert not dgu.isnan().any()
        tol = 0.05 * max(dg.abs().max().item(), du.abs().max().item())
        torch.testing.assert_close(dgu[:, :N].double(), dg, rtol=0, atol=tol)
        torch.testing.assert_close(dgu[:, N:].double(), du, rtol=0, atol=tol)


@pytest.mark.parametrize("M", [4096, 16384])
def test_fused_mlp_inference_takes_the_packed_kernel(M):
    """A fused Llama-3-8B-sized MLP's inference forward at prefill sizes runs the packed kernel (autotuned on
    first use) and matches the unfused module within the torch expression's own error."""
    from tritonmm.dispatch import gated_cublas

    gated_op.clear_cache()
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    with torch.device("cuda"):
        mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336)).to(BF16)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x = randn(M, 4096, dtype=BF16, device="cuda")
    with torch.no_grad():
        out = fused(x)
        ref = mlp(x)
        ref64 = copy.deepcopy(mlp).double()(x.double())
    assert any(k[0] == M for k in gated_cublas._packed_launchers)
    err, torch_err = (out.double() - ref64).abs().max().item(), (ref.double() - ref64).abs().max().item()
    assert err <= 2 * torch_err + EPS[BF16] * ref64.abs().max().item(), (err, torch_err)


def test_fused_mlp_training_keeps_only_the_projections(monkeypatch):
    """A fused TinyLlama-sized MLP's training call runs as the fused MLP's autograd nodes (:mod:`tritonmm.ops.gated_mlp`):
    values and all gradients within twice eager's error against float64, a second backward through the retained
    graph gives the same gradients, and its forward + backward peak memory is at most 0.7x eager's."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    from tritonmm.ops import gated_mlp

    calls = []
    real = gated_mlp._product
    monkeypatch.setattr(gated_mlp, "_product", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    with torch.device("cuda"):
        mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632)).to(BF16)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    ref = copy.deepcopy(mlp).double()
    M = 8192
    x = randn(M, 2048, dtype=BF16, device="cuda")
    dy = randn(M, 2048, dtype=BF16, device="cuda")

    def step(module, inp, retain=False):
        inp = inp.clone().requires_grad_()
        out = module(inp)
        out.backward(dy.to(out.dtype), retain_graph=retain)
        return out, [inp.grad] + [p.grad for p in module.parameters()]

    peaks = {}
    for name, module in (("eager", mlp), ("fused", fused)):
        step(module, x)  # the parameters' gradients allocated
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(module, x)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - before
        module.zero_grad(set_to_none=True)
    assert calls, "the fused MLP's training nodes did not run"
    assert peaks["fused"] <= 0.7 * peaks["eager"], peaks

    out, got = step(fused, x, retain=True)
    want_out, want = step(ref, x.double())
    eager_out, eager = step(mlp, x)
    for i, (g, w, e) in enumerate(zip([out] + got, [want_out] + want, [eager_out] + eager)):
        assert not g.isnan().any(), i
        err, eager_err = (g.double() - w).norm().item(), (e.double() - w).norm().item()
        assert err <= 2 * eager_err + 1e-6, (i, err, eager_err)
    first = [t.clone() for t in got[1:]]
    fused.zero_grad(set_to_none=True)
    out.backward(dy)  # through the retained graph: the projections recomputed
    for a, b in zip([p.grad for p in fused.parameters()], first):
        torch.testing.assert_close(a, b)
