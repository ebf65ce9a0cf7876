"""The one place that decides between the Triton kernels and torch.matmul (cuBLAS).

``decide`` returns a :class:`Decision` with its reason; ``tritonmm.explain(a, b)`` shows it.
Rules, in order (first match wins):

1. a device or dtype the kernels do not handle (not CUDA, float64, integers, complex), and float32 where
   torch.matmul would not use TF32 -> torch.matmul. Under ``TRITON_INTERPRET=1`` CPU tensors take the Triton path.
2. empty problems (M, N or batch = 0; K = 0) -> no launch.
3. a forced backend (``TRITONMM_BACKEND`` or :func:`force_backend`).
4. a measured winner from the tuned table of this GPU (``configs/tuned/*.json``, :mod:`tritonmm.dispatch.tuned`,
   and this machine's, where :mod:`tritonmm.dispatch.first_sight` records GEMMs large enough to measure at their
   first eager call); a Triton winner must save at least ``TRITON_MIN_SAVING_US`` of GPU time per call.
5. 2-D problems whose K or N is not a multiple of 16 bytes, at least ``PAD_MIN_FLOPS`` and math-bound (at least
   ``PAD_MIN_INTENSITY`` FLOP/byte) -> cuBLAS on zero-padded aligned copies (``kernel="padded"``,
   :mod:`tritonmm.dispatch.padded`).
6. everything else (below ``MIN_FLOPS``, batched, float32 with TF32, not in the table) -> cuBLAS.

Forcing "torch" with kernel "padded" takes the padded path wherever a leading dimension is unaligned. Forcing
"triton" skips rules 4-6 and picks the kernel by shape: persistent TMA for 2-D problems on Hopper (copying
unaligned operands when large enough), split-K when small M leaves SMs idle, the pointer kernel otherwise. Under
``TRITON_INTERPRET=1`` CPU tensors always take that kernel choice, so CI runs the kernels themselves.

:func:`torch_everywhere` answers, from sizes alone, whether every layout of a problem goes to
torch.matmul: the per-call fast path (:mod:`tritonmm.api`) then calls torch directly.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field

import torch

from ..core import device as _device
from ..core.env import autotune_enabled, interpreting
from ..core.layout import aligned, padded_shape, tma_copies
from ..core.shapes import Plan
from ..kernels.configs import validate
from . import tuned as _tuned

BACKENDS = ("auto", "triton", "torch")
KERNELS = ("auto", "tma", "pointer", "splitk", "padded")
_ALIASES = {"cublas": "torch"}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_FLOPS = 2 * 128**3
"""FLOP below which a GEMM goes to cuBLAS: a launch from Python costs more than the math."""
PAD_MIN_FLOPS = 2 * 2048**3
"""FLOP from which unaligned 2-D problems take the padded path automatically. Its copies cost host time (three copy
launches besides the GEMM); from this size on cuBLAS's unaligned GEMM takes longer (``h200.json``, tag ``odd``)."""
TMA_COPY_MIN_FLOPS = 2 * 512**3
"""FLOP from which forced Triton copies unaligned operands for the TMA kernel (the pointer kernel below)."""
PAD_MIN_INTENSITY = 256
"""FLOP/byte below which a GEMM is memory-bound and an operand copy costs more than it saves."""
TRITON_MIN_SAVING_US = 15.0
"""µs of GPU time a tuned-table Triton winner must save over cuBLAS to be used: more than a call on the Triton
route costs the host over torch's own call (``benchmarks/h200_model.json``, ``per_call``: the "Triton route"
row against the "matmul, no_grad" row), which a host-paced loop such as eager decode pays in full."""
SMALL_M = 64
"""M at or below which a GEMM is memory-bound (weight streaming): pointer or split-K kernel."""

_forced: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("tritonmm_forced", default=None)


