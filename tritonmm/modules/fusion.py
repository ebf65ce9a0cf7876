"""``fuse`` / ``unfuse``: module patterns that run as fewer, fused GEMMs.

* **Gated MLPs** (Llama, Mistral, Qwen2, Gemma) run gate and up as one GEMM. An MLP module qualifies
  when its forward is transformers' Llama-family forward, ``down_proj(act_fn(gate_proj(x)) *
  up_proj(x))`` (compared as bytecode, so copies of it in other model files and user classes written
  the same way qualify), its three projections are nn.Linear modules running nn.Linear's forward (or
  tritonmm's swapped one), and ``act_fn`` is a known activation (SiLU, GELU, tanh-GELU, ReLU; torch's
  or transformers' modules). At call time the fused forward runs :func:`tritonmm.gated_linear` on the
  gate and up weights where they are, then ``down_proj`` as a module: one Triton GEMM for up to
  :data:`tritonmm.dispatch.gated.GATED_MAX_M` rows (decode), and without autograd up to
  :data:`tritonmm.dispatch.gated.KERNEL_MAX_FLOPS_NO_GRAD` per projection; above, cuBLAS projections (one GEMM where the
  weights are packed) and one Triton pass for the activation and the product (under ``torch.compile``,
  the expression Inductor fuses itself); calls above 16 rows and below
  :data:`tritonmm.dispatch.gated.PRODUCT_MIN_FLOPS` (:data:`~tritonmm.dispatch.gated.PRODUCT_MIN_FLOPS_NO_GRAD`
  without autograd) run the recognised forward.
* **Linear + activation** in an ``nn.Sequential`` (a Linear as above directly followed by a known
  activation module) run as one :func:`tritonmm.linear` call with the activation in the GEMM's
  epilogue, any number of rows; the Sequential's other modules run as they are. Where every such
  pair's weight goes to cuBLAS in all its GEMMs, the Sequential settles after one call into
  nn.Sequential's own forward, as swapped layers do (:mod:`tritonmm.modules.linear`); it comes back on ``.to()``,
  on assigning a module to it (``seq[i] = m``), ``force_backend`` and ``clear_cache``. Modules added
  through ``append``, ``insert`` or ``del`` to a settled Sequential run unfused until one of those.
* **Attention projections** (Llama, Mistral, Qwen2, Qwen3): where ``q_proj``, ``k_proj`` and ``v_proj``
  read the attention's hidden states, their packed weights run as one cuBLAS GEMM while a CUDA graph of an
  inference forward is captured (:mod:`tritonmm.modules.qkv`), and in inference forwards ``torch.compile`` traces
  where :data:`tritonmm.modules.qkv_traced.SERVE_COMPILED` is on; with ``pack=False`` attentions are not fused.
* **RMSNorms into the GEMMs after them** (while :data:`tritonmm.modules.norm_fold.FOLD` is on, as by default): a
  decoder layer that passes an RMSNorm's output straight to a fused MLP, or to a fused attention (Llama-family
  layers), has the norm computed in the gated kernel's loads, or in the q/k/v GEMM's, in inference calls of up to
  16 rows (:mod:`tritonmm.modules.norm_fold`).

Like :func:`tritonmm.swap_linear`, ``fuse`` changes the module's class in place to a subclass, so
parameters, ``state_dict``, hooks, tied weights and ``isinstance`` are untouched. By default it also
packs each fused MLP's gate and up weights, and each fused attention's q, k and v weights, into one
allocation (:mod:`tritonmm.modules.packing`): the same parameter objects and values, moved, so that calls on
cuBLAS run those projections as one GEMM; ``unfuse`` gives them their own storage again. Calls where a forward
or backward hook is registered on a module the fusion would skip (``gate_proj``, ``up_proj``,
``act_fn``; the Linear and its activation) or globally, or an instance's ``forward`` is replaced
(accelerate's hooks do that), modules that are no longer such Linears or activations (a class whose
``forward`` or ``__call__`` was replaced), and weights or biases of a tensor subclass run as the unfused
modules.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Proxy as _Proxy

from ..api import linear, torch_planned
from ..core.modes import PLAIN
from ..dispatch.gated import norm_forward, norm_replay, torch_serves
from ..dispatch.gated import norm_runs as _norm_runs
from ..dispatch.gated_cublas import serves
from ..ops.gated import _fast_key, gated_linear
from ..ops.gated_mlp import gated_mlp
from ..ops.gated_args import kernel_shaped
from . import norm_fold, packing, qkv
from .linear import _original_forward, _settled_forward, reduce_as_base, require_module, settle, settled_class, \
    subclassable
from .plain import MISSING as _MISSING
from .plain import activation_name, code_form
from .plain import any_hooked as _any_hooked
from .plain import global_hooks as _global_hooks
from .plain import linear_type as _linear_type
from .plain import param as _param
from .plain import plain_linear as _plain_linear


def _llama_mlp_forward(self, x):  # transformers' LlamaMLP.forward, verbatim: the form fuse recognizes
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _llama_mlp_forward_return(self, x):  # the same without the local variable
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_FORMS = {code_form(_llama_mlp_forward), code_form(_llama_mlp_forward_return)}


def _plain_params(weight, bias) -> bool:
    """Parameters the fused calls may read: plain tensors (a subclass with its own F.linear keeps it)."""
    return type(weight) in PLAIN and (bias is None or type(bias) in PLAIN)


def _gated_mlp(module: nn.Module) -> bool:
    if code_form(type(module).forward) not in _FORMS:
        return False
    gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not all(_plain_linear(m) for m in (gate, up, down)):
        return False
    return gate.weight.shape == up.weight.shape and (gate.bias is None) == (up.bias is None) \
        and activation_name(getattr(module, "act_fn", None)) is not None


def _linear_activation_pairs(module: nn.Module) -> bool:
    if type(module).forward is not nn.Sequential.forward:
        return False
    children = list(module._modules.values())
    return any(_plain_linear(m) and activation_name(a) is not None for m, a in zip(children, children[1:]))


def fusable(module: nn.Module) -> bool:
    """Whether ``module`` has a pattern :func:`fuse` fuses (see the module docstring). An attention is fused
    only where ``fuse`` can pack its q, k and v weights (``pack=True``, weights :func:`tritonmm.modules.qkv.pack`
    takes)."""
    if "_tritonmm_fused_base" in type(module).__dict__:
        return False
    return subclassable(type(module)) and (_gated_mlp(module) or _linear_activation_pairs(module)
                                           or qkv.fusable(module)) or norm_fold.foldable(module)


def _kind(cls: type) -> Optional[str]:
    """What a fused class fuses: "mlp", "attention", "sequential" or "layer" (norms folded into the GEMMs after
    them); None for other classes."""
    if "_tritonmm_fused_base" not in cls.__dict__:  # (a settled fused Sequential's class carries the mark too)
        return None
    forward = cls.forward
    if forward is _fused_forward:
        return "mlp"
    if "_tritonmm_folds" in cls.__dict__:
        return "layer"
    return "attention" if getattr(forward, "_tritonmm_qkv", False) else "sequential"


_F_linear = F.linear
_is_compiling = torch.compiler.is_compiling
_TORCH_LINEAR_FORWARDS = (_original_forward, _settled_forward)
_grad_enabled = torch.is_grad_enabled


def _kernel_dtype_device(x) -> bool:
    """Whether the gated kernels take ``x``'s dtype and device (False for what is not a tensor)."""
    try:
        return serves(x)
    except AttributeError:
        return False


