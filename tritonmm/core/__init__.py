"""Layer 1, core: facts and helpers every layer above uses, pure torch (no Triton at import), importing no other
part of tritonmm.

:mod:`.env` (environment switches), :mod:`.activations` (the epilogue activations in torch), :mod:`.device` (SM
count, shared memory, TMA, TF32), :mod:`.modes` (which calls may skip the dispatcher), :mod:`.shapes` (torch.matmul's
shape rules, the batched-GEMM plan), :mod:`.layout` (operand layouts, alignment, stacked tensors),
:mod:`.workspace` (reused scratch memory), :mod:`.reference` (the float64 reference and tolerances),
:mod:`.timing` (GPU timing of contenders side by side).
"""
