"""torch.matmul semantics of tritonmm.matmul, through each Triton kernel (interpreted on CPU)."""

import pytest
import torch

import tritonmm
from tritonmm.core.reference import assert_matches_reference, randn

pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KERNELS = ["tma", "pointer", "splitk"]


def _dt(dtype):
    return str(dtype).removeprefix("torch.")


def _check(a, b, kernel="auto"):
    a0, b0 = a.clone(), b.clone()
    with tritonmm.force_backend("triton", kernel):
        decision = tritonmm.explain(a, b)
        tri = tritonmm.matmul(a, b)
    ref = torch.matmul(a, b)
    assert decision.backend == "triton", str(decision)
    assert tri.shape == ref.shape and tri.dtype == ref.dtype and tri.device == ref.device
    assert tri.is_contiguous()
    assert_matches_reference(tri, a, b, what=str(decision))
    assert torch.equal(a, a0) and torch.equal(b, b0), "inputs were modified"
    return decision


# (a shape, b shape): every rank combination torch.matmul accepts
RANK_CASES = [
    ((37,), (37,)),
    ((37,), (37, 19)),
    ((23, 37), (37,)),
    ((23, 37), (37, 19)),
    ((3, 23, 37), (37,)),
    ((37,), (3, 37, 19)),
    ((3, 23, 37), (37, 19)),
    ((23, 37), (3, 37, 19)),
    ((2, 3, 23, 37), (3, 37, 19)),
    ((2, 1, 23, 37), (1, 4, 37, 19)),
    ((5, 1, 2, 17, 9), (3, 1, 9, 11)),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shapes", RANK_CASES, ids=lambda s: f"{'x'.join(map(str, s[0]))}@{'x'.join(map(str, s[1]))}")
def test_ranks_and_broadcasting(shapes, kernel):
    a, b = randn(*shapes[0]), randn(*shapes[1])
    _check(a, b, kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mnk", [(127, 61, 89), (1, 67, 131), (64, 64, 64), (5, 3, 2), (33, 200, 17)],
                         ids=lambda s: "M{}-N{}-K{}".format(*s))
def test_2d_dtypes(mnk, kernel, dtype):
    M, N, K = mnk
    _check(randn(M, K, dtype=dtype), randn(K, N, dtype=dtype), kernel)


LAYOUTS = {
    "NN": lambda M, N, K, dt: (randn(M, K, dtype=dt), randn(K, N, dtype=dt)),
    "TN": lambda M, N, K, dt: (randn(K, M, dtype=dt).mT, randn(K, N, dtype=dt)),
    "NT": lambda M, N, K, dt: (randn(M, K, dtype=dt), randn(N, K, dtype=dt).mT),
    "TT": lambda M, N, K, dt: (randn(K, M, dtype=dt).mT, randn(N, K, dtype=dt).mT),
    "sliced": lambda M, N, K, dt: (randn(2 * M, K + 3, dtype=dt)[::2, 3:], randn(K, 2 * N + 1, dtype=dt)[:, 1::2]),
    "offset": lambda M, N, K, dt: (randn(M * K + 5, dtype=dt)[5:].view(M, K), randn(K + 1, N, dtype=dt)[1:]),
    "aligned-T": lambda M, N, K, dt: (randn(K, 96, dtype=dt).mT[:M], randn(32, 64, dtype=dt).mT[:K, :N]),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_dt)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_read_in_place(layout, kernel, dtype):
    M, N, K = 45, 29, 53
    if layout == "aligned-T":
        M, N, K = 80, 24, 40
    a, b = LAYOUTS[layout](M, N, K, dtype)
    _check(a, b, kernel)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_stride0_broadcast_batches(kernel):
    a = randn(1, 21, 13).expand(6, 21, 13)  # stride-0 batch
    b = randn(6, 13, 1).expand(6, 13, 17)  # stride-0 column
    d = _check(a, b, kernel)
    assert d.kernel == "pointer"


def test_batch_fold_and_levels():
    from tritonmm.core.shapes import plan

    a = randn(4, 5, 21, 13)
    p = plan(a, randn(13, 9))
    assert (p.batch, p.M) == (1, 4 * 5 * 21)  # folded into one GEMM, no copy
    assert p.a4.data_ptr() == a.data_ptr()
    p = plan(a.transpose(0, 1), randn(13, 9))  # cannot fold: two batch levels, still views
    assert p.batch == 20 and p.M == 21 and p.a4.data_ptr() == a.data_ptr()
    p = plan(randn(2, 1, 7, 3).expand(2, 5, 7, 3), randn(5, 3, 4))
    assert p.batch == 10 and p.a4.stride(1) == 0


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "shapes",
    [((0, 5), (5, 7)), ((5, 0), (0, 7)), ((5, 3), (3, 0)), ((0,), (0,)), ((2, 0, 4), (4, 3)), ((0, 3, 4), (4, 5)),
     ((3, 0), (0,)), ((0,), (0, 6))],
    ids=str,
)
def test_zero_size(shapes, kernel):
    a, b = randn(*shapes[0]), randn(*shapes[1])
    with tritonmm.force_backend("triton", kernel):
        d = tritonmm.explain(a, b)
        tri = tritonmm.matmul(a, b)
    ref = torch.matmul(a, b)
    assert d.kernel == "none"
    assert tri.shape == ref.shape and tri.dtype == ref.dtype
    torch.testing.assert_close(tri, ref)  # K = 0 gives zeros, not NaN


def test_dot_is_0d():
    a, b = randn(50), randn(50)
    with tritonmm.force_backend("triton"):
        tri = tritonmm.matmul(a, b)
    assert tri.dim() == 0
    assert_matches_reference(tri, a, b)


def test_large_values_and_nan_inf_positions():
    a, b = randn(40, 30), randn(30, 20)
    a[3, 4] = float("nan")
    b[5, 6] = float("inf")
    with tritonmm.force_backend("triton", "pointer"):
        tri = tritonmm.matmul(a, b)
    ref = torch.matmul(a, b)
    assert torch.equal(tri.isnan(), ref.isnan())
    assert torch.equal(tri.isinf(), ref.isinf())
    finite = ref.isfinite()
    torch.testing.assert_close(tri[finite], ref[finite], rtol=1e-4, atol=1e-4)


def test_float16_overflow_is_inf():
    a = torch.full((16, 32), 100.0, dtype=torch.float16)
    b = torch.full((32, 16), 100.0, dtype=torch.float16)  # 32 * 1e4 = 3.2e5 > 65504
    with tritonmm.force_backend("triton", "pointer"):
        tri = tritonmm.matmul(a, b)
    assert torch.isinf(tri).all() and (tri > 0).all()


def test_repeatable_bitwise():
    a, b = randn(70, 90, dtype=torch.bfloat16), randn(90, 50, dtype=torch.bfloat16)
    with tritonmm.force_backend("triton", "splitk"):
        first = tritonmm.matmul(a, b)
        assert all(torch.equal(first, tritonmm.matmul(a, b)) for _ in range(2))