def _unbiased_weight(up):
    """The up projection's weight where it has no bias (the packed kernel's case), else None."""
    return _param(up, "weight", None) if _param(up, "bias", None) is None else None


def _folded(self, x, pending):
    """The MLP on the norm's input ``x`` with ``pending``'s RMSNorm in the gated kernel's loads
    (:mod:`tritonmm.modules.norm_fold`), or None where that kernel does not serve it."""
    mods = self._modules
    gate, up, act, down = mods.get("gate_proj"), mods.get("up_proj"), mods.get("act_fn"), mods.get("down_proj")
    name = activation_name(act)
    if name is None or not (_linear_type(gate) and _linear_type(up) and _linear_type(down)) \
            or type(down).forward not in _TORCH_LINEAR_FORWARDS or _any_hooked(gate, up, act, down):
        return None
    (wg, bg), (wu, bu), (wd, bd) = ((_param(m, "weight"), _param(m, "bias")) for m in (gate, up, down))
    nw, eps = _param(pending.norm, "weight"), pending.norm.variance_epsilon
    try:  # (the gated linear's fast-path key: modes, gradients, shapes, strides, dtypes, devices, alignments)
        key = _fast_key(x, wg, wu, bg, bu, name)
        key = key and (key, type(nw), nw.shape, nw.stride(), nw.dtype, nw.device, nw.data_ptr() & 15, eps)
    except (AttributeError, RuntimeError, TypeError):
        key = None
    run = _norm_runs.get(key) if key and not _grad_enabled() else None
    if run is not None and _plain_params(wd, bd):
        return _F_linear(run(x, wg, wu, bg, bu, nw), wd, bd)
    if not (_plain_params(wg, bg) and _plain_params(wu, bu) and _plain_params(wd, bd)
            and kernel_shaped(x, wg, wu, bg, bu)):
        return None
    h = norm_forward(x, nw, eps, wg, wu, bg, bu, name)
    if h is not None and key and not _grad_enabled():
        run = norm_replay(x, nw, eps, wg, wu, bg, bu, name)
        if run is not None:
            if len(_norm_runs) >= 1024:
                _norm_runs.clear()
            _norm_runs[key] = run
    return None if h is None else _F_linear(h, wd, bd)


