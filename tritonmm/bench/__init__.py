"""``python -m tritonmm.bench``: tritonmm against torch, measured side by side in one run.

Modules: :mod:`.cli` (the command line), :mod:`.timing` (wall time, run facts; paired GPU timing is
:mod:`tritonmm.core.timing`), :mod:`.gemm` (per-GEMM rows on the shape suite, :mod:`tritonmm.tune.suite`),
:mod:`.model` (a transformers Llama model, off / swapped / patched / fused, and per-call host cost; its tables in
:mod:`.model_report`), :mod:`.report`
(tables, Markdown, CSV, plot), :mod:`.readme` (the README's table from the committed runs), :mod:`.cpu` (the
interpreter check without a GPU). A tool over the public API (:mod:`tritonmm`), the package's top layer.
"""

from ..core.timing import _bench_pair
from .cli import DTYPES, default_suite, load_suite, main, parse_args
from .cpu import cpu_check
from .gemm import inductor_pass
from .report import summarize

__all__ = ["DTYPES", "_bench_pair", "cpu_check", "default_suite", "inductor_pass", "load_suite", "main",
           "parse_args", "summarize"]
