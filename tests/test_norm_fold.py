"""An RMSNorm folded into the fused MLP's gated kernel (tritonmm.modules.norm_fold): values against float64, when
it folds and when the layer runs as it is, the state it leaves, the layers it recognises."""

import copy
import io

import pytest
import torch

import tritonmm
from tritonmm.modules import fusion, norm_fold

transformers = pytest.importorskip("transformers")
HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.interpreter if not HAS_CUDA else pytest.mark.gpu


def _model(device, dtype, hidden=64, inter=96):
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # (ones would hide a weight read wrongly)
                p.copy_(torch.rand_like(p) + 0.5)
    return model.to(device=device, dtype=dtype)


@pytest.fixture(autouse=True)
def fold_on(monkeypatch):
    monkeypatch.setattr(norm_fold, "FOLD", True)


def test_fuse_folds_only_with_fold_on(device, monkeypatch):
    monkeypatch.setattr(norm_fold, "FOLD", False)
    model = tritonmm.fuse(_model(device, _dtypes()[0]))
    assert type(model.model.layers[0].mlp).__dict__.get("_tritonmm_takes_norm")
    assert not type(model.model.layers[0]).__dict__.get("_tritonmm_folds")
    monkeypatch.setattr(norm_fold, "FOLD", True)
    assert type(tritonmm.fuse(model).model.layers[0]).__dict__.get("_tritonmm_folds")


def spy_on(monkeypatch, owner, name: str) -> list:
    """Replaces ``owner.<name>`` with a wrapper that records, per call, whether it returned something (not None)."""
    served, inner = [], getattr(owner, name)

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(owner, name, spy)
    return served


@pytest.fixture
def folds(monkeypatch):
    """Counts the MLP calls served with the norm in the gated kernel."""
    tritonmm.clear_cache()  # (each test sees its geometry's first call)
    return spy_on(monkeypatch, fusion, "_folded")


def _dtypes():
    return [torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_decode_logits_against_float64(batch, dtype, device, folds):
    model = _model(device, dtype)
    ref_model = copy.deepcopy(model).double()
    ids = torch.randint(0, 128, (batch, 1), device=device)
    with torch.no_grad():
        ref = ref_model(ids).logits
        off_err = (model(ids).logits.double() - ref).abs().max().item()
        tritonmm.fuse(model)
        assert type(model.model.layers[0]).__dict__.get("_tritonmm_folds")
        outs = [model(ids).logits for _ in range(3)]
    assert folds == [False] + [True] * 5  # two layers (of one geometry) in three calls; the first builds the launcher
    for out in outs:
        assert not out.isnan().any()
        err = (out.double() - ref).abs().max().item()
        assert err <= 2 * off_err + 1e-6, (err, off_err)


def test_runs_as_it_is_with_autograd_more_rows_or_hooks(device, folds):
    model = tritonmm.fuse(_model(device, _dtypes()[0]))
    layer = model.model.layers[0]
    x = torch.randn(2, 1, 64, device=device, dtype=_dtypes()[0])
    kwargs = dict(position_embeddings=model.model.rotary_emb(x, torch.zeros(2, 1, dtype=torch.long, device=device)))
    with torch.no_grad():
        for _ in range(2):
            layer(x, **kwargs)
    assert folds == [False, True]
    folds.clear()
    layer(x, **kwargs)  # autograd
    with torch.no_grad():
        big = torch.randn(1, 17, 64, device=device, dtype=x.dtype)
        big_kwargs = dict(position_embeddings=model.model.rotary_emb(big, torch.arange(17, device=device)[None]))
        armed = []  # (a layer input of more rows than a fold takes arms nothing)
        probe = layer.self_attn.register_forward_hook(
            lambda *a: armed.append("forward" in layer.post_attention_layernorm.__dict__))
        layer(big, **big_kwargs)
        layer(x, **kwargs)
        probe.remove()
        assert armed == [False, True]
        folds.clear()
        layer(big, **big_kwargs)
        seen = []
        handle = layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(o))
        layer(x, **kwargs)
        handle.remove()
    assert folds == [] and len(seen) == 1
    assert not torch.equal(seen[0], x)  # the hook saw the norm's output, not its input


