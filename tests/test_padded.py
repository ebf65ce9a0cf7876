"""The padded path: cuBLAS (torch.mm) on zero-padded aligned copies of unaligned operands.

On CPU these run torch.mm on the padded buffers (no interpreter needed); the `gpu` tests run
the same path on cuBLAS and check the dispatcher picks it for large unaligned problems.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import tritonmm
from tritonmm.core import layout, workspace
from tritonmm.core.reference import assert_matches_reference, randn
from tritonmm.core.shapes import plan
from tritonmm.dispatch import decide, padded

DEV = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("tf32_on_cuda")


def operand(rows, cols, dtype, transposed, offset=False):
    """A (rows, cols) operand: row-major, or the transposed view of a (cols, rows) matrix; optionally
    a view starting one element into its storage (unaligned base address)."""
    shape = (cols, rows) if transposed else (rows, cols)
    if offset:
        t = randn(shape[0] * shape[1] + 1, dtype=dtype, device=DEV)[1:].view(shape)
    else:
        t = randn(*shape, dtype=dtype, device=DEV)
    return t.t() if transposed else t


@given(M=st.integers(1, 70), N=st.integers(1, 70), K=st.integers(1, 70), ta=st.booleans(), tb=st.booleans(),
       off=st.booleans())
def test_padded_matches_float64(M, N, K, ta, tb, off):
    a, b = operand(M, K, torch.float32, ta, off), operand(K, N, torch.float32, tb)
    a0, b0 = a.clone(), b.clone()
    with tritonmm.force_backend("torch", "padded"):
        d = tritonmm.explain(a, b)
        out = tritonmm.matmul(a, b)
    expect_padded = layout.padded_shape(plan(a, b), a.dtype) is not None
    assert d.kernel == ("padded" if expect_padded else None)
    assert out.is_contiguous() and out.shape == (M, N)
    assert_matches_reference(out, a, b, what="padded")
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["none", "gelu", "silu"])
@pytest.mark.parametrize("bias_shape", [None, "N", (), (1,)])
def test_padded_linear_epilogue(dtype, activation, bias_shape):
    if DEV == "cpu" and dtype == torch.float16:
        pytest.skip("float16 addmm on CPU is slow/partial")
    M, N, K = 37, 45, 51  # every leading dimension unaligned
    x, w = randn(M, K, dtype=dtype, device=DEV), randn(N, K, dtype=dtype, device=DEV)
    bias = None if bias_shape is None else randn(N if bias_shape == "N" else bias_shape, dtype=dtype, device=DEV)
    with tritonmm.force_backend("torch", "padded"):
        out = tritonmm.linear(x, w, bias, activation=activation)

    def ref(x_, w_):
        y = F.linear(x_, w_, None if bias is None else bias.to(x_.dtype))
        return {"none": lambda t: t, "gelu": F.gelu, "silu": F.silu}[activation](y)
    assert_matches_reference(out, x, w, ref_fn=ref, torch_fn=ref, contract=lambda p, q: F.linear(p, q), what="linear")


def test_padded_propagates_nan_and_inf_like_torch():
    a, b = randn(33, 47, device=DEV), randn(47, 29, device=DEV)
    a[3, 5] = float("nan")
    a[7, 1] = float("inf")
    b[2, 11] = float("-inf")
    with tritonmm.force_backend("torch", "padded"):
        out = tritonmm.matmul(a, b)
    ref = torch.matmul(a, b)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out[out.isinf()], ref[ref.isinf()])


def test_padded_reuses_workspace_and_gradients_match():
    workspace.release()
    a = randn(40, 33, device=DEV).requires_grad_()
    b = randn(33, 21, device=DEV).requires_grad_()
    with tritonmm.force_backend("torch", "padded"):
        out = tritonmm.matmul(a, b)
        assert workspace.held_bytes() > 0  # the padded copies live in the reused workspace
        out.backward(torch.ones_like(out))
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.matmul(a2, b2).backward(torch.ones(40, 21, device=DEV))
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_aligned_operands_are_not_padded():
    a, b = randn(32, 64, device=DEV), randn(64, 16, device=DEV)
    assert layout.padded_shape(plan(a, b), a.dtype) is None
    batched = plan(randn(3, 8, 9, device=DEV), randn(3, 9, 8, device=DEV))
    assert layout.padded_shape(batched, torch.float32) is None  # batched GEMMs are never padded


def test_padded_forcing_errors(monkeypatch):
    with pytest.raises(ValueError, match="padded"):
        with tritonmm.force_backend("triton", "padded"):
            pass
    with pytest.raises(ValueError, match="config"):
        with tritonmm.force_backend("torch", "padded", {"BLOCK_M": 16}):
            pass
    a, b = randn(9, 7, device=DEV), randn(7, 5, device=DEV)
    monkeypatch.setenv("TRITONMM_BACKEND", "torch")
    monkeypatch.setenv("TRITONMM_KERNEL", "padded")
    assert tritonmm.explain(a, b).kernel == "padded"
    assert_matches_reference(tritonmm.matmul(a, b), a, b)
    for backend in ("triton", "auto"):
        monkeypatch.setenv("TRITONMM_BACKEND", backend)
        for x, y in ((a, b), (a.double(), b.double()), (randn(9, 0, device=DEV), randn(0, 5, device=DEV)),
                     (randn(0, 7, device=DEV), b)):  # reported on every call, also where it would not apply
            with pytest.raises(ValueError, match="TRITONMM_KERNEL='padded'.*needs backend 'torch'"):
                tritonmm.matmul(x, y)
        with tritonmm.force_backend("torch"):  # inside a forcing block the environment is still checked
            with pytest.raises(ValueError, match="TRITONMM_KERNEL='padded'"):
                tritonmm.matmul(a, b)
    monkeypatch.setenv("TRITONMM_BACKEND", "torch")
    monkeypatch.setenv("TRITONMM_KERNEL", "tma")  # a Triton kernel the torch backend would ignore
    with pytest.raises(ValueError, match="Triton kernel"):
        tritonmm.matmul(a, b)
    monkeypatch.delenv("TRITONMM_KERNEL")
    monkeypatch.delenv("TRITONMM_BACKEND")
    for backend, kernel, config in (("torch", "pointer", None), ("auto", "pointer", {"BLOCK_M": 16})):
        with pytest.raises(ValueError, match="Triton kernel|needs backend 'triton'"):
            with tritonmm.force_backend(backend, kernel, config):
                pass


def test_tuned_padded_entry_becomes_a_padded_decision(monkeypatch):
    from tritonmm.dispatch import tables, tuned

    a, b = randn(300, 301, dtype=torch.bfloat16), randn(301, 302, dtype=torch.bfloat16)
    key = tuned.entry_key(a.dtype, 300, 302, 301, "nn")
    entry = {"backend": "torch", "kernel": "padded", "config": None, "triton_us": 10.0, "torch_us": 30.0}
    tables._check_entry(key, entry)
    monkeypatch.setattr(tuned, "_table_for", lambda index: {key: entry})
    d = decide._from_table(torch.device("cuda", 0), a.dtype, plan(a, b))
    assert (d.backend, d.kernel) == ("torch", "padded") and "3.00x" in d.reason
    aligned = plan(randn(300, 304, dtype=torch.bfloat16), randn(304, 304, dtype=torch.bfloat16))
    monkeypatch.setattr(tuned, "_table_for",
                        lambda index: {tuned.entry_key(a.dtype, 300, 304, 304, "nn"): entry})
    assert decide._from_table(torch.device("cuda", 0), a.dtype, aligned).kernel is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2049, 4097])
def test_padded_on_gpu_is_chosen_and_exact(dtype, n):
    a, b = randn(n, n, dtype=dtype, device="cuda"), randn(n, n, dtype=dtype, device="cuda")
    d = tritonmm.explain(a, b)
    assert d.backend == "torch" and d.kernel in ("padded", None) or d.backend == "triton", str(d)
    with tritonmm.force_backend("torch", "padded"):
        out = tritonmm.matmul(a, b)
        out2 = tritonmm.matmul(a, b)
    assert torch.equal(out, out2)  # deterministic across calls
    assert_matches_reference(out, a, b, what="padded gpu")
    w = randn(n, n, dtype=dtype, device="cuda")
    with tritonmm.force_backend("torch", "padded"):
        lin = tritonmm.linear(a, w, randn(n, dtype=dtype, device="cuda"), activation="gelu")
    assert lin.isfinite().all()


@pytest.mark.gpu
def test_padded_peak_memory_bounded():
    n = 4097
    a, b = randn(n, n, dtype=torch.bfloat16, device="cuda"), randn(n, n, dtype=torch.bfloat16, device="cuda")
    workspace.release()
    with tritonmm.force_backend("torch", "padded"):
        tritonmm.matmul(a, b)  # the workspace grows once
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = tritonmm.matmul(a, b)
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= out.numel() * out.element_size() + (1 << 20), extra  # only the output after the first call
    assert decide.PAD_MIN_FLOPS <= 2 * n**3
