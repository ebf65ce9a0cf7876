"""Reliability on the GPU: other devices, streams, CUDA graphs, threads, memory, extreme sizes.

Run on the H200 with ``-m gpu`` (the two-GPU tests need the nvidia-h200-x2 kind; skipped with one GPU).
"""

import gc
import random
import threading

import pytest
import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.core import device as _device
from tritonmm.core import workspace
from tritonmm.core.reference import assert_matches_reference, randn
from tritonmm.dispatch import runners
from tritonmm.dispatch.runners import KernelFailedWarning

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# one problem per Triton path (2-D TMA in place, TMA on aligned copies, pointer, split-K, batched pointer)
PATHS = {
    "tma": ((512, 384), (384, 640), "tma"),
    "tma-copies": ((515, 383), (383, 641), "tma"),
    "pointer": ((300, 200), (200, 130), "pointer"),
    "splitk": ((16, 4096), (4096, 512), "splitk"),
    "batched": ((6, 100, 72), (6, 72, 90), "pointer"),
}
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")


def _operands(case, device="cuda", dtype=BF16):
    sa, sb, kernel = PATHS[case]
    return randn(*sa, dtype=dtype, device=device), randn(*sb, dtype=dtype, device=device), kernel


# --------------------------------------------------------------------------- devices and streams


@two_gpus
@pytest.mark.parametrize("case", list(PATHS))
def test_tensors_on_a_gpu_other_than_the_current_one(case):
    a, b, kernel = _operands(case, device="cuda:1")
    assert torch.cuda.current_device() == 0
    with tritonmm.force_backend("triton", kernel):
        got = tritonmm.matmul(a, b)
    torch.cuda.synchronize(1)
    assert got.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    assert_matches_reference(got, a, b)


@pytest.mark.parametrize("devices", [("cuda", "cpu"), ("cpu", "cuda")], ids=str)
def test_a_cuda_and_a_cpu_operand_raise_like_torch(devices):
    a, b = randn(8, 8, device=devices[0]), randn(8, 8, device=devices[1])
    for fn, ref in ((tritonmm.matmul, torch.matmul), (tritonmm.linear, F.linear)):
        with pytest.raises(RuntimeError) as want:
            ref(a, b)
        with pytest.raises(type(want.value), match="cuda.*cpu|cpu.*cuda"):
            fn(a, b)


@two_gpus
def test_mixed_gpus_raise_like_torch():
    a, b = randn(8, 8, device="cuda:0"), randn(8, 8, device="cuda:1")
    with pytest.raises(RuntimeError) as ref:
        torch.matmul(a, b)
    with pytest.raises(type(ref.value), match="cuda:0.*cuda:1|cuda:1.*cuda:0"):
        tritonmm.matmul(a, b)


@pytest.mark.parametrize("case", list(PATHS))
def test_non_default_stream_orders_with_the_callers_work(case):
    """Inputs produced on a side stream and consumed there: the kernel runs after them, in order."""
    a0, b0, kernel = _operands(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), tritonmm.force_backend("triton", kernel):
        torch.cuda._sleep(20_000_000)  # delay the side stream: a launch on another stream would race ahead
        a = a0 * 2  # produced on the side stream
        got = tritonmm.matmul(a, b0)
        ref = torch.matmul(a.double(), b0.double())
    side.synchronize()
    assert_matches_reference(got, a0 * 2, b0)
    assert got.device.type == "cuda" and ref.shape == got.shape


