"""The dispatcher's rules, its reasons, and the ways to force a backend."""

import pytest
import torch

import tritonmm
from tritonmm.core.reference import randn
from tritonmm.core.shapes import plan
from tritonmm.dispatch import decide

CUDA = torch.device("cuda")


@pytest.fixture
def fake_hopper(monkeypatch):
    """Rules for a CUDA device, evaluated on CPU-built plans: an sm_90 GPU with 132 SMs, no tuned table."""
    monkeypatch.setattr(decide._device, "has_tma", lambda device: True)
    monkeypatch.setattr(decide._device, "num_sms", lambda device: 132)
    monkeypatch.setattr(decide._tuned, "entry", lambda device, dtype, p: None)


def decide_cuda(a, b):
    return decide.decide(plan(a, b), a.dtype, CUDA)


def test_cpu_without_interpreter_goes_to_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a, b = randn(64, 64), randn(64, 64)
    d = tritonmm.explain(a, b)
    assert d.backend == "torch" and "CPU" in d.reason
    torch.testing.assert_close(tritonmm.matmul(a, b), torch.matmul(a, b))


@pytest.mark.interpreter
def test_cpu_under_interpreter_takes_triton():
    d = tritonmm.explain(randn(64, 64), randn(64, 64))
    assert d.backend == "triton" and "TRITON_INTERPRET" in d.reason


@pytest.mark.interpreter  # Triton on CPU tensors
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.complex64])
def test_unsupported_dtypes_served_by_torch(dtype):
    a = (torch.randn(5, 7) * 10).to(dtype)
    b = (torch.randn(7, 3) * 10).to(dtype)
    with tritonmm.force_backend("triton"):  # forcing cannot override a capability rule
        d = tritonmm.explain(a, b)
        out = tritonmm.matmul(a, b)
    assert d.backend == "torch" and str(dtype) in d.reason
    assert out.dtype == dtype
    assert torch.equal(out, torch.matmul(a, b))


def test_forced_torch_and_env(monkeypatch):
    a, b = randn(64, 64), randn(64, 64)
    with tritonmm.force_backend("cublas"):
        assert tritonmm.explain(a, b).backend == "torch"
    monkeypatch.setenv("TRITONMM_BACKEND", "torch")
    assert tritonmm.explain(a, b).backend == "torch"
    with tritonmm.force_backend("auto"):  # the context manager wins over the environment
        assert tritonmm.explain(a, b).reason != "backend forced to torch"


@pytest.mark.interpreter  # Triton on CPU tensors
def test_env_kernel(monkeypatch):
    monkeypatch.setenv("TRITONMM_BACKEND", "triton")
    monkeypatch.setenv("TRITONMM_KERNEL", "pointer")
    d = tritonmm.explain(randn(64, 64), randn(64, 64))
    assert (d.backend, d.kernel) == ("triton", "pointer")


@pytest.mark.interpreter  # Triton on CPU tensors
def test_empty_problems_never_launch():
    for sa, sb in [((0, 5), (5, 3)), ((4, 0), (0, 3)), ((0, 4, 5), (5, 2))]:
        d = tritonmm.explain(randn(*sa), randn(*sb))
        assert d.kernel == "none"


def test_tiny_problems_go_to_cublas(fake_hopper):
    d = decide_cuda(randn(16, 64, dtype=torch.bfloat16), randn(64, 64, dtype=torch.bfloat16))
    assert d.backend == "torch" and "too small" in d.reason


def test_fp32_follows_torch_precision(fake_hopper):
    a, b = randn(512, 512), randn(512, 512)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        d = decide_cuda(a, b)
        assert d.backend == "torch" and "TF32" in d.reason
        torch.set_float32_matmul_precision("high")
        assert decide_cuda(a, b).backend == "torch"  # TF32: cuBLAS by default (measured faster)
        with tritonmm.force_backend("triton"):
            assert decide_cuda(a, b).backend == "triton"  # but the TF32 kernel is allowed
    finally:
        torch.set_float32_matmul_precision(old)


