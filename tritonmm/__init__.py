"""tritonmm: a drop-in torch.matmul / F.linear whose GEMM is an autotuned Triton kernel.

Public API (re-exports only; importing neither initialises CUDA nor reads files):

* :func:`matmul` / ``torch.ops.tritonmm.matmul``: torch.matmul semantics.
* :func:`linear` / ``torch.ops.tritonmm.linear``: F.linear with a fused bias + activation epilogue.
* :func:`explain`: which backend a call takes, and why.
* :func:`clear_cache`: forget cached decisions (after installing a tuned table, say).
* :func:`force_backend`: force Triton or torch.matmul (cuBLAS) inside a ``with`` block.
* :func:`gated_linear`: ``act(F.linear(x, w_gate)) * F.linear(x, w_up)`` as one GEMM; :func:`fuse`,
  :func:`unfuse`: gated MLPs (Llama, Mistral, Qwen2, Gemma) run through it.
* :func:`patch_linear`, :func:`unpatch_linear`, :func:`swap_linear`, :func:`unswap_linear`: nn.Linear integration.
* :func:`tune_model`: measure a model's GEMMs on this GPU ahead of time, into this machine's tuned table
  (GEMMs large enough are also measured at their first eager call: :mod:`tritonmm.first_sight`).
"""

from __future__ import annotations

from . import distributed as _distributed
from . import ops as _ops  # noqa: F401  (registers the torch.library ops)
from .activations import ACTIVATIONS
from .api import clear_cache, explain, linear, matmul
from .dispatch import Decision, force_backend
from .fusion import fuse, unfuse
from .gated import gated_linear
from .nn import TritonLinear, patch_linear, swap_linear, unpatch_linear, unswap_linear

__version__ = "0.2.0"


def tune_model(model, *example_args, **example_kwargs) -> dict:
    """Measure every GEMM of one forward and backward pass of ``model(*example_args, **example_kwargs)``
    that no table of this GPU holds, into this machine's tuned table; see :func:`tritonmm.tune.tune_model`."""
    from .tune import tune_model as _tune_model  # the tuner's imports (argparse, the benchmark) load on use

    return _tune_model(model, *example_args, **example_kwargs)


_distributed.install()  # DTensor sharding strategies, registered once torch.distributed.tensor is imported

__all__ = [
    "ACTIVATIONS",
    "Decision",
    "TritonLinear",
    "clear_cache",
    "explain",
    "force_backend",
    "fuse",
    "gated_linear",
    "linear",
    "matmul",
    "patch_linear",
    "swap_linear",
    "tune_model",
    "unpatch_linear",
    "unfuse",
    "unswap_linear",
]
