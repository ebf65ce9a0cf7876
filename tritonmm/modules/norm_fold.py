"""RMSNorms folded into the GEMMs that read their outputs, at decode sizes: the gated MLP's and the attention's q/k/v.

In a Llama-family decoder layer the MLP's input is an RMSNorm's output (``post_attention_layernorm``), which eager
mode computes in eight kernels (cast, square, mean, add, rsqrt, scale, cast, weight) before the MLP reads it.
:func:`tritonmm.fuse` gives such a layer a subclass whose forward, for calls without autograd of up to
:data:`tritonmm.dispatch.gated.GATED_MAX_M` rows, lets the fused MLP read the norm's input instead: the gated
kernel scales each tile of X as it loads it and applies each row's 1 / rms (:mod:`tritonmm.kernels.gated`,
:func:`tritonmm.dispatch.gated.norm_forward`), and the norm's output is never written.

How: while the layer's own forward runs (called as it is, its statements unchanged), the norm's instance ``forward``
is a :class:`Pending`, which the fused MLP holds too. Called from the norm's statement (the caller's code object and
line) with one tensor, it hands that tensor back unchanged and remembers it; every other call (another statement,
a hook, a keyword argument, another thread) runs the norm's own forward. The MLP, called with that very tensor,
runs the folded kernel, or the norm's own forward first where it cannot (a geometry the gated kernel does not
serve yet, hooks, another path). Both attributes are removed when the layer's forward returns or raises.

The same for the attention after ``input_layernorm``: a fused attention whose forward reads its input only as its
projections' argument and as ``.shape`` (:func:`tritonmm.modules.qkv.reads_shape_only`) is handed the norm's input,
and its one q/k/v GEMM reads it through the norm (:func:`tritonmm.dispatch.norm_linear.norm_linear`); where it cannot
serve the call, it passes the norm's output on to its forward.

Which layers (:func:`fold_pairs`, read once per class from its forward's source with :mod:`ast`): the forward
assigns ``X = self.<norm>(...)`` and its next statement rebinds X to ``self.<consumer>(...)`` called with X once
(positionally first or by keyword: ``X = self.<mlp>(X)``, ``X, _ = self.self_attn(hidden_states=X, ...)``), so
nothing else reads the norm's output; ``<norm>`` is a module whose class's forward is transformers'
``LlamaRMSNorm.forward`` (compared as bytecode: Mistral's, Qwen2's and Qwen3's are the same), with a ``weight``
parameter and a float ``variance_epsilon``, and ``<consumer>`` a fused gated MLP (called positionally) or such a
fused attention. Calls with autograd, under ``torch.compile`` (Inductor fuses the norm itself), with hooks on the
norm, the consumer or globally, or an instance ``forward`` on either run the layer as it is.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import threading
from typing import Optional

import torch
from torch import nn

from ..dispatch.gated import GATED_MAX_M
from .plain import MODULE_CALL, Stale, any_hooked, code_form, hooks_on

FOLD = True
"""Whether :func:`tritonmm.fuse` makes folding layers; layers made while it was on keep folding. On an H100, ``fuse``
with the folds ran the 8B-sized model's eager decode 1.105x (1 sequence) and 1.093x (16) of off, where ``fuse``
without them read 0.978x and 0.986x, and its 1 x 16 CUDA-graph replay 1.114x against 1.044x; the 1 x 512 eager
prefill, where nothing folds, read 0.964x against 0.978x (``benchmarks/diagnostics/h100_model_fold.json``)."""


def _llama_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # transformers', verbatim
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


_NORM_FORM = code_form(_llama_rms_norm_forward)
_get_ident = threading.get_ident
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


def rms_norm(module) -> bool:
    """Whether ``module`` is transformers' LlamaRMSNorm as the gated kernel computes it: its class's forward
    (bytecode), called as modules are called, a 1-D ``weight`` parameter and a float ``variance_epsilon``."""
    t = type(module)
    if not isinstance(module, nn.Module) or code_form(t.forward) != _NORM_FORM or t.__call__ is not MODULE_CALL:
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


def _passed(stmt, name: str) -> Optional[tuple]:
    """``(attr, key)`` where ``stmt`` rebinds ``name`` (alone or in a tuple) to ``self.<attr>(...)`` and that call reads
    ``name`` once: as its first positional argument (``key`` None) or as keyword ``key``; else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.Call)):
        return None
    target, call = stmt.targets[0], stmt.value
    names = target.elts if isinstance(target, ast.Tuple) else [target]
    if not any(isinstance(t, ast.Name) and t.id == name for t in names) or not isinstance(call.func, ast.Attribute) \
            or not isinstance(call.func.value, ast.Name) or call.func.value.id != "self":
        return None
    if sum(isinstance(n, ast.Name) and n.id == name for n in ast.walk(call)) != 1:
        return None
    if call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == name:
        return call.func.attr, None
    key = [k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == name]
    return (call.func.attr, key[0]) if key and key[0] is not None else None


_pairs: dict = {}


