"""Train a small Llama (transformers) on several GPUs with DDP, FSDP2 or tensor parallelism, tritonmm on or off.

    torchrun --nproc-per-node=2 examples/train_distributed.py --parallel ddp  --tritonmm on
    torchrun --nproc-per-node=2 examples/train_distributed.py --parallel fsdp --tritonmm off --steps 50
    torchrun --nproc-per-node=2 examples/train_distributed.py --parallel tp   --tritonmm on --json tp_on.json

With ``--tritonmm on`` every nn.Linear (attention and MLP projections, lm_head) runs
``tritonmm.linear`` through :func:`tritonmm.patch_linear`, in forward and backward; with
``--backend triton`` (the default) the Triton kernels serve every GEMM, so the run exercises
them rather than the cuBLAS fallback. Everything else is stock PyTorch:

* ``ddp``:  DistributedDataParallel over float32 weights, bfloat16 autocast, each rank its own data.
* ``fsdp``: FSDP2 (``fully_shard`` per decoder layer and the root) with a MixedPrecisionPolicy
  (bfloat16 parameters, float32 gradient reduction) and activation checkpointing of every layer.
* ``tp``:   ``parallelize_module`` with ColwiseParallel q/k/v/gate/up and RowwiseParallel o/down
  projections (DTensor weights: tritonmm's sharding strategies run the local GEMMs), bfloat16
  autocast; every rank sees the same data.

The model, data and optimizer are seeded, so an "on" and an "off" run see the same numbers and
their losses can be compared step by step. Rank 0 prints the loss per step and the median step
time; ``--json`` writes both. Without GPUs it runs on CPU with gloo, a smoke test: the GEMMs reach the Triton
kernels only under ``TRITON_INTERPRET=1`` (slow), else torch serves them (``--backend triton`` warns so).
Needs transformers (``pip install ".[examples]"``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", choices=["ddp", "fsdp", "tp"], required=True)
    p.add_argument("--tritonmm", choices=["on", "off"], default="on")
    p.add_argument("--backend", choices=["triton", "auto"], default="triton",
                   help="with --tritonmm on: force the Triton kernels (default) or let the dispatcher pick")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (per rank for ddp/fsdp)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, help="write losses and step times (rank 0)")
    return p.parse_args(argv)


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every run
    return LlamaForCausalLM(config).to(device)


def parallelize(model, args, device):
    """Wrap the model for the chosen parallelism; returns (model, autocast context factory)."""
    world = dist.get_world_size()
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
    if args.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), autocast
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # activation checkpointing (torch.utils.checkpoint, non-reentrant) of every decoder layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, contextlib.nullcontext
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (world,))
    plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model, autocast


def batches(args, rank: int, device):
    """Seeded random token batches: per rank for data parallelism, shared for tensor parallelism."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + (0 if args.parallel == "tp" else rank + 1))
    for _ in range(args.steps):
        yield torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)


def fingerprint(model) -> float:
    """Sum of |w| over all weights in float64 (sharded ones gathered; call on every rank): a sensitive
    check that two runs ended with the same weights."""
    from torch.distributed.tensor import DTensor

    total = 0.0
    for p in model.parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        total += t.double().abs().sum().item()
    return total


def count_gemm_paths() -> collections.Counter:
    """Tally, per call, the path tritonmm's dispatcher took (e.g. "triton:tma", "torch:None")."""
    from tritonmm import runners

    tally: collections.Counter = collections.Counter()
    lookup = runners.lookup

    def counted(*args):
        prepared = lookup(*args)
        tally[f"{prepared.decision.backend}:{prepared.decision.kernel}"] += 1
        return prepared

    runners.lookup = counted
    return tally


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    import tritonmm

    model = build_model(args, device)
    model, autocast = parallelize(model, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
    on = args.tritonmm == "on"
    paths = count_gemm_paths()
    patch = tritonmm.patch_linear() if on else contextlib.nullcontext()
    force = tritonmm.force_backend(args.backend) if on else contextlib.nullcontext()
    losses, times = [], []
    with patch, force:
        for step, tokens in enumerate(batches(args, rank, device)):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with autocast():
                logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            reported = loss.detach().clone()
            dist.all_reduce(reported, op=dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM)
            if not cuda:
                reported /= world
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(reported.item())
            if rank == 0:
                print(f"step {step:3d}  loss {losses[-1]:.5f}  {times[-1] * 1e3:.1f} ms", flush=True)
    weights = fingerprint(model)
    warm = 5 if len(times) > 10 else 0  # the first steps compile kernels and warm caches
    median_ms = statistics.median(times[warm:]) * 1e3
    if rank == 0:
        print(f"{args.parallel} tritonmm={args.tritonmm} world={world}: final loss {losses[-1]:.5f}, "
              f"median step {median_ms:.1f} ms (steps {warm}+), sum|w| {weights:.10g}; tritonmm GEMM calls on rank 0: {dict(paths)}")
        if args.json:
            args.json.write_text(json.dumps({
                "parallel": args.parallel, "tritonmm": args.tritonmm, "backend": args.backend if on else "torch",
                "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                "gemm_paths_rank0": dict(paths), "weights_abs_sum": weights, "losses": losses, "step_ms": [t * 1e3 for t in times], "median_step_ms": median_ms}, indent=1))
    dist.barrier()  # every rank done with its collectives before any tears down (gloo aborted at exit otherwise)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: with gloo on CPU (torch 2.13) about one run in twenty aborted there, after
    # the process group was destroyed ("terminate called without an active exception" in a C++ destructor)
    os._exit(status)
