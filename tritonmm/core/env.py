"""Environment switches read at call time (never at import)."""

from __future__ import annotations

import os

ENV = ("TRITONMM_BACKEND", "TRITONMM_KERNEL", "TRITONMM_AUTOTUNE", "TRITON_INTERPRET", "TRITONMM_CONFIG_DIR")
"""The variables a decision depends on: part of every runner's cache key. The routes and their direct keys
(:mod:`tritonmm.ops.routes`) hold the first three, so changing one of those takes effect at the next call; a new
config directory or interpreter setting, after :func:`tritonmm.clear_cache`."""
_environ_data = getattr(os.environ, "_data", None)  # CPython's raw (encoded) environment: faster reads
if isinstance(_environ_data, dict) and all(isinstance(k, bytes) for k in list(_environ_data)[:1]):
    _ENV_KEYS = tuple(os.fsencode(k) for k in ENV)

    raw_get, raw_name = _environ_data.get, os.fsencode  # raw_get(raw_name(name)): a variable's raw value
    raw_env = _environ_data  # raw_name(name) in raw_env: whether a variable is set

    def env_state() -> tuple:
        """The raw values of :data:`ENV` (None where unset)."""
        return tuple(map(_environ_data.get, _ENV_KEYS))
else:  # pragma: no cover - non-POSIX environments
    raw_get, raw_name, raw_env = os.environ.get, str, os.environ

    def env_state() -> tuple:
        """The raw values of :data:`ENV` (None where unset)."""
        return tuple(map(os.environ.get, ENV))


_TRITON_ON, _TRITON_OFF = ("1", "true", "yes", "on", "y"), ("", "0", "false", "no", "off", "n")
"""The values Triton reads as on and off (case-insensitive); Triton reads any other value as off."""


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through its interpreter.

    Raises:
        ValueError: the variable holds a value Triton does not read as on or off (Triton would run its
            compiler, tritonmm could not tell).
    """
    raw = os.environ.get("TRITON_INTERPRET")
    if raw is None:
        return False
    value = raw.lower()
    if value in _TRITON_ON:
        return True
    if value in _TRITON_OFF:
        return False
    raise ValueError(f"environment variable TRITON_INTERPRET={raw!r} is not one of {_TRITON_ON} (on) or "
                     f"{_TRITON_OFF} (off)")


def switch(name: str) -> bool:
    """An on/off variable, on by default (unset or empty): 1/true/on/yes or 0/false/off/no.

    Raises:
        ValueError: the variable holds anything else.
    """
    raw = os.environ.get(name, "1").strip().lower()
    if raw in ("1", "true", "on", "yes", ""):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r} is not 0 or 1")


def autotune_enabled() -> bool:
    """``TRITONMM_AUTOTUNE`` (default 1): 0 picks configs by the quantization heuristic, without benchmarking.

    Raises:
        ValueError: the variable holds something other than 0/1/true/false/on/off/yes/no.
    """
    return switch("TRITONMM_AUTOTUNE")


def deterministic_configs() -> bool:
    """Whether kernel configs must not be chosen by timing: torch.distributed runs with more than one rank
    and ``TRITONMM_AUTOTUNE`` is unset.

    Timings differ between GPUs, so autotuning could give ranks different configs and, for
    the same inputs, results that differ in the last bits. Then every rank uses the shipped
    tuned table or the quantization heuristic, both pure functions of the shape and the GPU
    model. Setting ``TRITONMM_AUTOTUNE=1`` explicitly autotunes on each rank anyway.
    """
    if os.environ.get("TRITONMM_AUTOTUNE", "").strip():
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