@dataclass(frozen=True)
class Decision:
    """Which backend serves a call, and why.

    Attributes:
        backend: "triton" or "torch" (torch.matmul: cuBLAS on CUDA).
        kernel: "tma", "pointer", "splitk", "none" (no launch: empty result), "padded" (backend
            "torch": cuBLAS on zero-padded aligned copies) or None (torch.matmul as called).
        reason: one sentence for humans.
        config: a fixed kernel config (from the tuned table), or None to autotune.
        copies: operands ("a", "b") copied into 16-byte aligned buffers for TMA.
    """

    backend: str
    kernel: str | None
    reason: str
    config: dict | None = None
    copies: tuple = field(default=())

    def __str__(self) -> str:
        what = f"triton[{self.kernel}]" if self.backend != "torch" else \
            "torch.matmul[padded]" if self.kernel == "padded" else "torch.matmul"
        extra = f", copies {'+'.join(self.copies)} to aligned buffers" if self.copies else ""
        cfg = f", config {self.config}" if self.config else ""
        return f"{what}: {self.reason}{extra}{cfg}"


def _env_choice(name: str, allowed: tuple) -> str:
    raw = os.environ.get(name, "auto").strip().lower() or "auto"
    value = _ALIASES.get(raw, raw)
    if value not in allowed:
        aliases = [a for a, v in _ALIASES.items() if v in allowed]
        raise ValueError(f"environment variable {name}={os.environ[name]!r} is not one of "
                         f"{', '.join(allowed + tuple(aliases))}")
    return value


def _check_combination(backend: str, kernel: str, config, where: str) -> None:
    """Raise ValueError for a kernel or config that the backend would silently ignore."""
    if kernel == "padded" and backend != "torch":
        raise ValueError(f"{where}: kernel 'padded' (cuBLAS on padded copies) needs backend 'torch', got {backend!r}")
    if backend == "torch" and kernel not in ("auto", "padded"):
        raise ValueError(f"{where}: kernel {kernel!r} is a Triton kernel; backend 'torch' takes 'auto' or 'padded'")
    if config is not None and backend != "triton":
        raise ValueError(f"{where}: a forced config needs backend 'triton', got {backend!r}")


def forced() -> tuple[str, str, dict | None]:
    """(backend, kernel, config) forced by :func:`force_backend`, else by the environment, else auto.

    The environment is validated on every call, also inside a :func:`force_backend` block.

    Raises:
        ValueError: ``TRITONMM_BACKEND``, ``TRITONMM_KERNEL`` or ``TRITONMM_AUTOTUNE`` holds an unknown
            value, or the two name a kernel the backend would ignore (``TRITONMM_KERNEL=padded`` without
            ``TRITONMM_BACKEND=torch``, a Triton kernel with ``TRITONMM_BACKEND=torch``).
    """
    autotune_enabled()  # validated here too, so a bad value is reported wherever it would be ignored
    backend, kernel = _env_choice("TRITONMM_BACKEND", BACKENDS), _env_choice("TRITONMM_KERNEL", KERNELS)
    _check_combination(backend, kernel, None, f"environment variables TRITONMM_BACKEND={backend!r}, "
                                              f"TRITONMM_KERNEL={kernel!r}")
    ctx = _forced.get()
    if ctx is not None:
        backend, kernel, config = ctx
        return backend, kernel, dict(config) if config is not None else None
    return backend, kernel, None


