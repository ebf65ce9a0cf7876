"""The input RMSNorm folded into the attention's q/k/v GEMM (tritonmm.modules.norm_fold, tritonmm.modules.qkv,
tritonmm.kernels.norm_linear): the kernel against float64, a folding model's values, the attention forwards that
may take the norm's input, and the calls that get the norm's output instead."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_norm_fold import _model, _rms_norm, _same, _unfused_and_fused, spy_on

import tritonmm
from tritonmm.dispatch import norm_linear
from tritonmm.modules import norm_fold, qkv

transformers = pytest.importorskip("transformers")
HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.interpreter if not HAS_CUDA else pytest.mark.gpu
_DTYPES = [torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16] if HAS_CUDA else _DTYPES)
@pytest.mark.parametrize("M, N, K, bias, cfg", [
    (1, 40, 96, False, dict(BLOCK_N=16, BLOCK_K=32)), (5, 33, 130, True, dict(BLOCK_N=32, BLOCK_K=64)),
    (16, 70, 200, False, dict(BLOCK_N=64, BLOCK_K=128)), (3, 24, 64, True, None)])
def test_the_norm_linear_kernel_against_float64(M, N, K, bias, cfg, dtype, device):
    """Odd sizes, K tails, a K loop of one to several steps, a bias; NaN-filled output. bfloat16 and float32 take one
    pass (X times the weight, 1 / rms on the accumulator), float16 two (X normalized as the module rounds)."""
    from tritonmm.kernels.norm_linear import norm_linear_launcher

    x = torch.randn(M, K, device=device, dtype=dtype) * 4
    nw = (torch.rand(K, device=device) + 0.5).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    eps = 1e-5
    config = None if cfg is None else dict(cfg, BLOCK_M=16, num_warps=4, num_stages=2)
    launch = norm_linear_launcher(M, N, K, K, K, dtype, device, None if b is None else 1, config)
    y = torch.full((M, N), float("nan"), device=device, dtype=dtype)
    x0 = x.clone()
    launch(x, nw, w, b, y, eps)
    ref = F.linear(_rms_norm(x, nw, eps), w.double(), None if b is None else b.double())
    module = transformers.models.llama.modeling_llama.LlamaRMSNorm(K, eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(nw)
        eager = F.linear(module(x), w, b)
    eager_err = (eager.double() - ref).abs().max().item()
    assert not y.isnan().any()
    assert (y.double() - ref).abs().max().item() <= 2 * eager_err + 1e-6
    assert torch.equal(x, x0)


def test_norm_linear_declines_what_it_does_not_serve(device):
    x = torch.randn(17, 64, device=device)  # (more rows than a fold takes)
    nw, w = torch.rand(64, device=device) + 0.5, torch.randn(32, 64, device=device)
    assert norm_linear.norm_linear(x, nw, 1e-5, w, None) is None
    assert norm_linear.norm_linear(x[:4], nw.half(), 1e-5, w, None) is None  # (dtypes differ)
    assert norm_linear.norm_linear(x[:4], nw, 1e-5, w[:, :32], None) is None  # (K differs)
    assert norm_linear.norm_linear(x[:4, ::2], nw[:32], 1e-5, w[:, :32], None) is None  # (strided columns)
    with torch.enable_grad():
        assert norm_linear.norm_linear(x[:4].requires_grad_(), nw, 1e-5, w, None) is None
    y = norm_linear.norm_linear(x[:4], nw, 1e-5, w, None)
    assert y is not None
    torch.testing.assert_close(y.double(), F.linear(_rms_norm(x[:4], nw, 1e-5), w.double()), atol=1e-4, rtol=1e-4)


@pytest.fixture
def folded(monkeypatch):
    """Counts the q/k/v GEMMs run with the norm in the kernel's loads (True) or declined by it (False)."""
    monkeypatch.setattr(norm_fold, "FOLD", True)
    tritonmm.clear_cache()
    return spy_on(monkeypatch, qkv, "norm_linear")


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_decode_logits_against_float64(batch, dtype, device, folded):
    model = _model(device, dtype)
    ref_model = copy.deepcopy(model).double()
    ids = torch.randint(0, 128, (batch, 1), device=device)
    with torch.no_grad():
        ref = ref_model(ids).logits
        off_err = (model(ids).logits.double() - ref).abs().max().item()
        tritonmm.fuse(model)
        assert type(model.model.layers[0].self_attn).__dict__.get("_tritonmm_takes_norm")
        outs = [model(ids).logits for _ in range(2)]
    assert folded == [True] * 4  # two layers in two calls
    for out in outs:
        assert not out.isnan().any()
        assert (out.double() - ref).abs().max().item() <= 2 * off_err + 1e-6
    assert not any("forward" in m.__dict__ or "_tritonmm_norm" in m.__dict__ for m in model.modules())


