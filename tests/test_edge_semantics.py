"""Corners of torch semantics found by adversarial review: tensor flags, autograd modes, module plumbing."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritonmm
from tritonmm.core.reference import randn

KERNELS = ["tma", "pointer", "splitk"]


# --------------------------------------------------------------------------- tensor flags


@pytest.mark.parametrize("kernel", KERNELS)
def test_neg_bit_views_are_read_with_their_sign(kernel):
    a = torch.randn(20, 32, dtype=torch.complex64).conj().imag  # a real view with the neg bit set
    b = torch.randn(32, 12, dtype=torch.complex64).conj().imag
    bias = torch.randn(12, dtype=torch.complex64).conj().imag
    assert a.is_neg() and b.is_neg() and bias.is_neg()
    with tritonmm.force_backend("triton", kernel):
        torch.testing.assert_close(tritonmm.matmul(a, b), torch.matmul(a, b))
        x = randn(5, 32)
        torch.testing.assert_close(tritonmm.linear(x, b.t(), bias), F.linear(x, b.t(), bias))


# three batch levels that cannot merge: the plan copies the operands for the kernels, and cuBLAS (the
# default for batched problems on a GPU) once got those flattened copies and returned (1, B, M, N)
THREE_LEVELS = [((3, 2, 6, 5), (2, 3, 1, 5, 7)), ((3, 2, 4, 6, 5), (3, 1, 4, 5, 7))]


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("sa,sb", THREE_LEVELS, ids=str)
def test_three_batch_levels_keep_torchs_shape(sa, sb, backend):
    a, b = randn(*sa).requires_grad_(), randn(*sb).requires_grad_()
    with tritonmm.force_backend(backend):
        out = tritonmm.matmul(a, b)
        ref = torch.matmul(a, b)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        g = randn(*ref.shape)
        ga, gb = torch.autograd.grad(out, (a, b), g)
        ra, rb = torch.autograd.grad(ref, (a, b), g)
    torch.testing.assert_close(ga, ra, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gb, rb, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_linear_on_permuted_batch_keeps_torchs_shape(backend):
    x = randn(4, 3, 2, 6, 5).permute(2, 1, 0, 3, 4)  # three batch levels that cannot merge
    w, bias = randn(7, 5), randn(7)
    with tritonmm.force_backend(backend):
        out = tritonmm.linear(x, w, bias)
        with tritonmm.patch_linear():
            lin = nn.Linear(5, 7).to(x.device)
            mod = lin(x)
    torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mod, F.linear(x, lin.weight, lin.bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["neg", "zero", "sparse"])
def test_explain_names_torch_for_tensors_the_kernels_do_not_read(kind):
    b = randn(36, 40)
    a = {"neg": lambda: torch.randn(40, 36, dtype=torch.complex64, device=b.device).conj().imag,
         "zero": lambda: torch._efficientzerotensor((40, 36), device=b.device),
         "sparse": lambda: randn(40, 36).to_sparse()}[kind]()
    with tritonmm.force_backend("triton"):
        d = tritonmm.explain(a, b)
        torch.testing.assert_close(tritonmm.matmul(a, b), torch.matmul(a, b))
    assert (d.backend, d.kernel) == ("torch", None), str(d)


@pytest.mark.interpreter  # Triton on CPU tensors
def test_explain_under_autocast_describes_the_cast_operands():
    a, b = randn(70, 36), randn(36, 36)  # bfloat16 rows of 36 elements: 72 bytes, not 16-byte aligned
    device = a.device.type
    with tritonmm.force_backend("triton", "tma"):
        with torch.autocast(device, dtype=torch.bfloat16):
            d = tritonmm.explain(a, b)
        cast = tritonmm.explain(a.to(torch.bfloat16), b.to(torch.bfloat16))
        plain = tritonmm.explain(a, b)
    assert d == cast and d.copies == ("a", "b") and plain.copies == (), (str(d), str(plain))


def test_zero_tensor_operand():
    z = torch._efficientzerotensor((5, 7))
    b = randn(7, 4)
    with tritonmm.force_backend("triton"):
        torch.testing.assert_close(tritonmm.matmul(z, b), torch.matmul(z, b))


@pytest.mark.interpreter  # Triton on CPU tensors
@pytest.mark.parametrize("kind", ["zero", "neg"])
def test_zero_and_neg_operands_after_the_geometry_ran_on_triton(kind):
    """A geometry's cached Triton runner must not read a zero tensor (no storage) or a pending negation."""
    x, w, bias = randn(8, 32), randn(16, 32), randn(16)
    odd = {"zero": lambda *s: torch._efficientzerotensor(s, device=x.device),
           "neg": lambda *s: torch.randn(*s, dtype=torch.complex64, device=x.device).conj().imag}[kind]
    with tritonmm.force_backend("triton", "pointer"):
        tritonmm.linear(x, w, bias)
        tritonmm.matmul(x, w.t())
        for args in [(x, w, odd(16)), (odd(8, 32), w, bias), (x, odd(16, 32), bias)]:
            torch.testing.assert_close(tritonmm.linear(*args), F.linear(*args), rtol=1e-5, atol=1e-5)
        for a, b in [(odd(8, 32), w.t()), (x, odd(32, 16))]:
            torch.testing.assert_close(tritonmm.matmul(a, b), torch.matmul(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_nested_tensors_served_by_torch(layout):
    nt = torch.nested.nested_tensor([randn(2, 7), randn(3, 7)], layout=layout)
    w, bias = randn(4, 7), randn(4)
    got, ref = tritonmm.linear(nt, w, bias, "relu"), F.relu(F.linear(nt, w, bias))
    for g, r in zip(got.unbind(), ref.unbind()):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


# --------------------------------------------------------------------------- autograd modes


def test_complex_gradients_conjugate_like_torch():
    a = torch.randn(3, 4, dtype=torch.complex128, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.complex128, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: tritonmm.matmul(x, y), (a, b))
    x = torch.randn(2, 3, 4, dtype=torch.complex128, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.complex128, requires_grad=True)
    bias = torch.randn(5, dtype=torch.complex128, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, w_, b_: tritonmm.linear(x_, w_, b_), (x, w, bias))
    v = torch.randn(4, dtype=torch.complex128, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, y_: tritonmm.matmul(x_, y_), (v, v.detach().clone().requires_grad_()))


@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_torch_func_transforms(op):
    a, b = randn(4, 6, dtype=torch.float64), randn(6, 3, dtype=torch.float64)
    if op == "matmul":
        def ours(x):
            return tritonmm.matmul(x, b)

        def ref(x):
            return torch.matmul(x, b)
    else:
        def ours(x):
            return tritonmm.linear(x, b.t(), None, "gelu")

        def ref(x):
            return F.gelu(F.linear(x, b.t()))
    t = torch.randn_like(a)
    for transform in (lambda f: torch.func.jvp(f, (a,), (t,))[1], lambda f: torch.func.jacfwd(f)(a),
                      lambda f: torch.func.jacrev(f)(a), lambda f: torch.func.grad(lambda x: f(x).sum())(a),
                      lambda f: torch.func.vmap(f)(a.unsqueeze(1)),
                      lambda f: torch.func.vmap(torch.func.grad(lambda x: f(x[None]).sum()))(a)):
        got, want = transform(ours), transform(ref)
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want)
    h = torch.func.hessian(lambda x: ours(x).square().sum())(a)
    torch.testing.assert_close(h, torch.func.hessian(lambda x: ref(x).square().sum())(a))


def test_forward_ad_dual_tensors():
    import torch.autograd.forward_ad as fwAD

    a, b, t = randn(5, 7), randn(7, 3), randn(5, 7)
    with fwAD.dual_level():
        y = tritonmm.matmul(fwAD.make_dual(a, t), b)
        tangent = fwAD.unpack_dual(y).tangent
        z = tritonmm.linear(fwAD.make_dual(a, t), b.t(), None, "silu")
        tz = fwAD.unpack_dual(z).tangent
    torch.testing.assert_close(tangent, t @ b)
    _, want = torch.func.jvp(lambda x: F.silu(x @ b), (a,), (t,))
    torch.testing.assert_close(tz, want)


@pytest.mark.parametrize("bias_shape", [(), (1,)], ids=str)
def test_linear_backward_with_scalar_bias(bias_shape):
    x, w = randn(5, 7).requires_grad_(), randn(4, 7).requires_grad_()
    b = randn(*bias_shape).requires_grad_()
    tritonmm.linear(x, w, b).square().sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).square().sum().backward()
    for g, t in zip(grads, (x, w, b)):
        assert g.shape == t.shape
        torch.testing.assert_close(g, t.grad)


