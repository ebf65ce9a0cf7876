"""Reliability on any machine (CPU: kernels through the interpreter): what torch.matmul does, or its error.

Unsupported inputs are served by torch, failing kernels fall back with one warning, inputs are
never modified, state files are validated data written atomically, sizes at the edges are exact.
GPU-only behaviour (streams, graphs, threads, memory, several GPUs) is in test_gpu_reliability.py.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.core import workspace
from tritonmm.core.reference import assert_matches_reference, randn
from tritonmm.dispatch import runners, tables
from tritonmm.dispatch.runners import KernelFailedWarning

KERNELS = ["pointer", "splitk", "tma"]
ENTRIES = [("tritonmm.matmul", tritonmm.matmul), ("op", lambda a, b: torch.ops.tritonmm.matmul(a, b))]


def _same_outcome(fn, ref, *args):
    """fn(*args) returns exactly torch's result, or raises torch's exception type."""
    try:
        expected = ref(*args)
    except Exception as exc:  # noqa: BLE001 - whatever torch raises, we must raise the same type
        with pytest.raises(type(exc)):
            fn(*args)
        return None
    got = fn(*args)
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.layout == expected.layout
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    return got


# --------------------------------------------------------------------------- inputs torch serves itself


@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.uint8, torch.complex64,
                                   torch.complex128, torch.bool], ids=str)
def test_unsupported_dtypes_get_torch_matmul_result(dtype, entry):
    a = (randn(5, 7, dtype=torch.float64) * 3).to(dtype)
    b = (randn(7, 3, dtype=torch.float64) * 3).to(dtype)
    a0, b0 = a.clone(), b.clone()
    _same_outcome(entry[1], torch.matmul, a, b)
    assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_sparse_operand_served_by_torch(layout, entry):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        a = randn(6, 8) * (torch.rand(6, 8) > 0.5)
        sa = a.to_sparse() if layout == "coo" else a.to_sparse_csr()
        b = randn(8, 5)
        got = entry[1](sa, b)
    torch.testing.assert_close(got, torch.matmul(sa, b), rtol=0, atol=0)


def test_sparse_linear_served_by_torch():
    x, w, bias = randn(4, 8), randn(6, 8), randn(6)
    sx = x.to_sparse()
    torch.testing.assert_close(tritonmm.linear(sx, w, bias), F.linear(sx, w, bias), rtol=0, atol=0)
    torch.testing.assert_close(tritonmm.linear(sx, w, bias, "relu"), F.relu(F.linear(sx, w, bias)), rtol=0, atol=0)


def test_quantized_operands_raise_like_torch():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor is deprecated
        a = torch.quantize_per_tensor(randn(4, 4), 0.1, 0, torch.quint8)
        b = torch.quantize_per_tensor(randn(4, 4), 0.1, 0, torch.quint8)
    for _, fn in ENTRIES:
        _same_outcome(fn, torch.matmul, a, b)


@pytest.mark.parametrize("kernel", KERNELS)
def test_inference_mode_with_requires_grad_inputs(kernel):
    a = randn(33, 40).requires_grad_()
    b = randn(40, 17).requires_grad_()
    with torch.inference_mode(), tritonmm.force_backend("triton", kernel):
        got = tritonmm.matmul(a, b)
        via_op = torch.ops.tritonmm.matmul(a, b)
        ref = torch.matmul(a, b)
    assert not got.requires_grad and not via_op.requires_grad and got.is_inference() == ref.is_inference()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(via_op, got, rtol=0, atol=0)


def test_inference_tensors_refused_for_backward_like_torch():
    with torch.inference_mode():
        a = randn(8, 8)
    b = randn(8, 8).requires_grad_()
    _same_outcome(tritonmm.matmul, torch.matmul, a, b)
    _same_outcome(lambda x, w: tritonmm.linear(x, w), F.linear, a, b)


# --------------------------------------------------------------------------- inputs never modified


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_inputs_never_modified(kernel, op):
    """Operands (odd strides, unaligned rows that the TMA path copies), bias: bit-identical afterwards."""
    a = randn(37, 53)[:, 1:50]  # unaligned, non-contiguous view of a larger buffer
    w = randn(29, 49).t() if op == "matmul" else randn(29, 49)
    bias = randn(29)
    before = [t.clone() for t in (a, w, bias)]
    base_before = a._base.clone()
    with tritonmm.force_backend("triton", kernel):
        if op == "matmul":
            tritonmm.matmul(a, w)
        else:
            tritonmm.linear(a, w, bias, "gelu")
    for t, t0 in zip((a, w, bias), before):
        assert torch.equal(t, t0)
    assert torch.equal(a._base, base_before)


# --------------------------------------------------------------------------- failures inside Triton


BAD_CONFIG = {"BLOCK_M": 3, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_stages": 1, "num_warps": 4}


@pytest.mark.interpreter  # Triton on CPU tensors
def test_failing_config_falls_back_to_torch_with_one_warning():
    """A config Triton cannot compile (BLOCK_M = 3: tl.arange needs a power of 2): one warning, torch's result."""
    a, b = randn(40, 24), randn(24, 20)
    a0, b0 = a.clone(), b.clone()
    with tritonmm.force_backend("triton", "pointer", config=BAD_CONFIG):
        with pytest.warns(KernelFailedWarning, match="pointer kernel failed"):
            got = tritonmm.matmul(a, b)
        torch.testing.assert_close(got, torch.matmul(a, b), rtol=0, atol=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the geometry now goes to torch directly: no second warning
            again = tritonmm.matmul(a, b)
        decision = tritonmm.explain(a, b)
    assert torch.equal(again, got) and torch.equal(a, a0) and torch.equal(b, b0)
    assert decision.backend == "torch" and "failed" in decision.reason


@pytest.mark.interpreter  # Triton on CPU tensors
def test_failure_inside_autotuning_falls_back(monkeypatch):
    """If every config fails (Triton raises from the autotuner / launch), the call is served by torch."""
    from triton.runtime.errors import OutOfResources

    from tritonmm.kernels import launch, launchers

    def no_config_runs(*args, **kwargs):
        raise OutOfResources(300000, 232448, "shared memory")

    for module in (launch, launchers):
        monkeypatch.setattr(module, "_matmul_kernel",
                            type("K", (), {"__getitem__": lambda self, grid: no_config_runs})())
    x, w, bias = randn(20, 30), randn(10, 30), randn(10)
    with tritonmm.force_backend("triton", "pointer"), pytest.warns(KernelFailedWarning, match="OutOfResources"):
        got = tritonmm.linear(x, w, bias, "silu")
    torch.testing.assert_close(got, F.silu(F.linear(x, w, bias)), rtol=0, atol=0)


@pytest.mark.interpreter  # Triton on CPU tensors
def test_other_errors_are_not_swallowed(monkeypatch):
    """Only Triton's compile/resource failures fall back; a bug elsewhere still raises."""
    from tritonmm.kernels import launch, launchers

    def broken(*args, **kwargs):
        raise ZeroDivisionError("bug")

    for module in (launch, launchers):
        monkeypatch.setattr(module, "_matmul_kernel", type("K", (), {"__getitem__": lambda self, grid: broken})())
    with tritonmm.force_backend("triton", "pointer"), pytest.raises(ZeroDivisionError):
        tritonmm.matmul(randn(9, 9), randn(9, 9))


# --------------------------------------------------------------------------- sizes at the edges


ZERO_CASES = [((0, 5), (5, 3)), ((4, 0), (0, 3)), ((4, 5), (5, 0)), ((0, 0), (0, 0)), ((0, 4, 5), (5, 3)),
              ((2, 0, 5), (2, 5, 3)), ((3, 4, 0), (3, 0, 2)), ((0,), (0,)), ((0,), (0, 4)), ((3, 0), (0,)),
              ((4, 0, 2, 3), (1, 3, 5))]


@pytest.mark.parametrize("sa,sb", ZERO_CASES, ids=str)
def test_every_zero_size_case(sa, sb):
    a, b = randn(*sa), randn(*sb)
    ref = torch.matmul(a, b)
    for kernel in ["auto", *KERNELS]:
        with tritonmm.force_backend("triton", kernel):
            got = tritonmm.matmul(a, b)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias_shape", [None, (), (1,), (6,)], ids=str)
def test_linear_with_k_zero_is_activation_of_bias(bias_shape, activation):
    x, w = randn(3, 4, 0), randn(6, 0)
    bias = None if bias_shape is None else randn(*bias_shape)
    ref = F.linear(x, w, bias)
    ref = {"none": ref, "relu": F.relu(ref), "gelu": F.gelu(ref), "silu": F.silu(ref),
           "gelu_tanh": F.gelu(ref, approximate="tanh")}[activation]
    # torch's vectorized and scalar activation loops differ in the last bit: default fp32 tolerance
    torch.testing.assert_close(tritonmm.linear(x, w, bias, activation), ref)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["pointer", "splitk"])