@pytest.mark.parametrize("case", list(PATHS))
def test_cuda_graph_capture_and_replay(case):
    a, b, kernel = _operands(case)
    with tritonmm.force_backend("triton", kernel):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compile, autotune) outside capture, as torch.cuda.graph asks
            eager = tritonmm.matmul(a, b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tritonmm.matmul(a, b)
        for _ in range(2):
            a.copy_(randn(*a.shape, dtype=a.dtype, device="cuda"))
            graph.replay()
            torch.cuda.synchronize()
            assert_matches_reference(static_out, a, b)
            assert torch.equal(static_out, tritonmm.matmul(a, b))  # replay == eager, bit for bit
    assert eager.shape == static_out.shape


def test_first_launch_inside_capture_uses_a_fixed_config():
    """No warm-up: an untuned launcher picks the heuristic config in capture (autotuning cannot run there)."""
    a, b = randn(520, 264, dtype=BF16, device="cuda"), randn(264, 392, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", "pointer"):
        torch.matmul(a, b)  # warm cuBLAS etc.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # compile the kernel binary for this specialization first
            from tritonmm.kernels import configs as cfg
            from tritonmm.kernels import launchers as km

            config = cfg.heuristic("pointer", 520, 392, 264, 2, 2, _device.smem_limit(a.device), _device.num_sms(a.device))
            km.launch_pointer(a[None, None], b[None, None], torch.empty(1, 1, 520, 392, dtype=BF16, device="cuda"),
                              config=config)
        torch.cuda.synchronize()
        tritonmm.clear_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tritonmm.matmul(a, b)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, a, b)
        assert torch.equal(out, tritonmm.matmul(a, b))


def test_compile_reduce_overhead_matches_eager():
    """torch.compile's CUDA-graph mode over both ops: replays give eager's result."""
    x = randn(64, 512, dtype=BF16, device="cuda")
    w1, w2 = randn(512, 384, dtype=BF16, device="cuda"), randn(256, 384, dtype=BF16, device="cuda")
    bias = randn(256, dtype=BF16, device="cuda")

    def f(x):
        return tritonmm.linear(tritonmm.matmul(x, w1), w2, bias, "gelu")

    with tritonmm.force_backend("triton"):
        eager = f(x)
        compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
        outs = [compiled(x).clone() for _ in range(4)]  # warm-up runs, then graph replays
        torch.cuda.synchronize()
    for got in outs:
        assert torch.equal(got, eager)


# --------------------------------------------------------------------------- threads and autotuning


def test_threads_with_different_shapes_while_autotuning(monkeypatch):
    """8 threads, each a fresh shape per kernel (so autotuning runs concurrently); each result is
    right and equal, bit for bit, to the same call made afterwards."""
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "1")
    rng = random.Random(7)
    jobs = []
    for t in range(8):
        kernel = ["tma", "pointer", "splitk"][t % 3]
        M = 16 if kernel == "splitk" else rng.randrange(200, 700)
        jobs.append((kernel, M, rng.randrange(130, 600), rng.randrange(1100, 3000)))
    results, errors = {}, []

    def work(i, kernel, M, N, K):
        try:
            gen = torch.Generator(device="cuda").manual_seed(i)
            a = torch.randn(M, K, device="cuda", generator=gen).to(BF16)
            b = torch.randn(K, N, device="cuda", generator=gen).to(BF16)
            with tritonmm.force_backend("triton", kernel):
                out = tritonmm.matmul(a, b)
            torch.cuda.current_stream().synchronize()
            results[i] = (a, b, kernel, out)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and len(results) == len(jobs)
    for a, b, kernel, out in results.values():
        assert_matches_reference(out, a, b)
        with tritonmm.force_backend("triton", kernel):
            assert torch.equal(out, tritonmm.matmul(a, b))


def test_first_autotuning_call_leaves_no_trace(monkeypatch):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "1")
    a, b = randn(777, 1031, dtype=BF16, device="cuda"), randn(1031, 513, dtype=BF16, device="cuda")
    a0, b0 = a.clone(), b.clone()
    workspace.release()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with tritonmm.force_backend("triton", "pointer"):
        first = tritonmm.matmul(a, b)
        torch.cuda.synchronize()
        after_first = torch.cuda.memory_allocated()
        later = [tritonmm.matmul(a, b) for _ in range(3)]
    assert all(torch.equal(first, x) for x in later)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    kept = after_first - before - first.untyped_storage().nbytes()
    assert 0 <= kept < 512  # only the output stays allocated (the allocator rounds to 512 bytes)


# --------------------------------------------------------------------------- memory


def _peak_over_baseline(fn):
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