def test_no_folded_launcher_is_built_in_graph_capture(device, folds, monkeypatch):
    """The folded kernel's first launch compiles (and autotunes): never while a CUDA graph is captured, where
    loading a module invalidates the capture; that call runs the norm and the plain gated kernel."""
    from tritonmm.kernels import launch

    model = tritonmm.fuse(_model(device, _dtypes()[0]))
    layer = model.model.layers[0]
    x = torch.randn(1, 1, 64, device=device, dtype=_dtypes()[0])
    kwargs = dict(position_embeddings=model.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long, device=device)))
    with torch.no_grad():
        ref = layer(x, **kwargs)  # (builds the plain gated launcher)
        monkeypatch.setattr(launch, "capturing", lambda device: True)
        captured = layer(x, **kwargs)
        monkeypatch.setattr(launch, "capturing", lambda device: False)
        after = layer(x, **kwargs)
    assert folds == [False, False, True]
    torch.testing.assert_close(captured, ref, rtol=0, atol=0)
    _same(after, ref)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs")
@pytest.mark.parametrize("rows", [1, 16])
def test_a_captured_graph_of_a_folding_model_replays_its_eager_values(rows, folds):
    """Warm-up calls on a side stream (torch's recipe) build and tune the folded launcher; the capture launches it
    (no compiling there) and each replay recomputes from the input buffer's new values."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    ref, model = _unfused_and_fused(_model(device, dtype))
    ids = torch.randint(0, 128, (1, rows), device=device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            model(ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(ids, use_cache=False).logits
    assert folds[-2:] == [True, True]  # (two layers, folded in the capture)
    with torch.no_grad():
        for _ in range(2):
            ids.copy_(torch.randint(0, 128, (1, rows), device=device))
            out.fill_(float("nan"))
            graph.replay()
            _same(out, ref(ids, use_cache=False).logits)


def test_leaves_no_state_and_the_norm_alone_still_normalizes(device, folds, monkeypatch):
    model = tritonmm.fuse(_model(device, _dtypes()[0]))
    layer = model.model.layers[0]
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    x = torch.randn(1, 1, 64, device=device, dtype=_dtypes()[0])
    kwargs = dict(position_embeddings=model.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long, device=device)))
    with torch.no_grad():
        layer(x, **kwargs)
        assert "forward" not in norm.__dict__ and "_tritonmm_norm" not in mlp.__dict__
        expected = type(norm).forward(norm, x)
        assert torch.equal(norm(x), expected) and not torch.equal(expected, x)

        def boom(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(type(layer.self_attn), "forward", boom)
        with pytest.raises(RuntimeError, match="boom"):
            layer(x, **kwargs)
    assert "forward" not in norm.__dict__ and "_tritonmm_norm" not in mlp.__dict__


def test_unfuse_pickle_and_filter(device, folds):
    model = tritonmm.fuse(_model(device, _dtypes()[0]))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.model.layers[1]).__dict__.get("_tritonmm_folds")
    tritonmm.unfuse(model)
    assert type(model.model.layers[0]) is transformers.models.llama.modeling_llama.LlamaDecoderLayer
    tritonmm.fuse(model, filter_fn=lambda m, name: not name.endswith("layers.0"))
    assert not type(model.model.layers[0]).__dict__.get("_tritonmm_folds")
    assert type(model.model.layers[1]).__dict__.get("_tritonmm_folds")


class _TwiceRead(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.norm, self.mlp = inner.post_attention_layernorm, inner.mlp

    def forward(self, x):
        h = self.norm(x)
        h = self.mlp(h)
        return h


class _OutputKept(_TwiceRead):
    def forward(self, x):
        h = self.norm(x)
        y = self.mlp(h)
        return y + h


def test_only_layers_that_pass_the_norm_straight_to_the_mlp_fold(device):
    inner = _model(device, _dtypes()[0]).model.layers[0]
    assert norm_fold.fold_pairs(type(inner)) == (("self_attn", "input_layernorm"), ("mlp", "post_attention_layernorm"))
    assert norm_fold.fold_pairs(_TwiceRead) == (("mlp", "norm"),)
    assert norm_fold.fold_pairs(_OutputKept) == ()
    kept = tritonmm.fuse(_OutputKept(inner))
    assert not type(kept).__dict__.get("_tritonmm_folds")


class _NormTwice(torch.nn.Module):  # the folded norm also runs earlier in the forward
    def __init__(self, inner):
        super().__init__()
        self.norm, self.mix, self.mlp = inner.post_attention_layernorm, torch.nn.Linear(64, 64), inner.mlp

    def forward(self, x):
        h = self.norm(x)
        x = x + self.mix(h)
        h = self.norm(x)
        h = self.mlp(h)
        return x + h


def _unfused_and_fused(model):
    ref = copy.deepcopy(model)
    return ref, tritonmm.fuse(model)


def _same(actual, expected):
    """Fused against unfused: float32 as torch.testing's default; in 16-bit dtypes the one-pass fold rounds X times
    the norm's weight once where the module rounds twice (a norm handed its input back differs by far more)."""
    low = actual.dtype in (torch.float16, torch.bfloat16)
    torch.testing.assert_close(actual, expected, **(dict(atol=1e-2, rtol=2e-2) if low else {}))