@contextlib.contextmanager
def force_backend(backend: str = "triton", kernel: str = "auto", config: dict | None = None):
    """Force a backend (and optionally a Triton kernel and config) inside a ``with`` block; for tests and A/B runs.

    Args:
        backend: "triton", "torch" (alias "cublas") or "auto".
        kernel: "auto", "tma", "pointer" or "splitk" (a Triton kernel: used when the backend is
            "triton", and under the interpreter also with "auto"), or "padded" (with backend "torch":
            cuBLAS on zero-padded aligned copies where a 2-D problem has an unaligned leading dimension).
        config: a config dict for ``kernel`` (fields of ``configs/candidates.json``; backend "triton"
            only); default: tuned/autotuned.

    Forcing "triton" overrides the performance rules (size, tuned table), not the capability rules: float64, or a
    CPU tensor outside the interpreter (``TRITON_INTERPRET=1``), still goes to torch, with one UserWarning per such
    reason in a process, at the first call it concerns.

    Raises:
        ValueError: unknown backend or kernel, a kernel or config the backend would ignore ("padded"
            without "torch", a Triton kernel with "torch", a config without "triton"), or a config
            without exactly the kernel's fields as ints.
    """
    backend = _ALIASES.get(backend, backend)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or 'cublas', got {backend!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if config is not None and kernel == "auto":
        raise ValueError("a forced config needs a forced kernel")
    _check_combination(backend, kernel, config, "force_backend")
    if config is not None:
        validate(kernel, config)
    frozen = tuple(sorted(config.items())) if config is not None else None  # hashable: part of cache keys
    global _forcing_blocks
    with _forcing_lock:
        _forcing_blocks += 1
    try:
        state_changed()
        with forcing_as((backend, kernel, frozen)):
            yield
    finally:
        with _forcing_lock:
            _forcing_blocks -= 1


_forcing_blocks = 0  # force_backend blocks open in any thread
_forcing_lock = threading.Lock()


def forcing_blocks() -> int:
    """How many :func:`force_backend` blocks are open, in all threads."""
    return _forcing_blocks


STATE_HOOKS: list = []
"""Callables run when a decision made earlier may no longer hold (:func:`force_backend` entered,
:func:`tritonmm.clear_cache`): :mod:`tritonmm.modules.linear` unsettles its settled modules."""


def state_changed() -> None:
    for hook in STATE_HOOKS:
        hook()


@contextlib.contextmanager
def forcing_as(state):
    """Run a block under a forcing state captured with ``_forced.get()`` (the backward pass uses this:
    autograd runs it on other threads, where the forward's :func:`force_backend` is not set)."""
    token = _forced.set(state)
    try:
        yield
    finally:
        _forced.reset(token)


def _capability(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the Triton kernels cannot serve this call at all, or None."""
    if device.type == "cpu" and not interpreting():
        return "CPU tensors: the Triton kernels run on CUDA GPUs (or on CPU under TRITON_INTERPRET=1)"
    if device.type not in ("cpu", "cuda"):
        return f"device type {device.type!r} is not served by the Triton kernels"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported by the Triton kernels (float16, bfloat16, float32 are)"
    if dtype == torch.float32 and device.type == "cuda" and not _device.tf32(dtype, device):
        return "float32 with TF32 disabled (float32 matmul precision 'highest'): cuBLAS keeps full fp32 precision"
    return None


_warned: set = set()  # the reasons a forced Triton backend fell to torch that were warned about
_OWN_FRAMES = tuple(os.path.dirname(p) + os.sep for p in (os.path.dirname(os.path.abspath(__file__)), torch.__file__))


def _torch_only(dtype: torch.dtype, device: torch.device, backend: str) -> str | None:
    """:func:`_capability`'s reason, warned about once (at the user's line) where the backend is forced to Triton."""
    why_not = _capability(dtype, device)
    if why_not and backend == "triton" and why_not not in _warned:
        _warned.add(why_not)
        level, frame = 2, sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_OWN_FRAMES):
            level, frame = level + 1, frame.f_back
        warnings.warn(f"tritonmm: backend forced to triton, but torch serves this call and every call like it: "
                      f"{why_not}", UserWarning, stacklevel=level)
    return why_not


def kernel_choice(plan: Plan, device: torch.device, want: str) -> tuple[str, str, tuple]:
    """(kernel, reason, copies) for a call that goes to Triton (``want``: a forced kernel, or "auto")."""
    M, N, K, batch = plan.M, plan.N, plan.K, plan.batch
    two_d = batch == 1
    if want != "auto":
        if want in ("tma", "splitk") and not two_d:
            return "pointer", f"{want} takes one 2-D GEMM; batched ({batch}) runs the pointer kernel", ()
        if want == "tma" and not _device.has_tma(device):
            return "pointer", "TMA needs compute capability 9.0+; pointer kernel", ()
        if want != "tma":
            return want, f"kernel forced to {want}", ()
        copies = tma_copies(plan)
        return "tma", "kernel forced to tma", copies
    if not two_d:
        return "pointer", f"batched GEMM ({batch} x {M}x{N}x{K}): pointer kernel with a batch grid axis", ()
    if M <= SMALL_M:
        tiles = -(-M // 16) * -(-N // 64)
        if tiles < _device.num_sms(device) and K >= 1024:
            return "splitk", f"M={M} leaves SMs idle ({tiles} tiles): split-K over K={K}", ()
        return "pointer", f"M={M} is memory-bound: pointer kernel with small BLOCK_M", ()
    if not _device.has_tma(device):
        return "pointer", "no TMA before compute capability 9.0: pointer kernel", ()
    copies = tma_copies(plan)
    if copies and 2 * M * N * K < TMA_COPY_MIN_FLOPS:
        return "pointer", "unaligned operands, too small to pay for an aligned copy: pointer kernel", ()
    return "tma", "persistent TMA kernel", copies


def decide(plan: Plan, dtype: torch.dtype, device: torch.device) -> Decision:
    """Choose the backend for one call (see the module docstring for the rules).

    Raises:
        ValueError: a forcing environment variable holds an unknown value.
    """
    backend, kernel, config = forced()  # first: a bad environment value is reported for every call
    why_not = _torch_only(dtype, device, backend)
    if why_not:
        return Decision("torch", None, why_not)
    M, N, K, batch = plan.M, plan.N, plan.K, plan.batch
    if M == 0 or N == 0 or batch == 0:
        return Decision("triton", "none", "empty result: nothing to compute, no launch")
    if K == 0:
        return Decision("triton", "none", "K = 0: the result is zeros (plus bias), no launch")
    if backend == "torch":
        if kernel == "padded":
            if padded_shape(plan, dtype) is not None:
                return Decision("torch", "padded", "forced: cuBLAS on zero-padded aligned copies")
            return Decision("torch", None, "backend forced to torch (nothing to pad: aligned operands, or a "
                                           "batched problem, which the padded path does not take)")
        return Decision("torch", None, "backend forced to torch")
    if backend == "triton":
        k, reason, copies = kernel_choice(plan, device, kernel)
        return Decision("triton", k, f"backend forced to triton; {reason}", config=config if k == kernel else None,
                        copies=copies)
    if device.type == "cpu":  # the interpreter: CI exercises the kernels, so no performance rules
        k, reason, copies = kernel_choice(plan, device, kernel)
        return Decision("triton", k, f"TRITON_INTERPRET=1: CPU tensors run in Triton's interpreter; {reason}",
                        copies=copies)
    entry = _from_table(device, dtype, plan)
    if entry is not None:
        return entry
    flops = 2 * M * N * K * batch
    if batch == 1 and _pads(M, N, K, dtype) and padded_shape(plan, dtype) is not None:
        return Decision("torch", "padded", "K or N not a multiple of 16 bytes, large and math-bound: cuBLAS on "
                                           "zero-padded aligned copies")
    if flops < MIN_FLOPS:
        return Decision("torch", None, f"{flops / 1e6:.2f} MFLOP is too small to pay for a Triton launch")
    if batch > 1:
        return Decision("torch", None, f"batched GEMM ({batch} x {M}x{N}x{K}): cuBLAS strided-batched")
    if dtype == torch.float32:
        return Decision("torch", None, "float32 (TF32) not in this GPU's tuned table: cuBLAS")
    return Decision("torch", None, "not in this GPU's tuned table: cuBLAS")


def _pads(M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    """Rule 5's size test: K or N unaligned, at least ``PAD_MIN_FLOPS``, at least ``PAD_MIN_INTENSITY``."""
    size = dtype.itemsize
    if aligned(K, size) and aligned(N, size):
        return False
    flops = 2 * M * N * K
    return flops >= PAD_MIN_FLOPS and flops / (size * (M * K + K * N + M * N)) >= PAD_MIN_INTENSITY


def _from_table(device: torch.device, dtype: torch.dtype, plan: Plan) -> Decision | None:
    """The tuned table's winner for this problem on this GPU as a Decision, or None."""
    e = _tuned.entry(device, dtype, plan)
    if e is None:
        return None
    if e.get("prior"):
        source = f"tuned table (measured with triton {e['prior']}, used as a prior)"
    elif "first_sight_s" in e:
        source = "tuned table (measured at first sight)"
    else:
        source = "tuned table"
    return _table_decision(e, plan, dtype, source)


def _table_decision(e: dict, plan: Plan, dtype: torch.dtype, source: str) -> Decision:
    ratio = e["torch_us"] / e["triton_us"] if e.get("triton_us") else 0.0
    if e["backend"] == "torch" and not e.get("triton_us"):
        return Decision("torch", None, f"{source}: cuBLAS ({e.get('note') or 'no Triton kernel measured'})")
    if e["backend"] == "torch":
        if e.get("kernel") == "padded":
            if padded_shape(plan, dtype) is not None:
                return Decision("torch", "padded", f"{source}: cuBLAS on zero-padded aligned copies measured "
                                                   f"{ratio:.2f}x torch.matmul")
            return Decision("torch", None, f"{source}: cuBLAS (operands already aligned)")
        if ratio >= 1.0:  # Triton measured faster, by less than the tuner's --min-gain/--min-gain-us
            return Decision("torch", None, f"{source}: cuBLAS kept (Triton measured {ratio:.2f}x, inside the "
                                           f"tuner's margin)")
        return Decision("torch", None, f"{source}: cuBLAS measured faster (Triton {ratio:.2f}x)")
    if _tuned.under_first_sight_margin(e):
        return Decision("torch", None, f"{source}: cuBLAS kept (Triton measured {ratio:.2f}x, inside first-sight "
                                       f"tuning's margin of {_tuned.FIRST_SIGHT_MIN_GAIN:g}x)")
    if not _tuned.saves(e, TRITON_MIN_SAVING_US):
        return Decision("torch", None, f"{source}: Triton measured {ratio:.2f}x, saving less GPU time than its "
                                       f"launch costs on the host")
    copies = tma_copies(plan) if e["kernel"] == "tma" else ()
    return Decision("triton", e["kernel"], f"{source}: measured {ratio:.2f}x cuBLAS", config=e["config"], copies=copies)


def torch_everywhere(problems, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`decide` gives plain torch.matmul for every (M, N, K, batch) in ``problems``
    whatever the operands' strides and alignment (False when unsure: the caller then decides per call).

    Raises:
        ValueError: a forcing environment variable holds an unknown value.
    """
    backend, kernel, _ = forced()
    if _torch_only(dtype, device, backend):
        return True
    if backend == "torch":
        return kernel != "padded"
    if backend == "triton" or device.type != "cuda":
        return False
    for M, N, K, batch in problems:
        if 0 in (M, N, K, batch):
            return False  # no launch: the runner builds the result itself
        if batch == 1 and (_tuned.has_kernel(device, dtype, M, N, K, TRITON_MIN_SAVING_US) or _pads(M, N, K, dtype)):
            return False
    return True


def weight_free(N: int, K: int, dtype: torch.dtype, device: torch.device, backward: bool = True) -> bool:
    """Whether automatic dispatch sends every GEMM of an (N, K) weight of ``dtype`` on ``device`` to
    plain torch (cuBLAS): the forward for any number of rows, in ``dtype`` or an autocast dtype, and (with
    ``backward``) both gradients. The fast path then calls F.linear / torch.matmul for it without
    building a key.

    Raises:
        ValueError: a forcing environment variable holds an unknown value.
    """
    forced()  # (validates the environment)
    if device.type != "cuda":
        return not (device.type == "cpu" and interpreting())
    dtypes = tuple(sorted({dtype, torch.float16, torch.bfloat16} & set(SUPPORTED_DTYPES), key=str))
    if any(not (aligned(N, d.itemsize) and aligned(K, d.itemsize)) for d in dtypes):
        return False  # the padded path may take large problems
    index = device.index if device.index is not None else torch.cuda.current_device()
    return not _tuned.weight_used(index, dtypes, N, K, TRITON_MIN_SAVING_US, backward)
