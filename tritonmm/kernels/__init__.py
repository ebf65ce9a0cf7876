"""Layer 2, kernels: the ``@triton.jit`` kernels, their candidate configs and their launchers; imports
:mod:`tritonmm.core` only. Importing a kernel module imports Triton: the layers above import them on first use.

:mod:`.configs` (candidate configs, pruning, the heuristic), :mod:`.common` (shared ``@triton.jit`` helpers),
:mod:`.pointer`, :mod:`.tma` (the GEMM kernels), :mod:`.launch` (direct launches, autotuning),
:mod:`.launchers` (bound launchers of the GEMM kernels), :mod:`.copy` (the pad-copy kernel), :mod:`.gated`,
:mod:`.gated_launchers` (the gated GEMM), :mod:`.gated_product` (the gated product pass and its backward),
:mod:`.gated_packed`, :mod:`.packed_launchers` (the gated GEMM on packed weights).
"""
