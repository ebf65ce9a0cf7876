"""torch.library registration: ``tritonmm::matmul`` and ``tritonmm::linear``.

Each op works as a ``torch.library.triton_op`` does (registered here without one, so that
``import tritonmm`` does not import Triton): run on real tensors, it is the runner
(:mod:`tritonmm.dispatch.runners`: the cached decision, then a Triton kernel or torch); when
``torch.compile`` functionalizes it, its body decides at trace time and records aten GEMMs or a
``wrap_triton`` kernel launch (:mod:`tritonmm.ops.traced`); ``torch.export`` keeps the op itself. Each has an autograd
formula (:mod:`tritonmm.ops.grads`) whose GEMMs run through tritonmm again, and autocast rules (CUDA and
CPU) that cast floating inputs to the autocast dtype as torch.matmul / F.linear do. Two opaque helper
ops, ``tritonmm::kernel_matmul`` and ``tritonmm::kernel_linear``, run a given Triton kernel and config:
traced graphs use them where ``wrap_triton`` cannot serve (Triton's interpreter, batched problems).

The schemas name the arguments as tritonmm 0.1.0 did (``a``, ``b``; ``x``, ``weight``, ``bias``, ``activation``),
not as torch does (``input``, ``other``; ``input``, ...): ``torch.export.load`` finds a saved program's arguments by
these names. Their errors name torch's argument as well.
"""

from __future__ import annotations

import json
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from ..core import shapes
from ..dispatch import decide, runners
from . import eager, grads, traced


def _decomposed(body):
    """A FunctionalTensorMode rule running ``body`` under the mode (what ``triton_op`` registers):
    torch.compile records what the body calls; torch.export keeps the op."""
    def rule(mode, op, types, args, kwargs):
        if not getattr(torch._functorch.config, "decompose_custom_triton_ops", True):  # torch.export
            return mode.__torch_dispatch__(op, types, args, kwargs)
        if any(not issubclass(t, (FakeTensor, FunctionalTensor)) and t is not Tensor for t in types):
            return NotImplemented
        with mode:
            return body(*args, **kwargs)
    return rule


@torch.library.custom_op("tritonmm::matmul", mutates_args=())
def _matmul_op(a: Tensor, b: Tensor) -> Tensor:
    eager.require_tensor("a", a, "matmul", "input")  # (the dispatcher passes None for a Tensor argument)
    eager.require_tensor("b", b, "matmul", "other")
    return runners.matmul(a, b)


@_matmul_op.register_fake
def _matmul_fake(a: Tensor, b: Tensor) -> Tensor:
    shapes.check_inputs(a, b)
    return a.new_empty(shapes.output_shape(a, b))


_matmul_op.register_torch_dispatch(FunctionalTensorMode, _decomposed(traced.matmul))
_matmul_op.register_autograd(grads.matmul_backward, setup_context=grads.matmul_setup_context)


@torch.library.custom_op("tritonmm::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    eager.require_tensor("x", x, "linear", "input")
    eager.require_tensor("weight", weight, "linear")
    return runners.linear(x, weight, bias, activation)


@_linear_op.register_fake
def _linear_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    shapes.check_linear(x, weight, bias, activation)
    if shapes.torch_form(x, weight, bias):  # F.linear's own checks and shape; its eager result has x's dtype (an in-place add)
        return x.new_empty(torch.nn.functional.linear(x, weight, bias).shape)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_linear_op.register_torch_dispatch(FunctionalTensorMode, _decomposed(traced.linear))
_linear_op.register_autograd(grads.op_linear_backward, setup_context=grads.op_linear_setup_context)


def _forcing(kernel: str, config: str):
    return decide.forcing_as(("triton", kernel, tuple(sorted(json.loads(config).items())) if config else None))


@torch.library.custom_op("tritonmm::kernel_matmul", mutates_args=())
def _kernel_matmul(a: Tensor, b: Tensor, kernel: str, config: str) -> Tensor:
    with _forcing(kernel, config):
        return runners.matmul(a, b)


@_kernel_matmul.register_fake
def _kernel_matmul_fake(a, b, kernel, config):
    return a.new_empty(shapes.output_shape(a, b))


@torch.library.custom_op("tritonmm::kernel_linear", mutates_args=())
def _kernel_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, kernel: str,
                   config: str) -> Tensor:
    with _forcing(kernel, config):
        return runners.linear(x, weight, bias, activation)


@_kernel_linear.register_fake
def _kernel_linear_fake(x, weight, bias, activation, kernel, config):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# --------------------------------------------------------------------------- autocast

_autocast_lib = torch.library.Library("tritonmm", "IMPL")


def _autocast_cast(x, dtype):
    if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(dtype)
    return x


def _register_autocast(name: str) -> None:
    """Cast floating inputs (not float64) to the current autocast dtype, as torch does for matmul/linear."""
    op = getattr(torch.ops.tritonmm, name).default
    for device_type, key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
        dispatch_key = getattr(torch._C.DispatchKey, key)

        def kernel(keyset, *args, _device_type=device_type, _key=dispatch_key):
            dtype = torch.get_autocast_dtype(_device_type)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*(_autocast_cast(x, dtype) for x in args))

        _autocast_lib.impl(name, kernel, key, with_keyset=True)


_register_autocast("matmul")
_register_autocast("linear")
