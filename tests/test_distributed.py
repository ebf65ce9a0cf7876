"""DTensor sharding of the tritonmm ops: two gloo ranks on CPU (placements and values), plus the rules alone."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_two_rank_dtensor_placements_and_values():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU ranks route to torch.matmul
    env["PYTHONPATH"] = str(WORKER.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}; stdout: {out[-500:]}; stderr: {err[-3000:]}"
        assert out.strip().splitlines()[-1].startswith("OK"), out


def test_strategies_registered_after_late_import():
    """tritonmm imported before torch.distributed.tensor: the strategies still get registered."""
    code = ("import sys, tritonmm\n"
            "assert 'torch.distributed.tensor' not in sys.modules\n"
            "import torch, torch.distributed.tensor\n"
            "from torch.distributed.tensor import DTensor\n"
            "table = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
            "assert torch.ops.tritonmm.matmul.default in table and torch.ops.tritonmm.linear.default in table\n"
            "print('registered')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "registered" in out.stdout, out.stderr


def test_linear_rules_drop_partial_with_activation():
    from torch.distributed.tensor import Partial

    from tritonmm.ops.distributed import _linear_strategies

    x, w, b = torch.empty(3, 4, 6), torch.empty(10, 6), torch.empty(10)
    with_none = _linear_strategies(x, w, b, "none")
    with_gelu = _linear_strategies(x, w, b, "gelu")
    assert any(isinstance(out[0], Partial) for out, _ in with_none)
    assert not any(isinstance(out[0], Partial) for out, _ in with_gelu)
    assert all(len(inp) == 4 and inp[3] is None for _, inp in with_none)  # activation is not a tensor
    assert all(inp[2] is None for _, inp in _linear_strategies(x, w, None, "none"))


def test_linear_rules_replicate_a_bias_broadcast_over_the_output():
    """A bias of more than one dimension ((M, N), (M, 1), ...) follows no row or column split of the output:
    everything replicated, as F.linear serves such calls."""
    from torch.distributed.tensor import Replicate

    from tritonmm.ops.distributed import _linear_strategies

    x, w = torch.empty(3, 4, 6), torch.empty(10, 6)
    for b in (torch.empty(4, 10), torch.empty(3, 4, 1)):
        strategies = _linear_strategies(x, w, b, "none")
        assert strategies and all(isinstance(p, Replicate) for out, inp in strategies for p in (*out, *inp[:3]))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "fsdp"])
def test_example_trains_on_cpu_with_gloo(parallel, tmp_path):
    """examples/train_distributed.py under torchrun, two CPU ranks, tritonmm on vs off: identical losses."""
    pytest.importorskip("transformers")
    example = WORKER.parent.parent / "examples" / "train_distributed.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo also on a GPU machine (one GPU cannot host two ranks)
    env["PYTHONPATH"] = str(WORKER.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    losses = {}
    for on in ("on", "off"):
        out = tmp_path / f"{on}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
               str(example), "--parallel", parallel, "--tritonmm", on, "--steps", "3", "--hidden", "64",
               "--layers", "1", "--seq", "16", "--batch", "2", "--vocab", "128", "--json", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        import json

        losses[on] = json.loads(out.read_text())["losses"]
    assert len(losses["on"]) == 3 and losses["on"] == losses["off"]  # CPU: tritonmm routes to torch, same numbers
