"""Hypothesis shape-fuzzing of tritonmm.matmul against a float64 reference (and torch.matmul's own error).

CPU (interpreter): dims 0..~300, every kernel (the TMA kernel also with a forced split-K config)
and the padded path. GPU (`-m gpu`): dims up to 4096, every kernel, the padded path and the
automatic dispatch, float16 / bfloat16 / float32.
"""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import tritonmm
from tritonmm.core.reference import assert_matches_reference, randn

SMALL_PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 31, 37, 61, 67, 97, 127, 131, 257]


def dims(max_dim: int):
    """Dims biased to 0/1, primes and non-multiples of 16, with occasional large values."""
    odd = st.integers(1, max_dim).filter(lambda d: d % 16 != 0)
    return st.one_of(
        st.sampled_from([0, 1]),
        st.sampled_from([p for p in SMALL_PRIMES if p <= max_dim]),
        odd,
        st.integers(0, max_dim),
    )


LAYOUTS = ["N", "T", "sliced", "offset"]


def make_operand(rows: int, cols: int, layout: str, dtype, device, batch=()):
    """A (*batch, rows, cols) operand in the given memory layout, filled with N(0, 1)."""
    if layout == "N":
        return randn(*batch, rows, cols, dtype=dtype, device=device)
    if layout == "T":
        return randn(*batch, cols, rows, dtype=dtype, device=device).mT
    if layout == "sliced":  # every other row, columns from an offset: storage offset + strides > cols
        return randn(*batch, 2 * rows, cols + 3, dtype=dtype, device=device)[..., ::2, 3:]
    n = max(1, rows * cols)
    flat = randn(*batch, n + 7, dtype=dtype, device=device)[..., 7:]  # unaligned storage offset
    return flat.reshape(*batch, n)[..., : rows * cols].reshape(*batch, rows, cols)


@st.composite
def problems(draw, max_dim, max_batch, max_k=None):
    M, N, K = draw(dims(max_dim)), draw(dims(max_dim)), draw(dims(max_k or max_dim))
    kind = draw(st.sampled_from(["2d", "2d", "2d", "vec-mat", "mat-vec", "dot", "batched", "broadcast",
                                 "broadcast3"]))
    la, lb = draw(st.sampled_from(LAYOUTS)), draw(st.sampled_from(LAYOUTS))
    batch_a = batch_b = ()
    if kind == "batched":
        nb = draw(st.integers(1, max_batch))
        batch_a = batch_b = (nb,)
    elif kind == "broadcast":
        nb = draw(st.integers(2, max_batch))
        batch_a, batch_b = draw(st.sampled_from([((nb, 1), (3,)), ((nb,), ()), ((), (nb,)), ((1, 2), (nb, 1))]))
    elif kind == "broadcast3":  # three batch levels that cannot merge (the plan copies for the kernels)
        batch_a, batch_b = (2, 1, 2), (1, draw(st.integers(2, max_batch)), 1)
    return kind, M, N, K, la, lb, batch_a, batch_b


def build(kind, M, N, K, la, lb, batch_a, batch_b, dtype, device):
    if kind == "dot":
        return randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)
    if kind == "vec-mat":
        return randn(K, dtype=dtype, device=device), make_operand(K, N, lb, dtype, device)
    if kind == "mat-vec":
        return make_operand(M, K, la, dtype, device), randn(K, dtype=dtype, device=device)
    return make_operand(M, K, la, dtype, device, batch_a), make_operand(K, N, lb, dtype, device, batch_b)


# "tma-splitk": the TMA kernel forced to a split-K config (three splits: uneven K slices, some empty)
TMA_SPLITK = {"cpu": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_stages": 1, "num_warps": 4,
                      "EPILOGUE_SUBTILE": 0, "SPLIT_K": 3},
              "cuda": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 4,
                       "EPILOGUE_SUBTILE": 0, "SPLIT_K": 3}}


def run_case(case, dtype, device, backend, kernel):
    a, b = build(*case, dtype, device)
    a0, b0 = a.clone(), b.clone()
    config = TMA_SPLITK[device.type] if kernel == "tma-splitk" else None
    kernel = "tma" if kernel == "tma-splitk" else kernel
    with tritonmm.force_backend(backend, kernel, config):
        decision = tritonmm.explain(a, b)
        tri = tritonmm.matmul(a, b)
    note(f"case={case} {dtype} -> {decision}")
    ref = torch.matmul(a, b)
    assert tri.shape == ref.shape and tri.dtype == ref.dtype and tri.is_contiguous()
    if backend == "triton":
        assert decision.backend == "triton", str(decision)
    if kernel == "padded":  # cuBLAS on padded copies wherever a 2-D problem has an unaligned leading dim
        from tritonmm.core import layout, shapes

        p = shapes.plan(a, b)
        if not (p.M and p.N and p.K and p.batch):
            expect = ("triton", "none")  # empty problems launch nothing, whatever is forced
        else:
            expect = ("torch", "padded" if layout.padded_shape(p, a.dtype) is not None else None)
        assert (decision.backend, decision.kernel) == expect, str(decision)
    assert_matches_reference(tri, a, b, what=str(decision))
    assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["tma", "tma-splitk", "pointer", "splitk", "padded", "cublas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@given(case=problems(max_dim=160, max_batch=3, max_k=320))
def test_fuzz_interpreter(case, dtype, kernel):
    if kernel in ("padded", "cublas") and dtype == torch.float16:
        pytest.skip("float16 matmul on CPU is slow; the torch paths are fuzzed in float16 on the GPU")
    if kernel == "cublas":  # forced torch.matmul: the result's shape and layout must still be torch's
        run_case(case, dtype, torch.device("cpu"), "torch", "auto")
    else:
        run_case(case, dtype, torch.device("cpu"), "torch" if kernel == "padded" else "triton", kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,kernel", [("triton", "tma"), ("triton", "tma-splitk"), ("triton", "pointer"),
                                            ("triton", "splitk"),
                                            ("torch", "padded"), ("auto", "auto")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@given(case=problems(max_dim=4096, max_batch=4))
def test_fuzz_gpu(case, dtype, backend, kernel, monkeypatch):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")  # heuristic configs: fuzz the kernels, not the tuner
    kind, M, N, K, *_ = case
    if M * N * K > 2**31:  # keep one example under ~0.1 s of float64 reference work
        case = (kind, min(M, 1024), N, min(K, 1024), *case[4:])
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # float32 takes the kernel only where torch.matmul uses TF32
    try:
        run_case(case, dtype, torch.device("cuda"), backend, kernel)
    finally:
        torch.set_float32_matmul_precision(old)
