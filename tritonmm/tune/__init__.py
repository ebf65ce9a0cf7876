"""Tuning ahead of time: :func:`tritonmm.tune_model` (:mod:`.model`) and ``python -m tritonmm.tune`` (:mod:`.cli`).

Modules: :mod:`.capture` (the GEMMs a model runs), :mod:`.suite` (shape suites as JSON), :mod:`.measure` (every
candidate config against cuBLAS per shape, and the table entries decided from the measurements), :mod:`.model`
(``tune_model``), :mod:`.cli` (the command line). Below the package's public face (:mod:`tritonmm`), above the
library it measures: it imports from :mod:`tritonmm.api`, :mod:`tritonmm.dispatch` and :mod:`tritonmm.core`.
"""