@pytest.mark.parametrize("sx,sw", [((5, 0), (4, 0)), ((5, 7), (0, 7)), ((0, 7), (4, 7))], ids=str)
def test_backward_with_zero_size_dims(sx, sw):
    x, w = randn(*sx).requires_grad_(), randn(*sw).requires_grad_()
    tritonmm.linear(x, w).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert not x.grad.any() and not w.grad.any()
    a, b = randn(2, 5, 7).requires_grad_(), randn(7, 0).requires_grad_()
    tritonmm.matmul(a, b).sum().backward()
    assert a.grad.shape == a.shape and not a.grad.any() and b.grad.shape == b.shape


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
def test_double_backward(activation):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x_, w_: tritonmm.linear(x_, w_, None, activation), (x, w))


def test_only_needed_tensors_are_saved():
    """In-place updates that torch.matmul / F.linear tolerate between forward and backward are fine here too."""
    x, w = randn(6, 7), randn(4, 7).requires_grad_()
    bias = randn(4).requires_grad_()
    y = tritonmm.linear(x, w, bias)
    with torch.no_grad():
        bias.add_(1.0)  # bias is not needed by the backward of a linear without activation
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(6, 4).t() @ x)
    p = randn(5, 7).requires_grad_()
    a = p * 2
    y = tritonmm.matmul(a, randn(7, 4))
    a.relu_()  # a is not needed for dA
    y.sum().backward()
    assert p.grad.shape == p.shape