def test_other_calls_of_the_norm_during_the_layer_normalize(device, folds):
    """The norm called from another statement, as another attribute (one module as both norms), from a hook (a
    probe), by keyword: each gets the norm's output; only the statement before the MLP folds."""
    dtype = _dtypes()[0]
    x = torch.randn(1, 4, 64, device=device, dtype=dtype) * 3
    ref, block = _unfused_and_fused(_NormTwice(_model(device, dtype).model.layers[0]).to(device=device, dtype=dtype))
    model = _model(device, dtype)
    for layer in model.model.layers:
        layer.input_layernorm = layer.post_attention_layernorm
    ref_model, model = _unfused_and_fused(model)
    ids = torch.randint(0, 128, (1, 4), device=device)
    with torch.no_grad():
        for _ in range(3):
            _same(block(x), ref(x))
            _same(model(ids).logits, ref_model(ids).logits)
        for by_keyword in (False, True):
            seen = []
            for m in (ref_model, model):
                layer = m.model.layers[0]
                norm = layer.post_attention_layernorm
                probe = layer.self_attn.register_forward_hook(lambda mod, args, out, norm=norm: seen.append(
                    norm(hidden_states=out[0]) if by_keyword else norm(out[0])))
                m(ids)
                probe.remove()
            _same(seen[1], seen[0])
    assert True in folds


def test_a_copy_taken_during_a_forward_runs_the_norm(device, folds):
    dtype = _dtypes()[0]
    ref, model = _unfused_and_fused(_model(device, dtype))
    ids = torch.randint(0, 128, (1, 3), device=device)
    copies = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *a: copies.append(copy.deepcopy(model)))
    with torch.no_grad():
        model(ids)
        hook.remove()
        snapshot = copies[0]
        snapshot.model.layers[0].self_attn._forward_hooks.clear()
        expected = ref(ids).logits
        _same(snapshot(ids).logits, expected)
        layer = snapshot.model.layers[0]
        assert "forward" not in layer.post_attention_layernorm.__dict__ and "_tritonmm_norm" not in layer.mlp.__dict__
        _same(tritonmm.unfuse(snapshot)(ids).logits, expected)


def _rms_norm(x, w, eps):
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", _dtypes())  # float32, bfloat16: one pass; float16: two passes
@pytest.mark.parametrize("M, N, K, cfg", [(1, 40, 96, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)),
                                           (5, 33, 130, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)),
                                           (16, 70, 200, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128))])
def test_the_norm_in_the_gated_kernel_against_float64(M, N, K, cfg, dtype, device):
    """Odd sizes, K tails, configs whose K loop runs one to several times; NaN-filled output."""
    from tritonmm.dispatch import gated
    from tritonmm.kernels.gated_launchers import gated_launcher

    x = torch.randn(M, K, device=device, dtype=dtype) * 4
    nw = (torch.rand(K, device=device) + 0.5).to(dtype)
    wg, wu = ((torch.randn(N, K, device=device) / K**0.5).to(dtype) for _ in range(2))
    eps = 1e-5
    config = dict(cfg, GROUP_M=8, num_warps=4, num_stages=2)
    launch = gated_launcher("pointer", M, N, K, K, K, K, dtype, device, None, False, "silu", config, norm_eps=eps)
    h = torch.full((M, N), float("nan"), device=device, dtype=dtype)
    launch(x, wg, wu, None, None, h, None, None, nw)
    ref = gated.reference(_rms_norm(x, nw, eps), wg.double(), wu.double())
    norm = type(transformers.models.llama.modeling_llama.LlamaRMSNorm(K, eps))
    module = norm(K, eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(nw)
        eager = gated.reference(module(x), wg, wu)
    eager_err = (eager.double() - ref).abs().max().item()
    assert not h.isnan().any()
    assert (h.double() - ref).abs().max().item() <= 2 * eager_err + 1e-6
