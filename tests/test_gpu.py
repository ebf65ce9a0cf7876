"""Tests that need a CUDA GPU (run on the H200 with `-m gpu`; skipped in CI)."""

import pytest
import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.core import device as _device
from tritonmm.core.reference import assert_matches_reference, randn
from tritonmm.kernels import configs as cfg
from tritonmm.kernels import launch, launchers
from tritonmm.kernels.copy import tma_view

pytestmark = pytest.mark.gpu

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SHAPE_FOR = {"tma": (777, 555, 333), "tma-aligned": (776, 552, 328), "pointer": (333, 257, 129),
             "splitk": (16, 1000, 4000)}


def _launch(kernel, a, b, config, bias=None, activation="none"):
    M, N = a.shape[0], b.shape[1]
    out = torch.full((M, N), float("nan"), dtype=a.dtype, device=a.device)
    if kernel == "tma":
        launchers.launch_tma(tma_view(a), tma_view(b), out, bias, activation, config)
    else:
        launchers.launch_pointer(a[None, None], b[None, None], out[None, None], bias, activation, config,
                                 split_k=kernel == "splitk")
    return out


@pytest.mark.parametrize("case", ["tma", "tma-aligned", "pointer", "splitk"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_every_candidate_config(case, dtype):
    """Each shipped config compiles and computes the right answer on a masked, odd problem."""
    kernel = case.split("-")[0]
    M, N, K = SHAPE_FOR[case]
    a, b = randn(M, K, dtype=dtype, device="cuda"), randn(K, N, dtype=dtype, device="cuda")
    smem, _ = _device.limits(0)
    for config in cfg.candidates(kernel):
        if cfg.smem_bytes(config, 2, 2, kernel) > smem:
            continue
        assert_matches_reference(_launch(kernel, a, b, config), a, b, what=f"{kernel} {config}")


@pytest.mark.parametrize("kernel", ["tma", "pointer", "splitk"])
def test_autotuned_path_and_cache(kernel, monkeypatch):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "1")
    M, N, K = SHAPE_FOR[kernel]
    a, b = randn(M, K, dtype=BF16, device="cuda"), randn(K, N, dtype=BF16, device="cuda")
    first = _launch(kernel, a, b, None)
    assert_matches_reference(first, a, b)
    tuner = launch.autotuned(kernel)
    n_keys = len(tuner.cache)
    assert n_keys >= 1
    second = _launch(kernel, a, b, None)
    assert len(tuner.cache) == n_keys  # same bucket: no retune
    assert torch.equal(first, second)  # the tuning call returns exactly what later calls return


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("kernel", ["tma", "pointer", "splitk"])
def test_linear_epilogue_gpu(kernel, activation, monkeypatch):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")
    M, N, K = (48, 1000, 2048) if kernel == "splitk" else (300, 520, 264)
    x, w, b = (randn(M, K, dtype=BF16, device="cuda"), randn(N, K, dtype=BF16, device="cuda"),
               randn(N, dtype=BF16, device="cuda"))
    act = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    with tritonmm.force_backend("triton", kernel):
        out = tritonmm.linear(x, w, b, activation)
    assert_matches_reference(out, x, w, ref_fn=lambda x_, w_: act(F.linear(x_, w_, b.double())),
                             torch_fn=lambda x_, w_: act(F.linear(x_, w_, b)), contract=F.linear, what=f"{kernel} {activation}")


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_three_batch_levels_on_the_gpu(backend):
    # batch dims that cannot merge: cuBLAS (the default for batched problems) must get the caller's
    # operands, not the kernels' flattened copies; empty problems of that kind launch nothing
    a, b = randn(3, 2, 64, 40, dtype=BF16, device="cuda"), randn(2, 3, 1, 40, 72, dtype=BF16, device="cuda")
    x, w = randn(4, 3, 2, 24, 40, dtype=BF16, device="cuda").permute(2, 1, 0, 3, 4), randn(72, 40, dtype=BF16,
                                                                                            device="cuda")
    with tritonmm.force_backend(backend):
        out = tritonmm.matmul(a, b)
        assert out.shape == (2, 3, 2, 64, 72)
        assert_matches_reference(out, a, b, what=backend)
        y = tritonmm.linear(x, w)
        assert y.shape == (2, 3, 4, 24, 72)
        assert_matches_reference(y, x, w, ref_fn=lambda x_, w_: F.linear(x_, w_), torch_fn=F.linear,
                                 contract=F.linear, what=backend)
        for sa, sb in (((2, 1, 2, 5, 0), (1, 3, 1, 0, 7)), ((2, 1, 2, 5, 3), (1, 3, 1, 3, 0))):
            e = tritonmm.matmul(randn(*sa, dtype=BF16, device="cuda"), randn(*sb, dtype=BF16, device="cuda"))
            torch.testing.assert_close(e, torch.zeros(2, 3, 2, sa[-2], sb[-1], dtype=BF16, device="cuda"))


def test_dispatch_on_the_gpu():
    big = randn(4096, 4096, dtype=BF16, device="cuda")
    d = tritonmm.explain(big, big)
    assert d.backend == "torch" or d.kernel == "tma", str(d)
    with tritonmm.force_backend("triton"):
        assert tritonmm.explain(big, big).kernel == "tma"
        assert tritonmm.explain(randn(4095, 4095, dtype=BF16, device="cuda"),
                                randn(4095, 4095, dtype=BF16, device="cuda")).copies == ("a", "b")
    small = randn(8, 8, dtype=BF16, device="cuda")
    assert tritonmm.explain(small, small).backend == "torch"


def test_float32_follows_tf32_setting(monkeypatch):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")
    a, b = randn(1024, 512, device="cuda"), randn(512, 768, device="cuda")
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with tritonmm.force_backend("triton"):
            assert tritonmm.explain(a, b).backend == "torch"
            exact = tritonmm.matmul(a, b)
        assert_matches_reference(exact, a, b)  # full fp32: bound uses the fp32 rounding unit
        torch.set_float32_matmul_precision("high")
        with tritonmm.force_backend("triton"):
            assert tritonmm.explain(a, b).backend == "triton"
            tf32 = tritonmm.matmul(a, b)
        assert_matches_reference(tf32, a, b)
    finally:
        torch.set_float32_matmul_precision(old)


def test_output_past_2_31_elements(monkeypatch):
    """64-bit offsets: a 70000 x 40000 output (2.8e9 elements); the far end is checked exactly."""
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")
    M, N, K = 70000, 40000, 32
    a, b = randn(M, K, dtype=BF16, device="cuda"), randn(K, N, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", "pointer"):
        out = tritonmm.matmul(a, b)
    rows = slice(M - 64, M)
    assert_matches_reference(out[rows], a[rows], b)
    assert_matches_reference(out[:64, -64:], a[:64], b[:, -64:])
    del out
    torch.cuda.empty_cache()


def test_compile_and_opcheck_on_cuda(monkeypatch):
    # one config per problem whatever the operand strides (the heuristic's): autotuning keys configs by
    # layout, and opcheck compares eager gradients with AOTAutograd's, whose differently strided
    # operands may tune to another config (another fp32 summation order, e.g. split-K); on the H200
    # that differed in the last bfloat16 bit on 9 of 131072 elements, beyond opcheck's 1e-5 tolerance
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")
    x, w = randn(256, 512, dtype=BF16, device="cuda"), randn(1024, 512, dtype=BF16, device="cuda")

    def f(x, w):
        return tritonmm.linear(tritonmm.matmul(x, w.t()) @ w, w, None, "gelu")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    with tritonmm.force_backend("triton"):
        torch.testing.assert_close(compiled(x, w), f(x, w), rtol=2e-2, atol=2e-2)
        torch.library.opcheck(torch.ops.tritonmm.matmul.default, (x.requires_grad_(), w.t()))
        torch.library.opcheck(torch.ops.tritonmm.linear.default, (x, w, None, "silu"))


def test_grads_on_gpu():
    a = randn(3, 200, 300, dtype=BF16, device="cuda").requires_grad_()
    b = randn(300, 136, dtype=BF16, device="cuda").requires_grad_()
    with tritonmm.force_backend("triton"):
        tritonmm.matmul(a, b).float().square().sum().backward()
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    torch.matmul(a.double(), b.double()).square().sum().backward()
    for got, want in ((ga, a.grad), (gb, b.grad)):
        rel = (got.double() - want.double()).norm() / want.double().norm()
        assert rel < 2e-2, rel


_SECOND_PROCESS = r"""
import hashlib, sys, torch, tritonmm
from tritonmm.kernels import launch
kernel = sys.argv[1]
tuner = launch.autotuned(kernel)
benched = []
bench = tuner._bench
tuner._bench = lambda *a, **k: (benched.append(1), bench(*a, **k))[1]
g = torch.Generator(device="cuda").manual_seed(0)
M, N, K = (333, 555, 1000) if kernel != "splitk" else (16, 1000, 4000)
a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
b = torch.randn(K, N, device="cuda", generator=g).bfloat16()
with tritonmm.force_backend("triton", kernel):
    out = tritonmm.matmul(a, b)
print("BENCHED", len(benched), "CONFIG", sorted(tuner.best_config.all_kwargs().items()),
      "SHA", hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest())
"""


@pytest.mark.parametrize("kernel", ["tma", "pointer", "splitk"])
def test_autotune_results_persist_across_processes(kernel, tmp_path):
    """A second process reuses the first one's autotuning from Triton's on-disk cache (cache_results):
    it benchmarks no config, picks the same one and returns bit-identical results."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITONMM_AUTOTUNE="1",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    runs = [subprocess.run([sys.executable, "-c", _SECOND_PROCESS, kernel], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    lines = [next(ln for ln in r.stdout.splitlines() if ln.startswith("BENCHED")) for r in runs]
    first, second = (ln.split() for ln in lines)
    assert int(first[1]) >= 1, lines[0]  # the first process benchmarked its pruned configs
    assert int(second[1]) == 0, lines[1]  # the second read them from disk
    assert first[3:] == second[3:]  # same config, same bits


def test_splitk_partials_past_2_31():
    """Split-K partial offsets pass 2**31 elements (4 x 16 x 48M fp32 partials): the reduction
    reads every partial at the right place."""
    M, N, K = 16, 48_000_000, 128
    config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_stages": 3, "num_warps": 4,
              "SPLIT_K": 4}
    a = randn(M, K, dtype=BF16, device="cuda")
    b = randn(K, N, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", "splitk", config):
        assert tritonmm.explain(a, b).kernel == "splitk"
        out = tritonmm.matmul(a, b)
    for cols in (slice(0, 1 << 20), slice(N - (1 << 20), N), slice(N // 2, N // 2 + (1 << 20))):
        ref = a.double() @ b[:, cols].double()
        assert (out[:, cols].double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    del out
    torch.cuda.empty_cache()


def _on_two_streams(fn, repeats: int, poison: int) -> tuple[list, list]:
    """``repeats`` calls of ``fn`` on each of two new streams, interleaved, after NaN-poisoning the first
    ``poison`` fp32 elements of each stream's split-K partials (a split reducing too early reads NaN)."""
    from tritonmm.core import workspace

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        with torch.cuda.stream(s):
            workspace.buffers(torch.device("cuda", torch.cuda.current_device()), [((poison,), torch.float32)],
                              slot="splitk")[0].fill_(float("nan"))
    torch.cuda.synchronize()
    outs = ([], [])
    for _ in range(repeats):
        for stream_outs, s in zip(outs, streams):
            with torch.cuda.stream(s):
                stream_outs.append(fn())
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("split_k", [2, 3, 8, 16])
def test_splitk_reduce_last_is_repeatable(split_k):
    """The in-kernel last-arriver reduction sums the partials in a fixed order: every one of 30
    back-to-back launches, with bias and an activation, in two streams at once (each stream's counters
    are its own), gives bitwise the first launch's result, which matches the float64 reference; the
    counters end at zero."""
    from tritonmm.core import workspace

    M, N, K = 13, 1000, 4000
    config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_stages": 4, "num_warps": 4,
              "SPLIT_K": split_k}
    a, b = randn(M, K, dtype=BF16, device="cuda"), randn(K, N, dtype=BF16, device="cuda")
    bias = randn(2 * N, dtype=BF16, device="cuda")[::2]
    want = _launch("splitk", a, b, config, bias, "gelu")
    assert_matches_reference(want, a, b, ref_fn=lambda a_, b_: F.gelu(a_ @ b_ + bias.double()),
                             torch_fn=lambda a_, b_: F.gelu(a_ @ b_ + bias))
    outs = _on_two_streams(lambda: _launch("splitk", a, b, config, bias, "gelu"), 30, split_k * M * N)
    for stream_outs in outs:
        for out in stream_outs:
            assert torch.equal(out, want)
    for t in workspace._local.counters.values():
        assert int(t.abs().sum()) == 0


@pytest.mark.parametrize("split_k", [2, 3, 4, 8])
@pytest.mark.parametrize("M,N,K,b_trans", [(128, 4096, 4096, False), (128, 1000, 4000, True), (16, 1544, 14336, True),
                                           (200, 520, 1000, False)])
def test_tma_splitk_is_exact_and_repeatable(M, N, K, b_trans, split_k):
    """The split-K TMA kernel (work units of (tile, split), the last split of each tile reducing):
    within the float64 reference bound with a strided bias and gelu, for nn and nn.Linear (nt)
    weights and an N whose rows TMA cannot store (1000 x 2 bytes is 16-byte aligned, 1544 too; 520
    and 200 rows exercise the masked edges); bitwise equal over 20 launches in each of two streams at
    once into NaN-poisoned partials; the arrival counters end at zero."""
    from tritonmm.core import workspace

    config = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 4, "num_warps": 4,
              "EPILOGUE_SUBTILE": 0, "SPLIT_K": split_k}
    a = randn(M, K, dtype=BF16, device="cuda")
    w = randn(N, K, dtype=BF16, device="cuda") if b_trans else randn(K, N, dtype=BF16, device="cuda").t()
    b = w.t()
    bias = randn(2 * N, dtype=BF16, device="cuda")[::2]
    with tritonmm.force_backend("triton", "tma", config):
        d = tritonmm.explain(a, b)
        assert (d.kernel, d.config) == ("tma", config), str(d)
        outs = _on_two_streams(lambda: tritonmm.linear(a, w, bias, "gelu"), 20, split_k * M * N)
    first = outs[0][0]
    assert_matches_reference(first, a, b, ref_fn=lambda a_, b_: F.gelu(a_ @ b_ + bias.double()),
                             torch_fn=lambda a_, b_: F.gelu(a_ @ b_ + bias))
    for stream_outs in outs:
        for out in stream_outs:
            assert torch.equal(out, first)
    for t in workspace._local.counters.values():
        assert int(t.abs().sum()) == 0