def test_backward_graph_saves_no_unneeded_operand():
    x, w = randn(6, 7).requires_grad_(), randn(4, 7)  # weight needs no grad: dX needs W, nothing needs X
    saved = []  # what autograd packs for backward (grad_fn.saved_tensors with a None raises on torch 2.11)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tritonmm.matmul(x, w.t())
    assert len(saved) == 1 and saved[0].shape == (7, 4) and saved[0].data_ptr() == w.data_ptr()


# --------------------------------------------------------------------------- API surface


def test_keyword_names_match_torch():
    a, b, bias = randn(3, 4), randn(4, 5), randn(5)
    torch.testing.assert_close(tritonmm.matmul(input=a, other=b), torch.matmul(input=a, other=b))
    torch.testing.assert_close(tritonmm.linear(input=a, weight=b.t(), bias=bias),
                               F.linear(input=a, weight=b.t(), bias=bias))


def test_ops_name_torchs_argument_in_their_errors():
    """The op schemas keep 0.1.0's argument names (programs saved by torch.export find arguments by name); a
    non-tensor argument's error names torch.matmul's / F.linear's argument as torch's own error does."""
    names = {op: [a.name for a in getattr(torch.ops.tritonmm, op).default._schema.arguments]
             for op in ("matmul", "linear")}
    assert names == {"matmul": ["a", "b"], "linear": ["x", "weight", "bias", "activation"]}
    a, w = randn(3, 4), randn(5, 4)
    for call, ref, name in ((lambda: torch.ops.tritonmm.matmul(a, None), lambda: torch.matmul(a, None), "other"),
                            (lambda: torch.ops.tritonmm.matmul(None, a), lambda: torch.matmul(None, a), "input"),
                            (lambda: torch.ops.tritonmm.linear(None, w), lambda: F.linear(None, w), "input"),
                            (lambda: torch.ops.tritonmm.linear(a, None), lambda: F.linear(a, None), "weight")):
        with pytest.raises(TypeError, match=f"'{name}'"):
            ref()
        with pytest.raises(TypeError, match=f"'{name}'"):
            call()


