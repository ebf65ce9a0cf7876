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
  (GEMMs large enough are also measured at their first eager call: :mod:`tritonmm.dispatch.first_sight`).

The package is layered as a call flows, each layer importing only from itself and the layers below:
:mod:`~tritonmm.core`, :mod:`~tritonmm.kernels`, :mod:`~tritonmm.dispatch`, :mod:`~tritonmm.ops`,
:mod:`~tritonmm.api`, :mod:`~tritonmm.modules`, :mod:`~tritonmm.tune`, this public face, then the tools
(``python -m tritonmm.bench``, ``python -m tritonmm.stress``) over it (``tests/test_package_layout.py``).
"""

import sys as _sys

from .api import clear_cache, explain, linear, matmul
from .core import device
from .core import reference as testing
from .core.activations import ACTIVATIONS
from .dispatch import gated, gated_cublas, runners
from .dispatch.decide import Decision, force_backend
from .modules import fusion, packing, qkv
from .modules import linear as nn
from .modules.fusion import fuse, unfuse
from .modules.linear import TritonLinear, patch_linear, swap_linear, unpatch_linear, unswap_linear
from .ops import distributed as _distributed
from .ops import library as _library  # noqa: F401  (registers the torch.library ops)
from .ops.gated import gated_linear
from .tune import capture

__version__ = "0.2.0"


def tune_model(model, *example_args, **example_kwargs) -> dict:
    """Measure every GEMM of one forward and backward pass of ``model(*example_args, **example_kwargs)``
    that no table of this GPU holds, into this machine's tuned table; see :func:`tritonmm.tune.model.tune_model`."""
    from .tune.model import tune_model as _tune_model  # the tuner's imports (argparse, the measurement) load on use

    return _tune_model(model, *example_args, **example_kwargs)


_distributed.install()  # DTensor sharding strategies, registered once torch.distributed.tensor is imported

# The 0.2.0 paths of the modules that the documents name and that pickles of swapped and fused models reference
# (the modules moved into the layers since): ``tritonmm.fusion.fusable``, ``import tritonmm.runners`` and the
# unpickling of a model saved with 0.2.0 find them here.
_sys.modules.update({f"{__name__}.{name}": module for name, module in (
    ("capture", capture), ("device", device), ("fusion", fusion), ("gated", gated), ("gated_cublas", gated_cublas),
    ("nn", nn), ("packing", packing), ("qkv", qkv), ("runners", runners), ("testing", testing))})

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
