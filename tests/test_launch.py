"""Direct launches of compiled kernels (``tritonmm.kernels.launch.DirectLaunch``), checked with a fake JIT
function: the second launch must reach the compiled binary's launcher with every argument in signature
order, and launch hooks (profilers) must keep the normal path. The real launches run in every `gpu` test."""

import types

import pytest

from tritonmm.kernels import launch as km


class FakeCompiled:
    function = "cu-function"
    packed_metadata = "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeJit:
    arg_names = ["a_ptr", "M", "BLOCK_M", "ACTIVATION"]

    def __init__(self):
        self.compiled = FakeCompiled()
        self.slow = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(km, "interpreting", lambda: False)
    active = types.SimpleNamespace(get_current_device=lambda: 3, get_current_stream=lambda dev: 1000 + dev)
    monkeypatch.setattr(km, "_driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(km, "_getDevice", None)  # take the driver's stream, as without torch's raw stream getter


def test_current_stream_is_the_current_devices():
    """The raw stream handle of the current device, as Triton's own launcher takes it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert km.current_stream() == s.cuda_stream
    assert km.current_stream() == torch.cuda.current_stream().cuda_stream


def test_second_launch_calls_the_compiled_launcher(fake_gpu):
    fn = FakeJit()
    launch = km.DirectLaunch(fn, (7, 2), {"BLOCK_M": 64, "ACTIVATION": "gelu", "num_warps": 4})
    launch(("ptr0", 100))
    assert len(fn.slow) == 1 and fn.slow[0][0] == (7, 2, 1) and fn.compiled.runs == []
    launch(("ptr1", 100))
    assert len(fn.slow) == 1  # no second trip through Triton's binder
    assert fn.compiled.runs == [(7, 2, 1, 1003, "cu-function", "packed", None, None, None, "ptr1", 100, 64, "gelu")]


def test_launch_hooks_keep_the_normal_path(fake_gpu, monkeypatch):
    fn = FakeJit()
    launch = km.DirectLaunch(fn, (1,), {"BLOCK_M": 16, "ACTIVATION": "none"})
    launch(("p", 1))
    monkeypatch.setattr(km, "_hooks_active", lambda: True)
    launch(("p", 1))
    assert len(fn.slow) == 2 and fn.compiled.runs == []


def test_interpreter_never_takes_the_direct_path(monkeypatch):
    monkeypatch.setattr(km, "interpreting", lambda: True)
    fn = FakeJit()
    launch = km.DirectLaunch(fn, (1,), {"BLOCK_M": 16, "ACTIVATION": "none"})
    launch(("p", 1))
    launch(("p", 1))
    assert len(fn.slow) == 2 and launch.compiled is None


def test_exit_hooks_count_too(monkeypatch):
    chain = type(km.knobs.runtime.launch_exit_hook)
    if chain is type(None):
        pytest.skip("this Triton keeps hooks as plain callables")
    exit_hook = chain()
    exit_hook.add(lambda metadata: None)
    monkeypatch.setattr(km.knobs.runtime, "launch_exit_hook", exit_hook)
    assert km._hooks_active()


def test_hook_detection_matches_this_triton():
    hook = km.knobs.runtime.launch_enter_hook
    expected = bool(hook.calls) if hasattr(hook, "calls") else hook is not None
    assert km._hooks_active() is expected
    assert km._hooks_active() is False  # nothing installs a profiler hook in the test run