def test_k_in_the_hundreds_of_thousands(kernel):
    M, N, K = 2, 3, 200_003
    a, b = randn(M, K), randn(K, N)
    with tritonmm.force_backend("triton", kernel):
        got = tritonmm.matmul(a, b)
    assert_matches_reference(got, a, b)


def test_m1_with_wide_n():
    a, b = randn(1, 16), randn(16, 5003)
    with tritonmm.force_backend("triton", "pointer"):
        got = tritonmm.matmul(a, b)
    assert_matches_reference(got, a, b)


def test_many_batches():
    """A batch grid axis of hundreds of programs here (tens of thousands in the gpu test)."""
    a, b = randn(300, 2, 3), randn(300, 3, 2)
    with tritonmm.force_backend("triton", "pointer"):
        got = tritonmm.matmul(a, b)
    assert_matches_reference(got, a, b)


# --------------------------------------------------------------------------- determinism across processes

_HASH_SCRIPT = """
import hashlib, torch, tritonmm
from tritonmm.core.reference import randn
torch.manual_seed(1234)
a, b = randn(70, 90, dtype=torch.float16), randn(90, 50, dtype=torch.float16)
with tritonmm.force_backend("triton", "{kernel}"):
    out = tritonmm.matmul(a, b)
print(hashlib.sha256(out.contiguous().view(torch.int16).numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", KERNELS)
def test_bit_identical_across_processes(kernel):
    script = _HASH_SCRIPT.format(kernel=kernel)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
            for _ in range(2)]
    digests = {r.stdout.strip().splitlines()[-1] for r in runs}
    namespace: dict = {}
    import hashlib

    torch.manual_seed(1234)
    a, b = randn(70, 90, dtype=torch.float16), randn(90, 50, dtype=torch.float16)
    with tritonmm.force_backend("triton", kernel):
        out = tritonmm.matmul(a, b)
    namespace["here"] = hashlib.sha256(out.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
    assert digests == {namespace["here"]}


# --------------------------------------------------------------------------- workspace


def test_workspace_is_reused_and_bounded():
    workspace.release()
    first = workspace.buffers(torch.device("cpu"), [((4, 5), torch.float32), ((3,), torch.float16)])
    again = workspace.buffers(torch.device("cpu"), [((2, 2), torch.float32)])
    assert again[0].data_ptr() == first[0].data_ptr()  # same buffer, no new allocation
    assert (first[1].data_ptr() - first[0].data_ptr()) % 256 == 0 and first[1].shape == (3,) and first[1].dtype == torch.float16
    big = workspace.WORKSPACE_MAX // 4 + 1
    before = workspace.held_bytes()
    workspace.buffers(torch.device("cpu"), [((big,), torch.float32)])  # over the cap: not kept
    assert workspace.held_bytes() == before
    workspace.release()
    assert workspace.held_bytes() == 0


def test_workspace_views_are_cached_and_follow_the_buffer():
    import gc
    import weakref

    cpu = torch.device("cpu")
    workspace.release()
    specs = [((4, 5), torch.float32), ((3,), torch.float16)]
    first = workspace.buffers(cpu, specs)
    again = workspace.buffers(cpu, [([4, 5], torch.float32), (torch.Size([3]), torch.float16)])  # same request
    assert [t is u for t, u in zip(first, again)] == [True, True] and again is not first  # a fresh list
    again.pop(0)  # callers pop from the list: the cache keeps its own
    assert [t.shape for t in workspace.buffers(cpu, specs)] == [(4, 5), (3,)]
    other = workspace.buffers(cpu, [((2, 2), torch.float32)])  # another request: its own views, same memory
    assert other[0].shape == (2, 2) and other[0].data_ptr() == first[0].data_ptr()
    old = weakref.ref(first[0])
    grown = workspace.buffers(cpu, [((1 << 16,), torch.float32)])  # the buffer grows: older views are dropped
    del first, again, other
    gc.collect()
    assert old() is None  # the cache no longer keeps the smaller buffer alive
    fresh = workspace.buffers(cpu, specs)
    assert fresh[0].data_ptr() == grown[0].data_ptr() and fresh[0].shape == (4, 5)
    fresh[0].fill_(1.0)
    assert grown[0][:20].eq(1.0).all()  # views of the current buffer
    workspace.release()
    assert workspace.buffers(cpu, specs)[0] is not fresh[0]  # release forgets the views too
    workspace.release()


def test_workspace_is_per_thread():
    import threading

    ptrs = {}
    both_alive = threading.Barrier(2)

    def grab(i):
        first = workspace.buffers(torch.device("cpu"), [((64,), torch.float32)])[0].data_ptr()
        again = workspace.buffers(torch.device("cpu"), [((64,), torch.float32)])[0].data_ptr()
        both_alive.wait()  # both threads hold their buffers now (a dead thread's buffer could be reused)
        ptrs[i] = (first, again)
        both_alive.wait()

    threads = [threading.Thread(target=grab, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ptrs[0][0] == ptrs[0][1] and ptrs[1][0] == ptrs[1][1]  # reused within a thread
    assert ptrs[0][0] != ptrs[1][0]  # never shared between threads


def test_engine_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(runners, "CACHE_MAX", 8)
    tritonmm.clear_cache()
    for n in range(1, 30):
        tritonmm.matmul(randn(2, n), randn(n, 2))
        assert len(runners._cache) <= 8


# --------------------------------------------------------------------------- state files


def _valid_entry(**over):
    e = {"backend": "triton", "kernel": "pointer", "torch_us": 10.0, "triton_us": 5.0,
         "config": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_stages": 3, "num_warps": 4}}
    e.update(over)
    return e


@pytest.mark.parametrize("entry", [
    _valid_entry(kernel="wgmma"),
    _valid_entry(config={"BLOCK_M": "__import__('os').system('touch /tmp/pwned')"}),
    _valid_entry(config={"BLOCK_M": 64}),
    _valid_entry(backend="numpy"),
    _valid_entry(torch_us="fast"),
    "not a dict",
], ids=["kernel", "code-in-config", "missing-fields", "backend", "timing", "not-dict"])
def test_malformed_entries_reject_the_table_with_a_warning(tmp_path, entry):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tables.FORMAT, "entries": {"bfloat16:64:64:64:nn": entry}}))
    with pytest.warns(RuntimeWarning, match="ignoring tuned table"):
        assert tables.read_table(path) is None
    assert not os.path.exists("/tmp/pwned")


def test_valid_entry_accepted(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tables.FORMAT, "entries": {"bfloat16:64:64:64:nn": _valid_entry()}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tables.read_table(path)["entries"]["bfloat16:64:64:64:nn"]["kernel"] == "pointer"


def test_unreadable_table_warns(tmp_path):
    path = tmp_path / "dir.json"
    path.mkdir()  # reading a directory fails like an unreadable file (root ignores chmod)
    with pytest.warns(RuntimeWarning, match="ignoring tuned table"):
        assert tables.read_table(path) is None


_WRITER = """
import json, pathlib, sys
from tritonmm.dispatch import tables, tuned
path, me = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for i in range(40):
    table = {"format": tables.FORMAT, "writer": me, "i": i, "entries": {}, "pad": "x" * (200000 + 1000 * me)}
    tables.atomic_write_text(path, json.dumps(table))
"""


@pytest.mark.slow
def test_concurrent_writers_never_corrupt_the_table(tmp_path):
    path = tmp_path / "table.json"
    tables.atomic_write_text(path, json.dumps({"format": tables.FORMAT, "entries": {}}))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(k)]) for k in range(4)]
    reads = 0
    while any(p.poll() is None for p in procs):
        data = json.loads(path.read_text())  # never half a file
        assert data["format"] == tables.FORMAT
        reads += 1
    assert all(p.returncode == 0 for p in procs) and reads > 0
    final = json.loads(path.read_text())
    assert final["i"] == 39 and len(final["pad"]) == 200000 + 1000 * final["writer"]
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]  # no temporary files left


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_outputs_are_correctly_rounded(kernel, dtype):
    """One rounding of an fp32 accumulator: nearly every output equals the float64 product rounded once
    (only fp32 summation order can move a value across a rounding boundary)."""
    a, b = randn(128, 96, dtype=dtype), randn(96, 512, dtype=dtype)
    with tritonmm.force_backend("triton", kernel):
        got = tritonmm.matmul(a, b)
    exact = torch.matmul(a.double(), b.double()).to(dtype)
    assert (got != exact).float().mean().item() < 0.01
