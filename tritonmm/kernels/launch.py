"""Launch plumbing shared by the GEMM launchers: direct launches of compiled kernels, the TMA
descriptors' scratch allocator, ``@triton.autotune`` wrappers and the fixed-config choice."""

from __future__ import annotations

import functools
import logging
import threading

import torch
import triton
from triton import knobs
from triton.runtime import _allocation
from triton.runtime import driver as _driver

from ..core import device as _device
from ..core.env import autotune_enabled, deterministic_configs, interpreting
from . import configs as _cfg
from .pointer import _matmul_kernel
from .tma import _matmul_tma_kernel

log = logging.getLogger("tritonmm")

LAUNCH_FAILURES = (triton.errors.TritonError,)
"""What a failing config raises (compile errors, out of shared memory or registers, ptxas, an
autotuner left with no runnable config): the runner then serves the call with torch.matmul."""


_RUNTIME = knobs.runtime


def _hooks_active() -> bool:
    """Whether a launch enter or exit hook (a profiler such as proton) is installed. Triton 3.6 keeps
    hooks in a ``HookChain`` that is never None; older releases use None for "no hook"."""
    for hook in (_RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook):
        calls = getattr(hook, "calls", None)
        if (bool(calls) if calls is not None else hook is not None):
            return True
    return False


_getDevice = getattr(torch._C, "_cuda_getDevice", None)
_getCurrentRawStream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream() -> int:
    """The current CUDA stream of the current device, as Triton's launcher takes it."""
    if _getDevice is not None and _getCurrentRawStream is not None:
        return _getCurrentRawStream(_getDevice())
    return _driver.active.get_current_stream(_driver.active.get_current_device())


class DirectLaunch:
    """Launches of one JIT kernel with fixed constexprs and grid: the first goes through
    ``kernel[grid](...)`` (compiling or finding the binary), later ones call the compiled
    binary's launcher directly, skipping Triton's per-call argument binding and cache lookup.
    Safe because a launcher serves one geometry: the runner's cache key fixes every integer
    argument and the 16-byte alignment of every pointer, which is all Triton specializes on.
    Launch hooks (profilers) and the interpreter use the normal path.
    """

    __slots__ = ("fn", "grid", "kwargs", "compiled", "tail", "run", "head")

    def __init__(self, fn, grid: tuple, kwargs: dict):
        self.fn, self.grid, self.kwargs = fn, tuple(grid) + (1,) * (3 - len(grid)), kwargs
        self.compiled = self.tail = self.run = self.head = None

    def __call__(self, args: tuple) -> None:
        if self.compiled is None or _hooks_active():
            k = self.fn[self.grid](*args, **self.kwargs)
            if self.compiled is None and not interpreting() and all(
                    hasattr(k, n) for n in ("run", "function", "packed_metadata")):
                names = self.fn.arg_names[len(args):]
                if all(n in self.kwargs for n in names):
                    self.tail = tuple(self.kwargs[n] for n in names)
                    self.run, self.head = k.run, (k.function, k.packed_metadata, None, None, None)
                    self.compiled = k
            return
        g0, g1, g2 = self.grid
        stream = _getCurrentRawStream(_getDevice()) if _getDevice is not None else current_stream()
        self.run(g0, g1, g2, stream, *self.head, *args, *self.tail)


def input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot precision: TF32 for float32 only where torch.matmul would use it (:func:`device.tf32`)."""
    return "ieee" if dtype == torch.float32 and not _device.tf32(dtype, device) else "tf32"


def _torch_alloc(size: int, alignment: int, stream):
    """Scratch memory for device-side TMA descriptors, from torch's caching allocator (current device)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator for the TMA kernel's descriptors, unless one is set."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_alloc)


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (no benchmarking, no syncs allowed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def heuristic_config(kernel: str, M, N, K, dtype: torch.dtype, device: torch.device) -> dict:
    """The quantization heuristic's config (:func:`configs.heuristic`), for launches that must not benchmark."""
    size = dtype.itemsize
    return _cfg.heuristic(kernel, M, N, K, size, size, _device.smem_limit(device), _device.num_sms(device))


def fixed_config(kernel: str, config, M, N, K, dtype: torch.dtype, device: torch.device):
    """The config to launch without autotuning, or None to autotune.

    An explicit config wins; under the interpreter, its single config; with
    ``TRITONMM_AUTOTUNE=0`` or several ranks (:func:`tritonmm.core.env.deterministic_configs`), the
    quantization heuristic's pick.
    """
    if config is not None:
        return _cfg.complete(kernel, config)
    if interpreting():
        return _cfg.interpreter_config(kernel)
    if not autotune_enabled() or deterministic_configs():
        return heuristic_config(kernel, M, N, K, dtype, device)
    return None


def _early_prune(kernel: str, configs, named_args, **kwargs):
    """``early_config_prune`` for ``triton.autotune``: see :func:`configs.prune`."""
    a, c = named_args["a_ptr"], named_args["c_ptr"]
    dicts = [_cfg.from_triton(c_) for c_ in configs]
    out_itemsize = c.element_size() if kernel != "splitk" else a.element_size()
    kept = _cfg.prune(
        dicts, M=named_args["M"], N=named_args["N"], K=named_args["K"], itemsize=a.element_size(),
        out_itemsize=out_itemsize, kernel=kernel, smem_limit=_device.smem_limit(a.device),
        num_sms=_device.num_sms(a.device),
    )
    return [configs[dicts.index(k)] for k in kept]


@functools.cache
def autotuned(kernel: str):
    """The ``@triton.autotune`` wrapper of one kernel, built on first use from ``configs/candidates.json``.

    The key holds bucketed M/N/K (:func:`configs.bucket`), the operand layouts and the
    SM count; Triton adds the tensor dtypes. Results persist on disk in Triton's cache
    (``cache_results=True``), keyed by the Triton version, the GPU target, the kernel
    source and the candidate list, so a change to any of them retunes.
    """
    configs = [_cfg.to_triton(c) for c in _cfg.candidates(kernel)]
    prune = {"early_config_prune": functools.partial(_early_prune, kernel)}
    if kernel == "tma":
        # SPLIT_POOL: which split-K configs pruning kept for this problem. Shapes of one bucket can keep
        # different ones (K = 200 and 256 share a bucket, 4 splits of 64 fit only the second), and the
        # workspace is sized for the pool, so a config tuned on another pool must not be reused
        key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "SPLIT_POOL", "A_TRANS", "B_TRANS", "NUM_SMS"]
        fn = _matmul_tma_kernel
    else:
        key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT"]
        fn = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_matmul_kernel)
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune, cache_results=True)(fn)


_cfg._dependents.append(autotuned)


_tune_lock = threading.Lock()  # Autotuner.run keeps per-call state on the object


def autotune(kernel: str, grid, args, meta) -> dict:
    """Run ``@triton.autotune`` once for this launch; return the winning config.

    Configs that fail to compile or exceed shared memory / registers are skipped by Triton's
    autotuner (timed as inf) and logged here at DEBUG level. If none runs, Triton raises,
    and the runner falls back to torch.matmul with a warning.
    """
    tuner = autotuned(kernel)
    with _tune_lock:
        tuner[grid](*args, **meta)
        timings = dict(getattr(tuner, "configs_timings", None) or {})
        best = tuner.best_config
    for config, ms in timings.items():
        bad = ms if isinstance(ms, float) else (ms[0] if ms else float("inf"))
        if bad == float("inf"):
            log.debug("%s: config %s failed to compile or run; skipped", kernel, config)
    return _cfg.from_triton(best)
