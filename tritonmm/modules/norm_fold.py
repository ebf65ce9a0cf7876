"""An RMSNorm folded into the gated GEMM that reads its output, at decode sizes.

In a Llama-family decoder layer the MLP's input is an RMSNorm's output (``post_attention_layernorm``), which eager
mode computes in eight kernels (cast, square, mean, add, rsqrt, scale, cast, weight) before the MLP reads it.
:func:`tritonmm.fuse` gives such a layer a subclass whose forward, for calls without autograd of up to
:data:`tritonmm.dispatch.gated.GATED_MAX_M` rows, lets the fused MLP read the norm's input instead: the gated
kernel normalizes each tile of X as it loads it, rounding where the module rounds
(:func:`tritonmm.dispatch.gated.norm_forward`), and the norm's output is never written.

How: while the layer's own forward runs (called as it is, its statements unchanged), the norm's instance ``forward``
is a :class:`Pending` that hands its input back unchanged and remembers it, and the fused MLP holds the same
:class:`Pending`; the MLP, called with that very tensor, runs the folded kernel, or runs the norm's own forward
first where it cannot (a geometry the gated kernel does not serve yet, hooks, another path). Both attributes are
removed when the layer's forward returns or raises; a call from another thread meanwhile runs the norm as it is.

Which layers (:func:`fold_pairs`, read once per class from its forward's source with :mod:`ast`): the forward
assigns ``X = self.<norm>(...)`` and its next statement is ``X = self.<mlp>(X)``, so nothing else reads the norm's
output; ``<norm>`` is a module whose class's forward is transformers' ``LlamaRMSNorm.forward`` (compared as
bytecode: Mistral's, Qwen2's and Qwen3's are the same), with a ``weight`` parameter and a float
``variance_epsilon``, and ``<mlp>`` a fused gated MLP. Calls with autograd, under ``torch.compile`` (Inductor fuses
the norm itself), with hooks on the norm, the MLP or globally, or an instance ``forward`` on either run the layer
as it is.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from typing import Optional

import torch
from torch import nn

from ..dispatch.gated import GATED_MAX_M
from .plain import MODULE_CALL, any_hooked


def _llama_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # transformers', verbatim
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _code_form(fn) -> Optional[tuple]:
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_code, code.co_names, code.co_consts[1:], code.co_argcount)


_NORM_FORM = _code_form(_llama_rms_norm_forward)
_get_ident = threading.get_ident
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


def rms_norm(module) -> bool:
    """Whether ``module`` is transformers' LlamaRMSNorm as the gated kernel computes it: its class's forward
    (bytecode), called as modules are called, a 1-D ``weight`` parameter and a float ``variance_epsilon``."""
    t = type(module)
    if not isinstance(module, nn.Module) or _code_form(t.forward) != _NORM_FORM or t.__call__ is not MODULE_CALL:
        return False
    w = module._parameters.get("weight")
    return w is not None and type(w) in (nn.Parameter, torch.Tensor) and w.dim() == 1 \
        and type(module.__dict__.get("variance_epsilon")) is float


def _self_call(node, name: Optional[str] = None) -> Optional[str]:
    """``self.<attr>(...)`` with positional arguments only (the first ``name`` alone, where given): ``attr``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" and not node.keywords):
        return None
    if name is not None and not (len(node.args) == 1 and isinstance(node.args[0], ast.Name)
                                 and node.args[0].id == name):
        return None
    return node.func.attr


def _assigned(stmt) -> Optional[str]:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    return None


_pairs: dict = {}


def fold_pairs(cls: type) -> tuple:
    """((mlp attribute, norm attribute), ...) of the statement pairs ``X = self.<norm>(...)``, ``X = self.<mlp>(X)``
    in ``cls.forward``'s source (empty where there is none or no source)."""
    forward = cls.__dict__.get("forward", getattr(cls, "forward", None))
    if forward in _pairs:
        return _pairs[forward]
    pairs = []
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(forward)))
        body = ast.parse(source).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        body = []
    for first, second in zip(body, body[1:]):
        name = _assigned(first)
        norm = _self_call(first.value) if name else None
        mlp = _self_call(second.value, name) if norm and _assigned(second) == name else None
        if mlp:
            pairs.append((mlp, norm))
    _pairs[forward] = tuple(pairs)
    return _pairs[forward]


_CHECKPOINTING = ("transformers.modeling_layers", "GradientCheckpointingLayer")


def subclassable(cls: type) -> bool:
    """Whether a folding subclass of ``cls`` may be made: no class of its MRO defines an ``__init_subclass__`` but
    transformers' ``GradientCheckpointingLayer`` (whose hook wraps the subclass's forward in its checkpointing,
    which runs the forward as it is without autograd)."""
    return all((c.__module__, c.__qualname__) == _CHECKPOINTING for c in cls.__mro__[:-1]
               if "__init_subclass__" in c.__dict__)


def foldable(module) -> bool:
    """Whether :func:`tritonmm.fuse` makes ``module`` a folding layer: a pair of :func:`fold_pairs` whose norm is
    :func:`rms_norm` and whose MLP is fused (its class marked ``_tritonmm_takes_norm``)."""
    mods = module._modules
    return subclassable(type(module)) and any(rms_norm(mods.get(n)) and getattr(type(mods.get(m)), "_tritonmm_takes_norm", False)
               for m, n in fold_pairs(type(module)))


class Pending:
    """The norm's instance forward while a folding layer runs: its input back, remembered (one call of up to
    ``GATED_MAX_M`` rows, from the thread that armed it); other calls run the norm's own forward."""

    __slots__ = ("norm", "x", "thread")

    def __init__(self, norm):
        self.norm, self.x, self.thread = norm, None, _get_ident()

    def __call__(self, x):
        if self.x is None and type(x) is _Tensor and _get_ident() == self.thread and x.dim() \
                and x.shape[-1] and x.numel() <= GATED_MAX_M * x.shape[-1]:
            self.x = x
            return x
        return self.normalize(x)

    def normalize(self, x):
        """The norm's own forward on ``x`` (what the layer would have passed on)."""
        return type(self.norm).forward(self.norm, x)


def take(mlp, x) -> Optional[Pending]:
    """The :class:`Pending` whose input ``x`` is (the MLP must normalize it, or fold the norm), or None."""
    pending = mlp.__dict__.get("_tritonmm_norm")
    if pending is None or pending.x is not x or x is None:
        return None
    pending.x = None
    return pending


def _folding_forward(self, *args, **kwargs):
    base = type(self)._tritonmm_fused_base
    if _grad_enabled() or _is_compiling():
        return base.forward(self, *args, **kwargs)
    armed = []
    mods = self._modules
    for m, n in fold_pairs(base):
        mlp, norm = mods.get(m), mods.get(n)
        if getattr(type(mlp), "_tritonmm_takes_norm", False) and rms_norm(norm) and not any_hooked(norm, mlp) \
                and "_tritonmm_norm" not in mlp.__dict__:
            pending = Pending(norm)
            norm.__dict__["forward"] = mlp.__dict__["_tritonmm_norm"] = pending
            armed.append((norm, mlp, pending))
    try:
        return base.forward(self, *args, **kwargs)
    finally:
        for norm, mlp, pending in armed:
            if norm.__dict__.get("forward") is pending:
                del norm.__dict__["forward"]
            if mlp.__dict__.get("_tritonmm_norm") is pending:
                del mlp.__dict__["_tritonmm_norm"]


def attributes() -> dict:
    """The class attributes of a folding layer's class (besides the marks every fused class has)."""
    return {"forward": _folding_forward, "_tritonmm_folds": True}