def test_untabled_rules_on_hopper(fake_hopper):
    bf = torch.bfloat16
    d = decide_cuda(randn(1024, 1024, dtype=bf), randn(1024, 1024, dtype=bf))
    assert d.backend == "torch" and "tuned table" in d.reason  # aligned, unmeasured: cuBLAS
    d = decide_cuda(randn(2049, 2049, dtype=bf), randn(2049, 2049, dtype=bf))  # unaligned rows: padded copies
    assert (d.backend, d.kernel) == ("torch", "padded") and "padded" in str(d)
    d = decide_cuda(randn(1023, 1023, dtype=bf), randn(1023, 1023, dtype=bf))  # unaligned, too small to pay
    assert (d.backend, d.kernel) == ("torch", None)
    d = decide_cuda(randn(2047, 2047, dtype=bf), randn(2047, 2047, dtype=bf))  # the copies' host cost: cuBLAS
    assert (d.backend, d.kernel) == ("torch", None) and 2 * 2047**3 < decide.PAD_MIN_FLOPS <= 2 * 2049**3
    d = decide_cuda(randn(200, 201, dtype=bf), randn(201, 200, dtype=bf))  # unaligned but small: cuBLAS
    assert d.backend == "torch" and d.kernel is None
    d = decide_cuda(randn(64, 4097, dtype=bf), randn(4097, 4097, dtype=bf))  # memory-bound: copies cost more
    assert d.kernel is None
    w = randn(4096, 4095, dtype=bf)  # an unaligned (N, K) weight read transposed: padded too
    d = decide_cuda(randn(4096, 4095, dtype=bf), w.t())
    assert d.kernel == "padded"
    d = decide_cuda(randn(8, 256, 256, dtype=bf), randn(8, 256, 256, dtype=bf))
    assert d.backend == "torch" and "batched" in d.reason
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        d = decide_cuda(randn(1023, 1023), randn(1023, 1023))
        assert d.backend == "torch" and "float32" in d.reason
        d = decide_cuda(randn(2049, 2049), randn(2049, 2049))  # TF32 pays for padding as half types do
        assert d.kernel == "padded"
        torch.set_float32_matmul_precision("highest")
        assert decide_cuda(randn(2049, 2049), randn(2049, 2049)).kernel is None  # plain fp32: nothing to gain
    finally:
        torch.set_float32_matmul_precision(old)


def test_forced_kernel_choice_on_hopper(fake_hopper):
    bf = torch.bfloat16

    def forced(a, b):
        with tritonmm.force_backend("triton"):
            return decide_cuda(a, b)

    d = forced(randn(1024, 1024, dtype=bf), randn(1024, 1024, dtype=bf))
    assert (d.backend, d.kernel, d.copies) == ("triton", "tma", ())
    d = forced(randn(1023, 1023, dtype=bf), randn(1023, 1023, dtype=bf))
    assert d.kernel == "tma" and d.copies == ("a", "b")
    d = forced(randn(200, 201, dtype=bf), randn(201, 200, dtype=bf))  # unaligned and small: pointer
    assert d.kernel == "pointer"
    d = forced(randn(16, 4096, dtype=bf), randn(4096, 4096, dtype=bf))  # decode, few tiles: split-K
    assert d.kernel == "splitk"
    d = forced(randn(16, 4096, dtype=bf), randn(4096, 28672, dtype=bf))  # decode, many tiles
    assert d.kernel == "pointer"
    d = forced(randn(8, 256, 256, dtype=bf), randn(8, 256, 256, dtype=bf))
    assert d.kernel == "pointer"
    w = randn(4096, 2048, dtype=bf)  # nn.Linear weight (N, K), read transposed in place
    d = forced(randn(512, 2048, dtype=bf), w.t())
    assert d.kernel == "tma" and d.copies == ()