@pytest.mark.parametrize("case", list(PATHS))
def test_peak_memory_no_more_than_torch_plus_output(case):
    a, b, kernel = _operands(case)
    with tritonmm.force_backend("triton", kernel):
        tritonmm.matmul(a, b)  # warm-up: compile, autotune, workspace
        torch.matmul(a, b)
        ours, out = _peak_over_baseline(lambda: tritonmm.matmul(a, b))
    theirs, _ = _peak_over_baseline(lambda: torch.matmul(a, b))
    assert ours <= theirs + out.untyped_storage().nbytes() + 512, (ours, theirs)  # 512: allocator rounding


def test_no_memory_growth_over_10000_calls(monkeypatch):
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")  # heuristic configs: 10k calls in seconds
    rng = random.Random(3)
    shapes = [(rng.choice([1, 7, 64, 130, 257]), rng.choice([64, 96, 200]), rng.choice([32, 128, 1100]))
              for _ in range(40)]
    tensors = {s: (randn(s[0], s[2], dtype=BF16, device="cuda"), randn(s[2], s[1], dtype=BF16, device="cuda"))
               for s in shapes}
    kernels = ["auto", "pointer", "splitk", "tma"]

    def calls(n):
        for i in range(n):
            a, b = tensors[shapes[i % len(shapes)]]
            with tritonmm.force_backend("triton" if i % 2 else "auto", kernels[i % 4] if i % 2 else "auto"):
                tritonmm.matmul(a, b)

    calls(400)  # every geometry seen once: compiled, planned, workspaces sized
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    calls(10_000)
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() == before
    assert len(runners._cache) <= runners.CACHE_MAX


# --------------------------------------------------------------------------- extreme sizes


@pytest.fixture
def heuristic_configs(monkeypatch):
    """Extreme sizes take the quantization heuristic's config: autotuning them would cost minutes."""
    monkeypatch.setenv("TRITONMM_AUTOTUNE", "0")