def _fused_forward(self, x):
    pending = norm_fold.take(self, x) if "_tritonmm_norm" in self.__dict__ else None
    if pending is not None:  # x is a folding layer's norm's input (norm_fold)
        y = _folded(self, x, pending)
        if y is not None:
            return y
        x = pending.normalize(x)
    mods = self._modules
    gate, up, act, down = mods.get("gate_proj"), mods.get("up_proj"), mods.get("act_fn"), mods.get("down_proj")
    if not isinstance(x, _Proxy) and gate is not None and up is not None and down is not None:  # (fx records modules)
        compiling = _is_compiling()
        if not compiling and (torch_serves(x, _param(gate, "weight", None), _unbiased_weight(up))
                              or not _kernel_dtype_device(x)):
            # the recognised forward on the modules already looked up (self.<name> costs a Module.__getattr__ each):
            # the torch expression serves the call (rows, FLOP), or no gated kernel takes x's dtype and device
            return down(act(gate(x)) * up(x)) if act is not None else down(self.act_fn(gate(x)) * up(x))
        name = activation_name(act)
        plain = _plain_linear if compiling else _linear_type  # (a traced fill of the cache fails the trace's guard)
        if name is not None and plain(gate) and plain(up) and not _any_hooked(gate, up, act):
            pg, pu = gate._parameters, up._parameters
            wg, wu, bg, bu = pg.get("weight", _MISSING), pu.get("weight", _MISSING), pg.get("bias", _MISSING), \
                pu.get("bias", _MISSING)
            if wg is _MISSING or wu is _MISSING or bg is _MISSING or bu is _MISSING:  # not parameters: as modules read them
                wg, wu, bg, bu = _param(gate, "weight"), _param(up, "weight"), _param(gate, "bias"), _param(up, "bias")
            if _plain_params(wg, bg) and _plain_params(wu, bu):  # (torch_serves was checked above)
                if type(down).forward in _TORCH_LINEAR_FORWARDS and plain(down) and not _any_hooked(down):
                    wd, bd = _param(down, "weight"), _param(down, "bias")
                    if not compiling and bg is None and bu is None and _grad_enabled():
                        y = gated_mlp(x, wg, wu, wd, bd, name)  # training: the MLP's autograd nodes on [G | U]
                        if y is not None:
                            return y
                    return _F_linear(gated_linear(x, wg, wu, bg, bu, name), wd, bd)  # its forward, without __call__
                return down(gated_linear(x, wg, wu, bg, bu, name))
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # the recognised forward, written out


