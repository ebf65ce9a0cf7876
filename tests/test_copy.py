"""The one-pass pad-copy kernel (tritonmm/kernels/copy.py) behind the padded and TMA paths' operand copies.

On CPU it runs through Triton's interpreter; the `gpu` test runs it on CUDA with offsets past 2**31.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tritonmm
from tritonmm.core import layout
from tritonmm.core.reference import randn
from tritonmm.dispatch import padded
from tritonmm.kernels import copy as copy_kernel

DEV = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("tf32_on_cuda")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_kernel = pytest.mark.skipif(not copy_kernel.usable(torch.device(DEV)), reason="needs CUDA or TRITON_INTERPRET=1")


def bits(t):
    """Bit patterns, so NaN payloads and signed zeros compare exactly."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def source(rows, cols, dtype, transposed, offset):
    shape = (cols, rows) if transposed else (rows, cols)
    t = randn(shape[0] * shape[1] + offset, dtype=dtype, device=DEV)[offset:].view(shape)
    return t.t() if transposed else t


@needs_kernel
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), pad_r=st.integers(0, 20), pad_c=st.integers(0, 70),
       extra=st.integers(0, 9), transposed=st.booleans(), offset=st.integers(0, 3), dtype=st.sampled_from(DTYPES))
def test_pad_copy_matches_torch(rows, cols, pad_r, pad_c, extra, transposed, offset, dtype):
    src = source(rows, cols, dtype, transposed, offset)
    src[0, 0] = float("nan")  # copied as is, not replaced by the padding's zero
    before = bits(src).clone()
    window = (rows + pad_r, cols + pad_c)
    dst = torch.full((window[0] + 2, window[1] + extra), float("nan"), dtype=dtype, device=DEV)
    copy_kernel.PadCopy(src.shape, src.stride(), window, dst.stride(0))(src, dst)

    expect = torch.full_like(dst, float("nan"))
    expect[: window[0], : window[1]] = 0
    expect[:rows, :cols] = src
    assert torch.equal(bits(dst), bits(expect))  # window written, everything outside it untouched
    assert torch.equal(bits(src), before)  # the source is never modified


@needs_kernel
def test_pad_copy_function_and_errors():
    src = randn(5, 7, device=DEV)
    dst = torch.full((6, 16), float("nan"), device=DEV)
    copy_kernel.pad_copy(src, dst)
    assert torch.equal(dst[:5, :7], src) and not dst[5:].any() and not dst[:, 7:].any()
    with pytest.raises(ValueError, match="smaller"):
        copy_kernel.PadCopy((5, 7), (7, 1), (4, 7), 7)
    with pytest.raises(ValueError, match="one dtype"):
        copy_kernel.pad_copy(src, dst.double())
    with pytest.raises(ValueError, match="unit column stride"):
        copy_kernel.pad_copy(src, torch.zeros(16, 6, device=DEV).t())
    with pytest.raises(ValueError, match="overlap"):
        copy_kernel.pad_copy(src, torch.zeros(16, device=DEV).expand(6, 16))
    copy_kernel.pad_copy(src[:0], dst[:0])  # empty: nothing to launch, no error


def test_pad_copy_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        copy_kernel.pad_copy(torch.ones(2, 3), torch.zeros(2, 4))


def test_pad_copy_grid_fits_cuda_limits():
    """One grid axis (CUDA caps axes 1 and 2 at 65535): rows of 2**24 + 1 elements, a million rows."""
    for shape in ((600, 2**24 + 1), (2**20 + 3, 64)):
        pc = copy_kernel.PadCopy(shape, (shape[1], 1), (shape[0], shape[1] + 63), shape[1] + 63)
        g0, g1, g2 = pc.launch.grid
        assert g1 == g2 == 1 and g0 < 2**31 - 1
        assert g0 == -(-shape[0] // copy_kernel.BLOCK_R) * -(-(shape[1] + 63) // copy_kernel.BLOCK_C)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tb", [False, True])
def test_padded_path_same_with_torch_copies(monkeypatch, dtype, tb):
    """The kernel only replaces torch's copies: the padded path's result is bit-identical either way."""
    M, N, K = 33, 45, 51
    a = randn(M, K, dtype=dtype, device=DEV)
    b = randn(N, K, dtype=dtype, device=DEV).t() if tb else randn(K, N, dtype=dtype, device=DEV)
    with tritonmm.force_backend("torch", "padded"):
        assert tritonmm.explain(a, b).kernel == "padded"
        fast = tritonmm.matmul(a, b)
        monkeypatch.setattr(copy_kernel, "usable", lambda device: False)
        tritonmm.clear_cache()  # runners are built per geometry: rebuild with torch's copies
        slow = tritonmm.matmul(a, b)
    assert torch.equal(bits(fast), bits(slow))
    assert layout.padded_shape(tritonmm.core.shapes.plan(a, b), dtype) is not None


@pytest.mark.gpu
def test_pad_copy_int64_offsets():
    """More than 2**31 elements: offsets are 64-bit."""
    rows, cols = 2**16 + 3, 2**15 + 1  # 2.1e9 elements of bfloat16, about 4.3 GB each side
    src = torch.randn(cols, device="cuda", dtype=torch.bfloat16).expand(rows, cols)  # row stride 0
    src = src + torch.arange(rows, device="cuda", dtype=torch.bfloat16)[:, None]
    dst = torch.empty(rows, cols + 7, device="cuda", dtype=torch.bfloat16)
    copy_kernel.pad_copy(src, dst)
    assert torch.equal(dst[:, :cols], src) and not dst[:, cols:].any()