def test_operand_past_2_31_elements_exact_at_the_far_end(heuristic_configs):
    M, K, N = 65_600, 32_768, 64  # A has 2.15e9 elements (> 2**31)
    a = torch.empty(M, K, dtype=BF16, device="cuda").normal_()
    b = randn(K, N, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", "pointer"):
        out = tritonmm.matmul(a, b)
    rows = torch.tensor([0, 1, M // 2, M - 2, M - 1], device="cuda")
    assert_matches_reference(out[rows], a[rows], b)
    del a, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kernel", ["auto", "splitk", "pointer"])
def test_k_in_the_hundreds_of_thousands_gpu(kernel, heuristic_configs):
    a, b = randn(64, 300_000, dtype=BF16, device="cuda"), randn(300_000, 64, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", kernel):
        assert_matches_reference(tritonmm.matmul(a, b), a, b)


def test_m1_with_huge_n(heuristic_configs):
    a, b = randn(1, 128, dtype=BF16, device="cuda"), randn(128, 2_000_003, dtype=BF16, device="cuda")
    for kernel in ["auto", "pointer"]:
        with tritonmm.force_backend("triton", kernel):
            assert_matches_reference(tritonmm.matmul(a, b), a, b)


def test_tens_of_thousands_of_batches(heuristic_configs):
    a, b = randn(50_000, 4, 24, dtype=BF16, device="cuda"), randn(50_000, 24, 8, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", "pointer"):
        got = tritonmm.matmul(a, b)
    assert_matches_reference(got, a, b)
    a3, b3 = a.view(250, 200, 4, 24), b[:200]  # broadcast batch: (250, 200) x (200,)
    with tritonmm.force_backend("triton", "pointer"):
        assert_matches_reference(tritonmm.matmul(a3, b3), a3, b3)


# --------------------------------------------------------------------------- numerics on the GPU


@pytest.mark.parametrize("case", list(PATHS))
def test_nan_inf_positions_and_fp16_overflow(case):
    a, b, kernel = _operands(case, dtype=torch.float16)
    a[..., 3, 5] = float("nan")
    b[..., 7, 2] = float("inf")
    a[..., 10, :] = 300.0  # row 10 times a positive column overflows float16
    b[..., :, 11] = 300.0
    with tritonmm.force_backend("triton", kernel):
        got = tritonmm.matmul(a, b)
    ref = torch.matmul(a, b)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.isposinf(), ref.isposinf()) and torch.equal(got.isneginf(), ref.isneginf())
    assert got[..., 10, 11].isinf().all()


_HASH = """
import hashlib, torch, tritonmm
from tritonmm.core.reference import randn
torch.manual_seed(99)
a, b = randn(700, 900, dtype=torch.bfloat16, device="cuda"), randn(900, 500, dtype=torch.bfloat16, device="cuda")
cfg = {cfg!r}
with tritonmm.force_backend("triton", "{kernel}", config=cfg):
    out = tritonmm.matmul(a, b)
print(hashlib.sha256(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest())
"""


@pytest.mark.parametrize("kernel", ["tma", "pointer"])
def test_bit_identical_across_processes_for_a_config(kernel):
    import hashlib
    import os
    import subprocess
    import sys

    from tritonmm.kernels import configs as cfg

    config = cfg.heuristic(kernel, 700, 500, 900, 2, 2, _device.smem_limit(torch.device("cuda")), _device.num_sms(torch.device("cuda")))
    script = _HASH.format(cfg=config, kernel=kernel)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env=env).stdout.split()[-1] for _ in range(2)}
    torch.manual_seed(99)
    a, b = randn(700, 900, dtype=BF16, device="cuda"), randn(900, 500, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", kernel, config=config):
        here = hashlib.sha256(tritonmm.matmul(a, b).view(torch.int16).cpu().numpy().tobytes()).hexdigest()
    assert digests == {here}


# --------------------------------------------------------------------------- failures inside Triton


def test_config_out_of_shared_memory_falls_back_to_cublas():
    # 8 stages of 128x128 + 128x256 bf16 tiles: 786 KB of shared memory, over the H200's 227 KB
    huge = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_stages": 8, "num_warps": 8}
    a, b = randn(512, 512, dtype=BF16, device="cuda"), randn(512, 512, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", "pointer", config=huge):
        with pytest.warns(KernelFailedWarning, match="OutOfResources|shared memory"):
            got = tritonmm.matmul(a, b)
        assert tritonmm.explain(a, b).backend == "torch"
    assert torch.equal(got, torch.matmul(a, b))
    x, w = randn(64, 512, dtype=BF16, device="cuda"), randn(128, 512, dtype=BF16, device="cuda")
    with tritonmm.force_backend("triton", "pointer", config=huge):
        with pytest.warns(KernelFailedWarning):
            torch.testing.assert_close(tritonmm.linear(x, w, None, "relu"), F.relu(F.linear(x, w)), rtol=0, atol=0)


# --------------------------------------------------------------------------- state files on the GPU


@pytest.mark.parametrize("content", ['{"format": 1, "entries": {"bfloat16:', "\x00\xff garbage",
                                     '{"format": 1, "entries": {"bfloat16:4096:4096:4096:nn": {"backend": "triton", '
                                     '"kernel": "tma", "config": {"BLOCK_M": "exec(1)"}}}}'],
                         ids=["truncated", "binary", "malformed-entry"])
def test_bad_tuned_table_warns_once_and_falls_back_to_defaults(content, tmp_path, monkeypatch):
    import shutil
    import warnings

    from tritonmm.dispatch import tuned
    from tritonmm.kernels import configs as cfg

    shutil.copy(cfg.config_dir() / "candidates.json", tmp_path / "candidates.json")
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "h200.json").write_text(content, errors="surrogateescape")
    monkeypatch.setenv("TRITONMM_CONFIG_DIR", str(tmp_path))
    tuned.clear()
    tritonmm.clear_cache()
    try:
        problems = [(randn(4096, 4096, dtype=BF16, device="cuda"), randn(4096, 4096, dtype=BF16, device="cuda")),
                    (randn(4095, 1000, dtype=BF16, device="cuda"), randn(1000, 4097, dtype=BF16, device="cuda"))]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                for a, b in problems:
                    assert_matches_reference(tritonmm.matmul(a, b), a, b)
        messages = [str(w.message) for w in caught if "ignoring tuned table" in str(w.message)]
        assert len(messages) == 1 and "h200.json" in messages[0]
        assert not tritonmm.explain(*problems[0]).reason.startswith("tuned table")  # no table entry used
    finally:
        monkeypatch.delenv("TRITONMM_CONFIG_DIR")
        tuned.clear()
        tritonmm.clear_cache()
