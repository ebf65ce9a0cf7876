"""Layer 4, ops: the ops as torch sees them, in every mode; imports :mod:`tritonmm.dispatch` and the layers below.

:mod:`.library` (``torch.library`` registration of ``tritonmm::matmul`` and ``tritonmm::linear``: fake impls,
autograd, autocast), :mod:`.grads` (their gradient formulas), :mod:`.traced` (their bodies under ``torch.compile``),
:mod:`.eager` (eager calls in every mode: torch itself, the op, an autograd Function or the runner),
:mod:`.routes` (the keyed per-call cache of eager calls), :mod:`.distributed` (DTensor sharding rules);
the gated linear: :mod:`.gated` (the op ``tritonmm::gated_linear``, its autograd and the entry point),
:mod:`.gated_args` (its argument checks and autocast casts), :mod:`.gated_grads` (its backward); :mod:`.stacked`
(``tritonmm::stacked_linear``: one GEMM on weights stacked in one allocation).
"""
