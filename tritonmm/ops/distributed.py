"""tritonmm under torch.distributed: DTensor sharding strategies for ``tritonmm::matmul`` and ``tritonmm::linear``.

With these, tensor parallelism (``ColwiseParallel``, ``RowwiseParallel``, ``parallelize_module``)
runs through tritonmm with the placements aten.mm / aten.linear would give: the local GEMM
on each rank is a tritonmm call on the local shards. DDP and FSDP2 need nothing here (their
forward sees plain tensors). Strategies, per mesh dimension (DTensor expands them over
multi-dimensional meshes), for C = A @ B:

* all replicated -> replicated;
* A sharded along M (or a batch dim)            -> C sharded the same way;
* B sharded along N                              -> C sharded along its last dim (``ColwiseParallel``);
* A and B sharded along K                        -> C ``Partial`` (sum), reduced by DTensor
  (``RowwiseParallel``); for ``linear`` only without an activation, the bias then ``Partial`` too.

Registered through ``torch.distributed.tensor.experimental.register_sharding`` as soon as
``torch.distributed.tensor`` is imported (before or after tritonmm), so ``import tritonmm``
itself stays lean. ``register()`` does it by hand and is idempotent.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading

_lock = threading.Lock()
_registered = False


def _matmul_strategies(a, b):
    """Acceptable (output placements, input placements) for torch.matmul(a, b) on one mesh dim."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    na, nb = a.ndim, b.ndim
    out_batch = max(na, nb, 2) - 2
    strategies = [([Replicate()], [Replicate(), Replicate()])]
    k_b = nb - 2 if nb >= 2 else 0
    strategies.append(([Partial()], [Shard(na - 1), Shard(k_b)]))  # split K: partial sums
    if na >= 2:  # rows of A
        strategies.append(([Shard(out_batch)], [Shard(na - 2), Replicate()]))
    if nb >= 2:  # columns of B
        out_n = out_batch + (1 if na >= 2 else 0)
        strategies.append(([Shard(out_n)], [Replicate(), Shard(nb - 1)]))
    for d in range(out_batch):  # batch dims (right-aligned broadcasting)
        da, db = d - (out_batch - (na - 2)), d - (out_batch - (nb - 2))
        sa = Shard(da) if da >= 0 and a.shape[da] != 1 else None
        sb = Shard(db) if db >= 0 and b.shape[db] != 1 else None
        if sa is None and sb is None:
            continue
        strategies.append(([Shard(d)], [sa or Replicate(), sb or Replicate()]))
    return strategies


def _linear_strategies(x, weight, bias=None, activation="none"):
    """Acceptable placements for act(F.linear(x, weight, bias)) on one mesh dim (bias None: no placement)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    R = Replicate()
    last = x.ndim - 1
    has_bias = bias is not None
    full_bias = has_bias and bias.ndim == 1 and bias.shape[0] == weight.shape[0] and weight.shape[0] != 1

    def with_bias(out, xs, ws, bs):
        return ([out], [xs, ws, bs if has_bias else None, None])

    strategies = [with_bias(R, R, R, R)]
    if has_bias and bias.ndim > 1:  # a bias F.linear broadcasts over the output: replicated, as F.linear serves it
        return strategies
    strategies.append(with_bias(Shard(last), R, Shard(0), Shard(0) if full_bias else R))  # ColwiseParallel
    for d in range(last):  # rows (sequence / batch) of x
        strategies.append(with_bias(Shard(d), Shard(d), R, R))
    if activation == "none":  # RowwiseParallel: partial sums; an activation does not commute with the sum
        strategies.append(with_bias(Partial(), Shard(last), Shard(1), Partial()))
    return strategies


def register() -> bool:
    """Register the sharding strategies with DTensor (idempotent). Returns False where torch.distributed
    is unavailable (e.g. some macOS or Windows builds)."""
    global _registered
    with _lock:
        if _registered:
            return True
        import torch

        if not torch.distributed.is_available():
            return False
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
        from torch.distributed.tensor.experimental import register_sharding

        from . import library  # noqa: F401  (the ops must exist first)

        register_sharding(torch.ops.tritonmm.matmul.default)(_matmul_strategies)
        linear = torch.ops.tritonmm.linear.default
        register_sharding(linear)(_linear_strategies)
        # DTensor caches sharding decisions per op schema; RuntimeSchemaInfo documents that only arguments
        # from static_argnum on are hashed, and register_sharding sets it from int arguments alone. Make
        # `activation` (argument 3) part of the key explicitly, or a cached "none" decision (Partial output)
        # could be reused for "gelu".
        DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[linear] = RuntimeSchemaInfo(
            static_argnum=3, needs_pytree=True)
        _registered = True
        return True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after ``torch.distributed.tensor`` is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed.tensor":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Register now if DTensor is loaded, else as soon as it is (called by ``import tritonmm``)."""
    if "torch.distributed.tensor" in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
