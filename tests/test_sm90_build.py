"""The split-K TMA kernel builds for Hopper (sm_90) on a machine without a GPU: Triton compiles it to
a cubin (its bundled ptxas), so a config or variant that does not compile, or does not fit an H200's
shared memory, fails here rather than on the GPU. The variants include M = N = 1, which Triton turns
into compile-time constants (an integer argument equal to 1 is specialized): code that treats M as a
tensor fails to compile there only."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tritonmm.kernels import configs as cfg

HERE = pathlib.Path(__file__).resolve().parent
H200_SMEM = 232448  # bytes of shared memory per block (sm_90)


@pytest.mark.slow
def test_split_k_tma_configs_build_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(HERE / "sm90_build.py"), "split"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    n_split = sum(c["SPLIT_K"] > 1 for c in cfg.candidates("tma"))
    assert n_split >= 1 and len(rows) == 3 * n_split  # every split config, in every variant
    for r in rows:
        assert "error" not in r, r
        assert 0 < r["shared"] <= H200_SMEM, r
        # the pruning estimate never admits a config the GPU cannot hold (it may be generous)
        assert cfg.smem_bytes(r["config"], 2, 2, "tma") >= r["shared"] - 64, r