def _fused_sequential_forward(self, input):
    """nn.Sequential's forward, with each plain Linear directly followed by a known activation module run
    as one :func:`tritonmm.linear` call with that activation in its epilogue. Where every fused pair's
    weight is planned to torch (cuBLAS and the activation: nothing left to fuse), the module settles
    into :func:`_settled_sequential_forward` (see :mod:`tritonmm.modules.linear`)."""
    children = list(self._modules.values())
    n, i, fused = len(children), 0, 0
    pairs = n > 1 and not _global_hooks()
    compiling = _is_compiling()
    settles = pairs and not compiling
    plain = _plain_linear if compiling else _linear_type  # (a traced fill of the cache fails the trace's guard)
    while i < n:
        m = children[i]
        if pairs and i + 1 < n:
            act = children[i + 1]
            name = activation_name(act)
            if name is not None and plain(m) and not _any_hooked(m, act):
                weight, bias = m.weight, m.bias
                if _plain_params(weight, bias):
                    input = linear(input, weight, bias, name)
                    settles = settles and torch_planned(weight)
                    fused += 1
                    i += 2
                    continue
        input = m(input)
        i += 1
    if settles and fused:
        settle(self)
    return input


def _settled_sequential_forward(self, input):
    """A settled fused Sequential's forward: nn.Sequential's (defined here so that torch.compile traces it
    as it traces the fused forward)."""
    for module in self:
        input = module(input)
    return input


_fused_classes: dict[type, type] = {}


def _new_fused(base: type) -> nn.Module:
    """Unpickling helper of earlier releases: an uninitialised instance of the fused class of ``base``."""
    return object.__new__(_fused_class(base))


def _rebuilt_fused(base: type, fn, args) -> nn.Module:
    """Unpickling helper: ``fn(*args)`` (its class's reduction), given the fused class of ``base``."""
    module = fn(*args)
    if type(module) is base:
        object.__setattr__(module, "__class__", _fused_class(base))
    return module


def _fused_reduce_ex(self, protocol):
    reduced = reduce_as_base(self, protocol, "_tritonmm_fused_base", _rebuilt_fused)
    if isinstance(reduced, tuple) and len(reduced) > 2:
        reduced = (*reduced[:2], qkv.state(self, reduced[2]), *reduced[3:])
    return reduced


def _fused_class(cls: type) -> type:
    if cls not in _fused_classes:
        sequential = cls.forward is nn.Sequential.forward
        attrs = {"forward": _fused_sequential_forward} if sequential else \
            {"forward": _fused_forward, "_tritonmm_takes_norm": True} if code_form(cls.forward) in _FORMS else \
            norm_fold.attributes() if norm_fold.fold_pairs(cls) else qkv.fused_attributes(cls)
        fused = _fused_classes[cls] = type(
            f"TritonFused{cls.__name__}", (cls,),
            {**attrs, "_tritonmm_fused_base": cls, "__module__": __name__, "__reduce_ex__": _fused_reduce_ex})
        if sequential:  # any module assigned to it may make or break a pair
            settled_class(fused, _settled_sequential_forward, lambda name, value: isinstance(value, nn.Module))
    return _fused_classes[cls]