def test_no_tma_before_hopper(fake_hopper, monkeypatch):
    monkeypatch.setattr(decide._device, "has_tma", lambda device: False)
    with tritonmm.force_backend("triton"):
        d = decide_cuda(randn(1024, 1024, dtype=torch.half), randn(1024, 1024, dtype=torch.half))
    assert d.kernel == "pointer"
    d = decide_cuda(randn(1023, 1023, dtype=torch.half), randn(1023, 1023, dtype=torch.half))
    assert d.backend == "torch"  # no TMA: the aligned-copy route does not exist


def test_decision_str_names_backend_and_reason():
    s = str(decide.Decision("torch", None, "because"))
    assert "torch.matmul" in s and "because" in s


@pytest.mark.interpreter
def test_forced_config_reaches_the_kernel():
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 1, "num_stages": 1, "num_warps": 4}
    a, b = randn(40, 24), randn(24, 50)
    with tritonmm.force_backend("triton", "pointer", cfg):
        d = tritonmm.explain(a, b)
        out = tritonmm.matmul(a, b)
    assert d.config == cfg
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        with tritonmm.force_backend("triton", "auto", cfg):
            pass


@pytest.mark.interpreter
def test_decisions_follow_forcing_changes(monkeypatch):
    """The per-geometry cache must not keep a decision after the forcing state changes."""
    a, b = randn(64, 64), randn(64, 64)
    with tritonmm.force_backend("torch"):
        assert tritonmm.explain(a, b).backend == "torch"
    with tritonmm.force_backend("triton", "pointer"):
        assert tritonmm.explain(a, b).kernel == "pointer"
    monkeypatch.setenv("TRITONMM_BACKEND", "torch")
    assert tritonmm.explain(a, b).backend == "torch"
    monkeypatch.setenv("TRITONMM_BACKEND", "triton")
    monkeypatch.setenv("TRITONMM_KERNEL", "splitk")
    assert tritonmm.explain(a, b).kernel == "splitk"


def test_forced_triton_on_cpu_outside_the_interpreter_warns_once(monkeypatch):
    """force_backend("triton") on CPU tensors without TRITON_INTERPRET=1 runs torch, with one UserWarning."""
    import warnings

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(decide, "_warned", set(), raising=False)
    tritonmm.clear_cache()
    a, b = torch.randn(8, 12), torch.randn(12, 5)
    try:
        with warnings.catch_warnings(record=True) as caught, tritonmm.force_backend("triton"):
            warnings.simplefilter("always")
            torch.testing.assert_close(tritonmm.linear(a, b.t()), torch.matmul(a, b))
            assert [(w.category, w.filename) for w in caught] == [(UserWarning, __file__)]  # the call, at its line
            for n in (8, 3):
                torch.testing.assert_close(tritonmm.matmul(a[:n], b), torch.matmul(a[:n], b))
                torch.testing.assert_close(tritonmm.linear(a[:n], b.t()), torch.matmul(a[:n], b))
            assert tritonmm.explain(a, b).backend == "torch"
        assert [str(w.message) for w in caught if w.category is UserWarning] == [
            "tritonmm: backend forced to triton, but torch serves this call and every call like it: CPU tensors: "
            "the Triton kernels run on CUDA GPUs (or on CPU under TRITON_INTERPRET=1)"]
    finally:
        monkeypatch.undo()
        tritonmm.clear_cache()


def test_forced_triton_on_float64_warns_at_the_first_call(monkeypatch):
    """float64 under a forced Triton backend runs torch; the first call itself warns, at the caller's line."""
    import warnings

    monkeypatch.setattr(decide, "_warned", set(), raising=False)
    tritonmm.clear_cache()
    a, b = torch.randn(6, 9, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught, tritonmm.force_backend("triton"):
        warnings.simplefilter("always")
        torch.testing.assert_close(tritonmm.matmul(a, b), torch.matmul(a, b))
        torch.testing.assert_close(torch.ops.tritonmm.linear(a, b.t()), torch.matmul(a, b))
    assert [(w.category, w.filename) for w in caught] == [(UserWarning, __file__)]
    assert "float64" in str(caught[0].message)
