"""``tritonmm.tune_model``: the GEMMs of one forward and backward pass of a model (:mod:`tritonmm.tune.capture`),
measured where no table of this GPU and Triton release holds them yet, into this machine's table
(:func:`tritonmm.dispatch.tuned.user_dir`)."""

from __future__ import annotations

import warnings

import torch

from .. import api
from ..dispatch import gated, gated_tuning, tables, tuned
from . import capture
from .cli import _table_path, parse_args
from .measure import _adding, _measure, _unmeasured, _work, decide_entries
from .suite import DTYPES


def tune_model(model, *example_args, **example_kwargs) -> dict:
    """Tune every GEMM ``model(*example_args, **example_kwargs)`` runs, forward and backward, ahead of time.

    Records the geometries of one pass (:func:`tritonmm.tune.capture.geometries`: in the model's current mode, its
    buffers and torch's random state restored, no ``.grad`` written), measures those that no table of this GPU and
    Triton release holds (every candidate config of each kernel against cuBLAS, as ``python -m tritonmm.tune``;
    seconds per geometry; fused MLPs' gated linears the gated kernel may serve as first-sight tuning measures them,
    :mod:`tritonmm.dispatch.gated_tuning`) and merges the winners into this machine's table
    (:func:`tritonmm.dispatch.tuned.record`), which later processes read; where it cannot be written, a RuntimeWarning
    says so and they hold in this process. Then forgets the decisions made before, so they take effect. A second call
    measures nothing.

    Returns:
        dict: ``geometries`` (recorded GEMMs), ``measured`` (new ones, ``gated`` of them gated linears),
        ``table`` (its path, or None when nothing was measured or it could not be written), ``entries`` and
        ``triton`` (entries of that table, and how many choose Triton).

    Raises:
        RuntimeError: no CUDA GPU (there is nothing to measure).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("tritonmm.tune_model measures kernels on a CUDA GPU; none is available")
    suite = capture.geometries(model, *example_args, **example_kwargs)
    args = parse_args([])
    device = torch.device("cuda", torch.cuda.current_device())
    work = _unmeasured(_work(suite["shapes"], args), device)
    result = {"geometries": len(suite["shapes"]), "measured": 0, "table": None, "entries": 0, "triton": 0, "gated": 0}
    if work:
        measured = _measure(work, args)
        result["measured"] = len(measured)
        entries = decide_entries(measured, args.min_gain, args.min_gain_us)
        try:
            tuned.record(device, entries, _adding(measured, args, torch.cuda.get_device_name(device)))
        except OSError as exc:  # as first-sight tuning: the entries hold in this process
            warnings.warn(f"tritonmm.tune_model: could not write this machine's tuned table ({exc}); the "
                          f"{len(entries)} entries measured hold in this process only", RuntimeWarning, stacklevel=2)
    for g in suite["gated"]:  # fused MLPs' gated linears the gated kernel may serve: measured as at first sight
        M, N, K = g["M"], g["N"], g["K"]
        if gated.kernel_rows(M, N, K, False) and gated_tuning.tune(device, DTYPES[g["dtype"]], M, N, K,
                                                                   g["activation"], g["bias"]) is not None:
            result["gated"] += 1
    result["measured"] += result["gated"]
    if result["measured"]:
        path = _table_path(tuned.user_dir())
        table = tables.read_table(path) if path.is_file() else None
        if table is not None:
            result.update(table=path, entries=len(table["entries"]),
                          triton=sum(e["backend"] == "triton" for e in table["entries"].values()))
        api.forget_decisions()
    return result