def fuse(model: nn.Module, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
         pack: bool = True) -> nn.Module:
    """Fuse, in place, every gated MLP of ``model`` (gate and up as one GEMM), every Linear directly
    followed by a known activation module in an ``nn.Sequential`` (the activation in the GEMM's epilogue),
    with ``norm_fold.FOLD`` every decoder layer's RMSNorms before a fused MLP or attention
    (:mod:`tritonmm.modules.norm_fold`)
    and, with ``pack``, every attention whose q, k and v projections read its hidden states (one GEMM while a CUDA
    graph of an inference forward is captured, :mod:`tritonmm.modules.qkv`).

    Args:
        model: any module tree (the root included).
        filter_fn: ``(module, fully_qualified_name) -> bool``, asked once for each MLP, attention,
            Sequential or decoder layer that qualifies (:func:`fusable`) and, with ``pack``, each MLP or attention
            fused already; default: all of them.
        pack: also store each fused MLP's gate and up weights in one allocation, gate first, and each
            attention's q, k and v weights (and biases, where all three have one) in one allocation, in that
            order (:mod:`tritonmm.modules.packing`: the same parameters, values and memory), so that calls that take
            cuBLAS projections (:data:`tritonmm.dispatch.gated.PRODUCT_MIN_FLOPS`) run them as one GEMM. Weights that
            cannot move (MLP biases, tensor subclasses, inference tensors, other tensors viewing them, memory
            torch did not allocate (numpy, DLPack, memory-mapped), CPU weights outside Triton's interpreter)
            stay where they are. A later ``.to()`` that moves the parameters unpacks them: call ``fuse`` again
            to pack them. CUDA graphs captured before packing read the weights' old memory: capture them again.
            Packed weights share one storage, as do their gradients: safetensors' ``save_model`` /
            ``load_model`` refuse that, and plain ``pickle`` (not ``torch.save``) writes the whole storage for
            each; :func:`unfuse` first, or ``pack=False``.

    Modules whose class (or a base) defines an ``__init_subclass__`` of its own are left as they are (it may need
    arguments, or register the fused class). The Linears stay nn.Linear modules: :func:`tritonmm.swap_linear` may
    route ``down_proj`` (and unfused layers) through tritonmm as well. Fused models pickle and deep-copy as fused
    models.

    Returns:
        The same ``model`` object.

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    require_module(model, "fuse")
    for fqn, module in model.named_modules():
        kind = _kind(type(module))
        unfused = kind is None and subclassable(type(module))
        new = unfused and (_gated_mlp(module) or _linear_activation_pairs(module))
        attention = pack and unfused and not new and qkv.fusable(module)
        again = pack and kind in ("mlp", "attention")  # fused already: packed here if it is not
        if (new or attention or again) and (filter_fn is None or filter_fn(module, fqn)):
            if new:
                module.__class__ = _fused_class(type(module))
            if attention or kind == "attention":
                if qkv.pack(module) and attention:
                    module.__class__ = _fused_class(type(module))
                continue
            pair = _gate_up(module) if pack and type(module).forward is _fused_forward else None
            if pair:
                packing.pack(*pair, accept=serves)
    for fqn, module in model.named_modules() if norm_fold.FOLD else ():  # (after the MLPs, which layers fold into)
        if _kind(type(module)) is None and norm_fold.foldable(module) and (filter_fn is None or filter_fn(module, fqn)):
            module.__class__ = _fused_class(type(module))
    return model


def _gate_up(module: nn.Module) -> Optional[tuple]:
    """A fused MLP's (gate_proj, up_proj), or None where either is not a module."""
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    return (gate, up) if isinstance(gate, nn.Module) and isinstance(up, nn.Module) else None


def unfuse(model: nn.Module, unpack: bool = True) -> nn.Module:
    """Undo :func:`fuse`: every fused module gets its original class back, in place, and with ``unpack``
    its packed weights (gate and up; q, k and v) get their own storage again (:func:`tritonmm.modules.packing.unpack`).

    Returns:
        The same ``model`` object.

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    require_module(model, "unfuse")
    for module in model.modules():
        base = type(module).__dict__.get("_tritonmm_fused_base")
        if base is not None:
            kind = _kind(type(module))
            pair = _gate_up(module) if unpack and kind == "mlp" else None
            if pair:
                packing.unpack(*pair)
            if kind == "attention":
                qkv.drop(module)
                if unpack:
                    qkv.unpack(module)
            module.__class__ = base
    return model