def test_calls_the_attention_cannot_serve_get_the_norms_output(device, folded):
    """Inference tensors (no version counter), more rows than a fold takes, and an attention marked unserved: the
    attention runs on the norm's output, as unfused."""
    dtype = _DTYPES[0]
    ref, model = _unfused_and_fused(_model(device, dtype))
    with torch.no_grad():
        for ids in (torch.randint(0, 128, (2, 1), device=device), torch.randint(0, 128, (1, 17), device=device)):
            with torch.inference_mode():  # (the MLP's fold still serves: its tolerance)
                _same(model(ids).logits, ref(ids).logits)
            _same(model(ids).logits, ref(ids).logits)
        assert folded == [True, True]  # (the 2 x 1 call outside inference mode only)
        for layer in model.model.layers:
            layer.self_attn.__dict__[qkv._UNSERVED] = True
        ids = torch.randint(0, 128, (2, 1), device=device)
        _same(model(ids).logits, ref(ids).logits)
    assert folded == [True, True]


class _ReadsInput(torch.nn.Module):
    """An attention that reads its input besides the projections (a residual inside the attention)."""

    def __init__(self, attn):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj

    def forward(self, hidden_states, **kwargs):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        return q[..., :8] + k[..., :8] + v[..., :8] + hidden_states[..., :8], None


class _Layer(torch.nn.Module):
    def __init__(self, inner, attn):
        super().__init__()
        self.input_layernorm, self.self_attn = inner.input_layernorm, attn

    def forward(self, hidden_states):
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states)
        return hidden_states


def test_which_attention_forwards_take_the_norms_input(device):
    attn = type(_model(device, torch.float32).model.layers[0].self_attn)
    assert qkv.takes_norm(attn.forward)
    assert qkv.input_name(_ReadsInput.forward) == "hidden_states" and not qkv.takes_norm(_ReadsInput.forward)

    def rebinds(self, hidden_states):
        hidden_states = hidden_states.shape
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)

    def reads_size(self, hidden_states):
        n = hidden_states.size(0)
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states), n

    assert not qkv.reads_shape_only(rebinds, "hidden_states") and not qkv.reads_shape_only(reads_size, "hidden_states")
    assert norm_fold.fold_pairs(_Layer) == (("self_attn", "input_layernorm"),)


def test_an_attention_reading_its_input_otherwise_gets_the_norms_output(device, folded):
    dtype = _DTYPES[0]
    inner = _model(device, dtype).model.layers[0]
    layer = _Layer(inner, _ReadsInput(inner.self_attn))
    ref = copy.deepcopy(layer)
    tritonmm.fuse(layer)
    assert not type(layer.self_attn).__dict__.get("_tritonmm_takes_norm")
    x = torch.randn(2, 1, 64, device=device, dtype=dtype) * 3
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref(x))
    assert folded == []


def test_no_launcher_is_built_in_graph_capture(device, folded, monkeypatch):
    """The kernel's first launch compiles (and autotunes): never while a CUDA graph is captured, where loading a
    module invalidates the capture; that call runs the norm and one F.linear on the packed weights."""
    from tritonmm.kernels import launch

    dtype = _DTYPES[0]
    ref, model = _unfused_and_fused(_model(device, dtype))
    ids = torch.randint(0, 128, (2, 1), device=device)
    with torch.no_grad():
        monkeypatch.setattr(launch, "capturing", lambda device: True)
        captured = model(ids).logits
        monkeypatch.setattr(launch, "capturing", lambda device: False)
        after = model(ids).logits
        expected = ref(ids).logits
    assert folded == [False, False, True, True]
    _same(captured, expected)
    _same(after, expected)