def _generated_code(fn, *args):
    """Inductor's generated source for ``fn(*args)`` (compiled fullgraph), and the result."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code)


def test_compiled_cublas_decision_is_inductors_own_mm():
    """Under torch.compile a cuBLAS decision is an aten GEMM in the graph: Inductor calls its own
    extern mm/addmm, and no tritonmm code runs per call (no custom op in the generated code)."""
    x = randn(512, 1024, dtype=BF16, device="cuda")
    w = randn(768, 1024, dtype=BF16, device="cuda")
    b = randn(768, dtype=BF16, device="cuda")
    assert tritonmm.explain(x, w.t()).backend == "torch"
    out, code = _generated_code(lambda x, w, b: tritonmm.linear(x, w, b), x, w, b)
    assert "extern_kernels" in code and "tritonmm" not in code, code
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("kernel", ["pointer", "splitk"])
def test_compiled_triton_decision_is_a_wrap_triton_launch(kernel, dynamic):
    """A Triton decision under torch.compile is the pointer kernel launched from Inductor's generated
    code (``wrap_triton``), not the opaque op; values and gradients match float64 references."""
    x = randn(16, 1000, dtype=BF16, device="cuda").requires_grad_()
    w = randn(520, 1000, dtype=BF16, device="cuda").requires_grad_()
    b = randn(520, dtype=BF16, device="cuda")

    def f(x, w, b):
        return tritonmm.linear(x, w, b, "gelu")

    with tritonmm.force_backend("triton", kernel):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
        y = compiled(x, w, b)
        y.float().square().sum().backward()
        if not dynamic:
            _, code = _generated_code(lambda x, w, b: tritonmm.linear(x, w, b, "gelu"), x.detach(), w.detach(), b)
            assert "_matmul_kernel" in code and "kernel_linear" not in code, code
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.gelu(F.linear(xd, wd, b.double()))
    assert (y.double() - ref).abs().max() < 0.05 * ref.abs().max()
    ref.square().sum().backward()
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad)):
        assert (got.double() - want).norm() / want.norm() < 2e-2


def test_hot_path_torch_route_is_torchs_own_call():
    """Where every GEMM of a geometry goes to cuBLAS, tritonmm.linear calls F.linear itself: the
    autograd node is torch's (so its autocast cache and saved tensors are torch's)."""
    from tritonmm import api

    x = randn(512, 1024, dtype=BF16, device="cuda").requires_grad_()
    w = randn(768, 1024, dtype=BF16, device="cuda").requires_grad_()
    y = tritonmm.linear(x, w)
    assert type(y.grad_fn).__name__ in ("MmBackward0", "AddmmBackward0")
    assert F.linear in api.routes._cache.values()
