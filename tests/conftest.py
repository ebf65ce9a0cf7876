"""Shared test setup: interpreter on CPU machines, the `gpu` marker, hypothesis profiles, NaN poisoning."""

import os
import tempfile

import torch

# the tests decide with the shipped tables only, whatever this machine has tuned for its own models
os.environ["TRITONMM_TUNED_DIR"] = tempfile.mkdtemp(prefix="tritonmm-tuned-")
os.environ["TRITONMM_FIRST_SIGHT"] = "0"  # and measure nothing on first sight (tests that do turn it on)

if not torch.cuda.is_available():
    # before anything imports triton: kernels run on CPU tensors through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import tritonmm  # noqa: E402,F401
from tritonmm.dispatch import gated, gated_cublas, norm_linear, runners  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=40, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "gpu", derandomize=False, deadline=None, max_examples=20, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile("dev", deadline=None, max_examples=15)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; run on the H200)")
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors (TRITON_INTERPRET=1)")
    config.addinivalue_line("markers", "slow: fuzz, build and soak tests, deselected by default (pyproject's addopts); "
                                       "pytest -m slow runs them, and bash .ci/run runs them after the others")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (CPU tensors through the Triton interpreter)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRETING:
            item.add_marker(skip_interp)


def _nan_empty(*args, **kwargs):
    out = torch.empty(*args, **kwargs)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    return out


@pytest.fixture
def tf32_on_cuda():
    """On a GPU, float32 reaches the padded path only where TF32 is allowed (else cuBLAS keeps full
    fp32 and tritonmm calls torch.matmul as it is), as in the benchmark; CPU runs are left as they are."""
    old = torch.get_float32_matmul_precision()
    if HAS_CUDA:
        torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture(autouse=True)
def nan_poisoned_outputs(monkeypatch):
    """Every output the Triton path allocates starts as NaN: an unwritten tile fails loudly."""
    monkeypatch.setattr(runners, "alloc", _nan_empty)
    monkeypatch.setattr(gated, "_empty", _nan_empty)
    monkeypatch.setattr(gated_cublas, "_empty", _nan_empty)
    monkeypatch.setattr(norm_linear, "_empty", _nan_empty)
    yield


@pytest.fixture(autouse=True)
def seeded(request):
    """Each test draws the same data every run (seeded from its id), different data from other tests."""
    import zlib

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture
def device():
    """The device the kernels run on here: CUDA on a GPU machine, CPU (interpreted) otherwise."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")