def test_hooks_on_a_projection_see_the_norms_output(device, folded):
    """Hooks on q, k or v (a probe, a pre-hook returning a new tensor): the attention gets the norm's output, the
    hooks see what they see unfused, and the fold serves again once they are removed."""
    dtype = _DTYPES[0]
    ref, model = _unfused_and_fused(_model(device, dtype))
    ids = torch.randint(0, 128, (1, 4), device=device)
    seen = {}
    with torch.no_grad():
        for tag, m in (("ref", ref), ("fused", model)):
            v = m.model.layers[0].self_attn.v_proj
            hooks = [v.register_forward_hook(lambda mod, a, o, tag=tag: seen.__setitem__(tag, a[0].clone())),
                     m.model.layers[1].self_attn.k_proj.register_forward_pre_hook(lambda mod, a: (a[0].clone(),))]
            seen[tag + "_logits"] = m(ids).logits
            for h in hooks:
                h.remove()
        assert folded == []  # (declined before the GEMM)
        _same(seen["fused"], seen["ref"])
        _same(seen["fused_logits"], seen["ref_logits"])
        assert not any(qkv._UNSERVED in layer.self_attn.__dict__ for layer in model.model.layers)
        _same(model(ids).logits, ref(ids).logits)
    assert folded[-2:] == [True, True]


def test_hooks_registered_or_unfuse_during_a_layer_run_the_norm(device, folded):
    """A hook on the MLP's norm and a pre-hook on the MLP registered from the attention's hook (after the layer armed
    the fold), and unfuse from a projection's hook: the norm runs as its module, values as unfused."""
    dtype = _DTYPES[0]
    ref, model = _unfused_and_fused(_model(device, dtype))
    ids = torch.randint(0, 128, (1, 4), device=device)
    results = {}
    with torch.no_grad():
        for tag, m in (("ref", ref), ("fused", model)):
            layer, seen, handles = m.model.layers[0], [], []

            def instrument(mod, args, out, layer=layer, seen=seen, handles=handles):
                handles.append(layer.post_attention_layernorm.register_forward_hook(lambda mod, a, o: seen.append(o)))
                handles.append(layer.mlp.register_forward_pre_hook(lambda mod, a: (a[0].clone(),)))

            handles.append(layer.self_attn.register_forward_hook(instrument))
            results[tag] = m(ids).logits, seen[0]
            for h in handles:
                h.remove()
        _same(results["fused"][1], results["ref"][1])
        _same(results["fused"][0], results["ref"][0])
        expected = ref(ids).logits
        hook = model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *a: (tritonmm.unfuse(model), None)[1])
        _same(model(ids).logits, expected)
        hook.remove()
        assert not any("forward" in m.__dict__ or "_tritonmm_norm" in m.__dict__ for m in model.modules())


def test_a_copy_taken_during_an_attention_keeps_no_server(device, folded):
    """The copy's projections run their own forward once (a copy's weights are not packed: its q, k, v run apart)."""
    dtype = _DTYPES[0]
    ref, model = _unfused_and_fused(_model(device, dtype))
    ids = torch.randint(0, 128, (1, 4), device=device)
    copies = []
    hook = model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *a: copies.append(copy.deepcopy(model)))
    with torch.no_grad():
        model(ids)
        hook.remove()
        snapshot = copies[0]
        snapshot.model.layers[0].self_attn.o_proj._forward_hooks.clear()
        expected = ref(ids).logits
        _same(snapshot(ids).logits, expected)
        assert not any("forward" in m.__dict__ or "_tritonmm_norm" in m.__dict__ for m in snapshot.modules())
        _same(snapshot(ids).logits, expected)
