"""Fused attention projections on a GPU: a transformers Llama in bf16 with its q, k and v projections run as
one GEMM, prefill M from 1 to 4096 tokens, decode with a KV cache and CUDA-graph capture, against the
unfused model."""

import copy
from unittest import mock

import pytest
import torch

import tritonmm
from tritonmm.modules import norm_fold, packing, qkv, qkv_traced

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    with mock.patch.object(norm_fold, "FOLD", False):  # (the q/k/v GEMM on cuBLAS; folded: test_qkv_fold.py)
        fused = tritonmm.fuse(copy.deepcopy(ref))
    assert all(packing.stacked((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)) is not None
               for a in (layer.self_attn for layer in fused.model.layers))
    return ref, fused


def _served(monkeypatch, eager=True):
    """Shapes of the q/k/v GEMMs' inputs; with ``eager``, eager calls are served too (qkv.SERVE_EAGER)."""
    monkeypatch.setattr(qkv, "SERVE_EAGER", eager)
    calls = []
    real = qkv._F_linear
    monkeypatch.setattr(qkv, "_F_linear", lambda x, w, b=None: calls.append(x.shape) or real(x, w, b))
    return calls


@pytest.mark.parametrize("M", [1, 16, 100, 512, 4096])
def test_prefill_matches_unfused(M, models, monkeypatch):
    ref, fused = models
    ids = torch.randint(0, 1024, (1, M), device="cuda")
    calls = _served(monkeypatch)
    with torch.no_grad():
        got, want = fused(ids).logits.float(), ref(ids).logits.float()
    assert len(calls) == 2  # one q/k/v GEMM per layer
    assert not got.isnan().any()
    # the same GEMM products (cuBLAS, one call on the packed weights): bf16 rounding differences only
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_decode_and_graph_capture_match_unfused(models, monkeypatch):
    ref, fused = models
    ids = torch.randint(0, 1024, (2, 12), device="cuda")
    monkeypatch.setattr(qkv, "SERVE_EAGER", True)  # decode steps served in eager mode too
    with torch.no_grad():
        got = fused.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
        want = ref.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.abs().max().item())
    x = torch.randint(0, 1024, (1, 16), device="cuda")
    calls = _served(monkeypatch, eager=False)  # the default: served while captured only
    with torch.no_grad():
        want = ref(x).logits.float()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fused(x).logits
        g.replay()
        torch.cuda.synchronize()
    assert len(calls) == 2  # the capture, two layers (not the warm-up)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_compiled_reduce_overhead_runs_one_stacked_gemm_per_layer_and_matches_unfused(models, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    ref, fused = models
    monkeypatch.setattr(qkv_traced, "SERVE_COMPILED", True)
    torch._dynamo.reset()
    fn = torch.compile(fused, mode="reduce-overhead", fullgraph=True, dynamic=False)
    ids = torch.randint(0, 1024, (2, 16), device="cuda")
    with torch.no_grad():
        want = ref(ids).logits.float()
        _, code = run_and_get_code(fn, ids)
        for _ in range(3):  # (recorded, then replayed)
            got = fn(ids).logits.float()
    torch._dynamo.reset()
    assert "".join(code).count("torch.ops.tritonmm.stacked_linear.default(") == 2  # one per layer
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())

def test_captured_tells_the_default_stream_side_streams_and_capture_apart():
    """Served only while the tensor's device's current stream captures: not on the default stream (told apart
    without a driver call), not on a side stream outside capture, not for a CPU tensor."""
    x = torch.randn(4, device="cuda")
    assert not qkv._captured(x) and not qkv._captured(x.cpu())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        assert not qkv._captured(x)
    torch.cuda.current_stream().wait_stream(s)
    seen = []
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        seen.append(qkv._captured(x))
        y = x * 2
    g.replay()
    torch.cuda.synchronize()
    assert seen == [True] and torch.equal(y, x * 2)
