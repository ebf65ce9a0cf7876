"""Layer 3, dispatch: which backend serves a GEMM and the runner that serves it, with no autograd and no torch
modes; imports :mod:`tritonmm.kernels` (on first use) and :mod:`tritonmm.core`.

:mod:`.decide` (the rules: a :class:`~.decide.Decision` and its reason; ``force_backend``), :mod:`.tables` (tuned
tables as files), :mod:`.tuned` (this GPU's entries), :mod:`.first_sight` (measurement at a GEMM's first eager call),
:mod:`.plans` (weights that never reach a Triton kernel), :mod:`.runners` (one cached runner per operand geometry),
:mod:`.padded` (cuBLAS on zero-padded aligned copies); the gated linear's paths: :mod:`.gated` (by size; its
launchers and replays), :mod:`.gated_cublas` (cuBLAS projections and the one-pass product, the gated GEMM on packed
weights), :mod:`.gated_tuning` (its table entries and first-sight measurement); :mod:`.norm_linear` (a GEMM with the
RMSNorm before it in its loads, at decode sizes).
"""