def _analysed(forward) -> tuple:
    """(pairs, sites) of a layer's ``forward``: :func:`fold_pairs`'s pairs, and for each norm attribute the code object
    and the lines of its statement (where :class:`Pending` hands the input back) and how the next statement passes
    the norm's output on (None: first positional argument; else the keyword)."""
    hit = _pairs.get(forward)
    if hit is not None:
        return hit
    pairs, sites = [], {}
    try:
        fn = inspect.unwrap(forward)
        lines, start = inspect.getsourcelines(fn)
        body = ast.parse(textwrap.dedent("".join(lines))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError, ValueError):
        fn, start, body = None, 0, []
    for first, second in zip(body, body[1:]):
        name = _assigned(first)
        norm = _self_call(first.value) if name else None
        passed = _passed(second, name) if norm else None
        if passed and getattr(fn, "__code__", None) is not None:
            pairs.append((passed[0], norm))
            sites[norm] = (fn.__code__, start + first.lineno - 1, start + first.end_lineno - 1, passed[1])
    if len(_pairs) >= 1024:
        _pairs.clear()
    hit = _pairs[forward] = (tuple(pairs), sites)
    return hit


def fold_pairs(cls: type) -> tuple:
    """((mlp attribute, norm attribute), ...) of the statement pairs ``X = self.<norm>(...)``, ``X = self.<mlp>(X)``
    in ``cls.forward``'s source (empty where there is none or no source)."""
    return _analysed(cls.__dict__.get("forward", getattr(cls, "forward", None)))[0]


_CHECKPOINTING = ("transformers.modeling_layers", "GradientCheckpointingLayer")


def subclassable(cls: type) -> bool:
    """Whether a folding subclass of ``cls`` may be made: no class of its MRO defines an ``__init_subclass__`` but
    transformers' ``GradientCheckpointingLayer`` (whose hook wraps the subclass's forward in its checkpointing,
    which runs the forward as it is without autograd)."""
    return all((c.__module__, c.__qualname__) == _CHECKPOINTING for c in cls.__mro__[:-1]
               if "__init_subclass__" in c.__dict__)


def foldable(module) -> bool:
    """Whether :func:`tritonmm.fuse` makes ``module`` a folding layer (with :data:`FOLD` on): a pair of
    :func:`fold_pairs` whose norm is :func:`rms_norm` and whose consumer is fused to take the norm's input (its class
    marked ``_tritonmm_takes_norm``: a gated MLP, or an attention whose q/k/v run as one GEMM)."""
    mods = module._modules
    return subclassable(type(module)) and any(
        rms_norm(mods.get(n)) and getattr(type(mods.get(m)), "_tritonmm_takes_norm", False)
        for m, n in fold_pairs(type(module)))


_MODULE_CALLS = nn.Module._call_impl.__code__.co_filename  # (torch's module call machinery: frames skipped)
_getframe = sys._getframe


class Pending:
    """The norm's instance forward while a folding layer runs: its input back, remembered, for one call of up to
    ``GATED_MAX_M`` rows from the layer's norm statement (``site``: the forward's code and lines) in the thread that
    armed it, while the norm and its consumer (the module that takes the norm's input) have no hooks and the consumer
    still takes it (checked again at the call: hooks registered, or ``unfuse`` run, since the layer armed it); every
    other call runs the norm's own forward. Copies and pickles taken meanwhile are :class:`~.plain.Stale`."""

    __slots__ = ("norm", "consumer", "x", "thread", "site", "key")

    def __init__(self, norm, consumer, site):
        self.norm, self.consumer, self.x, self.thread = norm, consumer, None, _get_ident()
        self.site, self.key = site[:3], site[3]

    def __call__(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        if self.x is None and type(x) is _Tensor and _get_ident() == self.thread and x.dim() \
                and x.shape[-1] and x.numel() <= GATED_MAX_M * x.shape[-1]:
            f = _getframe(1)
            while f is not None and f.f_code.co_filename == _MODULE_CALLS:
                f = f.f_back
            code, first, last = self.site
            consumer = self.consumer
            if f is not None and f.f_code is code and first <= f.f_lineno <= last \
                    and consumer.__dict__.get("_tritonmm_norm") is self \
                    and getattr(type(consumer), "_tritonmm_takes_norm", False) \
                    and not hooks_on(self.norm) and not any_hooked(consumer):  # (global hooks: any_hooked)
                self.x = x
                return x
        return type(self.norm).forward(self.norm, *args, **kwargs)

    def normalize(self, x):
        """The norm's own forward on ``x`` (what the layer would have passed on)."""
        return type(self.norm).forward(self.norm, x)

    def __reduce__(self):
        return Stale, (self.norm,)


def take(mlp, x) -> Optional[Pending]:
    """The :class:`Pending` whose input ``x`` is (the MLP must normalize it, or fold the norm), or None."""
    pending = mlp.__dict__.get("_tritonmm_norm")
    if type(pending) is not Pending or pending.x is not x or x is None:
        if type(pending) is Stale:  # (copied from a layer mid-call)
            del mlp.__dict__["_tritonmm_norm"]
        return None
    pending.x = None
    return pending


def _folding_forward(self, *args, **kwargs):
    base = type(self)._tritonmm_fused_base
    x = args[0] if args else kwargs.get("hidden_states")
    if _grad_enabled() or _is_compiling() or type(x) is _Tensor and x.dim() and x.numel() > GATED_MAX_M * x.shape[-1]:
        return base.forward(self, *args, **kwargs)  # (the layer's input has more rows than a fold takes: no arming)
    armed = []
    mods = self._modules
    pairs, sites = _analysed(base.forward)
    for m, n in pairs:
        mlp, norm = mods.get(m), mods.get(n)
        site = sites[n]
        if getattr(type(mlp), "_tritonmm_takes_norm", False) and rms_norm(norm) and not any_hooked(norm, mlp) \
                and "_tritonmm_norm" not in mlp.__dict__ \
                and (site[3] is None or getattr(type(mlp).forward, "_tritonmm_qkv", False)):
            pending = Pending(norm, mlp, site)
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