@pytest.mark.parametrize("bias", [1.0, [1.0, 2.0]], ids=str)
def test_non_tensor_bias_is_a_type_error(bias):
    x, w = randn(3, 2), randn(2, 2)
    with pytest.raises(TypeError):
        F.linear(x, w, bias)
    with pytest.raises(TypeError, match="bias"):
        tritonmm.linear(x, w, bias)


@pytest.mark.parametrize("kernel,config", [
    ("splitk", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_stages": 1, "num_warps": 4}),
    ("pointer", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 0, "num_stages": 1, "num_warps": 4}),
    ("pointer", {"BLOCK_M": 16.0, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_stages": 1, "num_warps": 4}),
    ("tma", {"BLOCK_M": 64}),
    ("splitk", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_stages": 1, "num_warps": 4,
                "SPLIT_K": 1}),
], ids=["splitk-missing-SPLIT_K", "GROUP_M-0", "float", "tma-missing", "splitk-one-split"])
def test_forced_configs_are_validated(kernel, config):
    with pytest.raises(ValueError, match="config"):
        with tritonmm.force_backend("triton", kernel, config=config):
            pass


# --------------------------------------------------------------------------- modules


def test_swapped_model_pickles_and_deep_copies():
    model = nn.Sequential(nn.Linear(7, 4), nn.ReLU(), nn.Linear(4, 3))
    tritonmm.swap_linear(model)
    x = randn(2, 7)
    want = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    clone = copy.deepcopy(model)
    for m in (loaded, clone):
        assert type(m[0]) is type(model[0]) and type(m[0]).__dict__["_tritonmm_base"] is nn.Linear
        torch.testing.assert_close(m(x), want, rtol=0, atol=0)
        tritonmm.unswap_linear(m)
        assert type(m[0]) is nn.Linear


class _NewArgsLinear(nn.Linear):
    """Reduced as its constructor call alone: a copy is a new layer of the same shape (fresh weights)."""

    def __reduce__(self):
        return (_NewArgsLinear, (self.in_features, self.out_features))


class _OwnReduceExLinear(nn.Linear):
    """Reduced through its own __reduce_ex__, which counts its calls."""

    calls = 0

    def __reduce_ex__(self, protocol):
        _OwnReduceExLinear.calls += 1
        return super().__reduce_ex__(protocol)


def _new_mlp():
    return _ConstructedMLP()


class _ConstructedMLP(nn.Module):
    """A Llama-style MLP reduced as a call of its constructor (a 2-tuple, no state)."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
        self.down_proj, self.act_fn = nn.Linear(32, 16, bias=False), nn.SiLU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj

    def __reduce__(self):
        return (_new_mlp, ())


def _copies(module):
    """deepcopy, copy, pickle (protocols 0, 2 and the highest) and torch.save / torch.load of ``module``."""
    import pickle

    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return {"deepcopy": copy.deepcopy(module), "copy": copy.copy(module),
            **{f"pickle{p}": pickle.loads(pickle.dumps(module, protocol=p)) for p in (0, 2, pickle.HIGHEST_PROTOCOL)},
            "torch.save": torch.load(buf, weights_only=False)}


def test_classes_with_their_own_reduction_copy_as_torch_copies_them():
    """A swapped or fused module whose class reduces its instances itself (``__reduce__`` giving a constructor
    call, its own ``__reduce_ex__``) copies and pickles through that reduction, as without tritonmm, and the copy
    is swapped or fused again."""
    x = randn(3, 16)
    new_args = tritonmm.swap_linear(_NewArgsLinear(16, 8))
    for how, c in _copies(new_args).items():
        assert type(c) is type(new_args) and c.weight.shape == (8, 16) and c.weight is not new_args.weight, how
        torch.testing.assert_close(c(x), F.linear(x, c.weight, c.bias), msg=how)
    own = tritonmm.swap_linear(_OwnReduceExLinear(16, 8))
    calls = _OwnReduceExLinear.calls
    copies = _copies(own)
    assert _OwnReduceExLinear.calls - calls == len(copies)
    for how, c in copies.items():
        assert type(c) is type(own), how
        torch.testing.assert_close(c(x), own(x), rtol=0, atol=0, msg=how)
    mlp = tritonmm.fuse(_ConstructedMLP(), pack=False)
    for how, c in _copies(mlp).items():
        assert type(c) is type(mlp) and c.gate_proj.weight is not mlp.gate_proj.weight, how
        ref = c.down_proj(F.silu(c.gate_proj(x)) * c.up_proj(x))
        torch.testing.assert_close(c(x), ref, msg=how)


def test_weight_plans_die_with_their_weights(monkeypatch):
    """A weight's plan goes when the weight's Python object is freed: an fx Proxy allocated where a planned
    weight lay (a Proxy class of a tensor's allocation size) is traced, not compared with the plan."""
    import gc

    import torch.fx

    from tritonmm.dispatch import plans

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU weights: torch serves every GEMM, so plans are made
    tritonmm.clear_cache()

    class SizedProxy(torch.fx.Proxy):
        __slots__ = ("_a", "_b")  # the allocation size of a tensor's Python object on CPython 3.11-3.13

    x = randn(2, 8)
    try:
        w = randn(8, 8)
        tritonmm.linear(x, w)
        key = id(w)
        assert key in plans.plans and key in plans.free_ptrs
        del w
        gc.collect()
        assert key not in plans.plans and key not in plans.free_ptrs
        tracer = torch.fx.Tracer()
        tracer.graph = torch.fx.Graph()
        xp, node = torch.fx.Proxy(tracer.graph.placeholder("x"), tracer), tracer.graph.placeholder("w")
        reused = 0
        for _ in range(20):  # each weight planned, freed, and its memory given to the next Proxy
            w = randn(8, 8)
            tritonmm.linear(x, w)
            key = id(w)
            del w
            wp = SizedProxy(node, tracer)
            reused += id(wp) == key
            assert isinstance(tritonmm.linear(xp, wp), torch.fx.Proxy)
        assert reused  # (else this interpreter allocates these Proxies elsewhere, and the check above is idle)
    finally:
        monkeypatch.undo()
        tritonmm.clear_cache()



@pytest.mark.parametrize("how", ["swap", "patch", "fuse"])
def test_planned_parameters_convert_and_load_with_swapped_tensors(how, monkeypatch):
    """Under ``torch.__future__.set_swap_module_params_on_conversion(True)`` module conversions and
    ``load_state_dict`` swap each parameter with ``torch.utils.swap_tensors``, which refuses a tensor that has a
    weak reference: a planned layer (swapped, patched, a fused Linear + activation pair) converts and loads as
    nn.Linear does, keeping its parameter objects, and its calls follow the new values."""
    import contextlib

    from tritonmm.dispatch import plans

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU weights: torch serves every GEMM, so plans are made
    tritonmm.clear_cache()
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ref = nn.Sequential(nn.Linear(16, 8), nn.ReLU())
        model = copy.deepcopy(ref)
        with tritonmm.patch_linear() if how == "patch" else contextlib.nullcontext():
            if how == "swap":
                tritonmm.swap_linear(model)
            elif how == "fuse":
                tritonmm.fuse(model)
            x = randn(4, 16)
            model(x), model(x)
            weight = model[0].weight
            assert id(weight) in plans.plans  # (else nothing here holds a reference, and the test is idle)
            model.double()
            ref.double()
            assert model[0].weight is weight and weight.dtype == torch.float64
            state = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
            model.load_state_dict(state)
            ref.load_state_dict(state)
            assert model[0].weight is weight
            x = x.double()
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
            torch.utils.swap_tensors(weight, nn.Parameter(torch.randn_like(weight)))
            torch.testing.assert_close(model(x), F.relu(F.linear(x, weight, model[0].bias)), rtol=0, atol=0)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
        monkeypatch.undo()
        tritonmm.clear_cache()


def test_a_swapped_parametrized_linear_refuses_pickling_as_torch_does():
    """torch refuses to pickle a parametrized module (only its state_dict saves); a swapped one raises the same
    error, and deep-copies as torch's does."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return w * 2

    errors = []
    for swap in (False, True):
        lin = nn.Linear(4, 3)
        if swap:
            tritonmm.swap_linear(lin)
        parametrize.register_parametrization(lin, "weight", Double())
        with pytest.raises(RuntimeError) as error:
            torch.save(lin, io.BytesIO())
        errors.append(str(error.value))
        x, twin = randn(2, 4), copy.deepcopy(lin)
        assert type(twin) is type(lin)
        torch.testing.assert_close(twin(x), F.linear(x, 2 * lin.parametrizations.weight.original, lin.bias))
    assert errors[0] == errors[1]

def test_fused_mlp_traces_with_a_proxy_subclass():
    """Tracers whose proxies subclass torch.fx.Proxy (meta_tracer, custom tracers) record a fused MLP's modules."""
    import torch.fx
    from torch.fx.experimental.meta_tracer import symbolic_trace as meta_trace

    class SubProxy(torch.fx.Proxy):
        pass

    class SubTracer(torch.fx.Tracer):
        def proxy(self, node):
            return SubProxy(node, self)

    mlp = tritonmm.fuse(_ConstructedMLP(), pack=False)
    x = randn(3, 16)
    want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    traced = torch.fx.GraphModule(mlp, SubTracer().trace(mlp))
    torch.testing.assert_close(traced(x), want)
    torch.testing.assert_close(meta_trace(mlp, meta_args={"x": x.to("meta")})(x), want)


def test_swap_skips_lazy_and_parametrized_modules():
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return w * 2

    lazy, plain, param = nn.LazyLinear(3), nn.Linear(4, 3), nn.Linear(4, 3)
    parametrize.register_parametrization(param, "weight", Double())
    model = nn.ModuleList([lazy, plain, param])
    tritonmm.swap_linear(model)
    assert isinstance(model[0], nn.LazyLinear) and "_tritonmm_base" in type(model[1]).__dict__
    assert "_tritonmm_base" not in type(model[2]).__dict__
    model[0](randn(2, 5))  # materializes; stays a working Linear
    parametrize.remove_parametrizations(model[2], "weight")  # still possible
    assert type(model[2]) is nn.Linear


def test_jit_trace_of_swapped_module():
    m = tritonmm.swap_linear(nn.Sequential(nn.Linear(6, 5)))
    x = randn(3, 6)
    traced = torch.jit.trace(m, (x,))
    torch.testing.assert_close(traced(x), m(x))


def test_unpatch_restores_another_librarys_patch():
    original = nn.Linear.forward

    def other_patch(self, input):
        return original(self, input) + 1

    nn.Linear.forward = other_patch
    try:
        with tritonmm.patch_linear():
            assert tritonmm.modules.linear.is_linear_patched()
        assert nn.Linear.forward is other_patch
        tritonmm.patch_linear()
        tritonmm.unpatch_linear()
        assert nn.Linear.forward is other_patch
    finally:
        nn.Linear.forward = original


def test_tensor_subclasses_with_their_own_torch_function_keep_their_f_linear_and_matmul():
    """A weight class that serves F.linear / torch.matmul itself (as quantized-weight subclasses do) gets
    those calls from the functional API, swapped and patched layers, as without tritonmm."""
    import torch.nn.functional as F

    class Doubled(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (F.linear, torch.matmul):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(args[0], args[1] * 2, *args[2:], **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs or {})

    x = randn(3, 16)
    lin = torch.nn.Linear(16, 8)
    lin.weight = Doubled(lin.weight.detach())
    want = F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(want, F.linear(x, 2 * lin.weight.detach(), lin.bias.detach()))
    wt = Doubled(randn(16, 8))
    for _ in range(2):
        torch.testing.assert_close(tritonmm.linear(x, lin.weight, lin.bias), want)
        torch.testing.assert_close(tritonmm.matmul(x, wt), torch.matmul(x, wt))
        with tritonmm.force_backend("triton"):
            torch.testing.assert_close(tritonmm.linear(x, lin.weight, lin.bias), want)
        with tritonmm.patch_linear():
            torch.testing.assert_close(lin(x), want)
    assert tritonmm.explain(x, wt).backend == "torch"
    tritonmm.swap_linear(lin)
    torch.testing.assert_close(lin(x), want)
