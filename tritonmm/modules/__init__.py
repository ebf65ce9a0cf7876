"""Layer 6, modules: tritonmm inside ``nn.Module`` trees; imports :mod:`tritonmm.api` and the layers below.

:mod:`.linear` (``TritonLinear``, ``swap_linear`` / ``patch_linear`` and settled layers), :mod:`.plain` (which
modules the fusions may look through), :mod:`.fusion` (``fuse`` / ``unfuse``), :mod:`.qkv` (attention projections as
one GEMM), :mod:`.packing` (parameters moved into one allocation).
"""
