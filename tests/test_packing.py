"""Packed gate and up weights (tritonmm.packing, gated_cublas.packed): fuse moves them into one allocation
without changing parameters or values; the packed forward (one GEMM) and backward (one GEMM per gradient)
against float64; what cannot be packed stays where it is."""

import copy
import io

import pytest
import torch
from test_gated import MLP, assert_close_to_ref
from torch import nn

import tritonmm
from tritonmm.core.reference import randn
from tritonmm.dispatch import gated, gated_cublas
from tritonmm.modules import packing
from tritonmm.ops import gated as gated_op
from tritonmm.ops import gated_args

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def product_path(monkeypatch):
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)  # the product path (where packing counts) at CPU test sizes
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS_NO_GRAD", 0)
    monkeypatch.setattr(gated, "KERNEL_MAX_FLOPS_NO_GRAD", 0)  # (no gated kernel above GATED_MAX_M rows)


def is_packed(mlp) -> bool:
    return gated_cublas.packed(mlp.gate_proj.weight, mlp.up_proj.weight) is not None


def count_one_gemm(monkeypatch):
    """Calls of the packed forward's one GEMM (torch.mm on an (M, K) input and the (2N, K) weights)."""
    calls = []
    real = gated_cublas.packed
    monkeypatch.setattr(gated_cublas, "packed", lambda a, b: (lambda w: calls.append(w is not None) or w)(real(a, b)))
    return calls


def test_fuse_packs_the_same_parameters_with_the_same_values():
    torch.manual_seed(0)
    mlp = MLP(hidden=32, inter=24)
    params = dict(mlp.named_parameters())
    flags = {n: p.requires_grad for n, p in params.items()}
    sd = {k: v.clone() for k, v in mlp.state_dict().items()}
    tritonmm.fuse(mlp)
    assert is_packed(mlp)
    wg, wu = mlp.gate_proj.weight, mlp.up_proj.weight
    assert wu.data_ptr() == wg.data_ptr() + wg.numel() * wg.element_size()
    assert dict(mlp.named_parameters()) == params and {n: p.requires_grad for n, p in params.items()} == flags
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in sd.items())
    assert all(mlp.state_dict()[k].shape == v.shape for k, v in sd.items())
    tritonmm.unfuse(tritonmm.unfuse(tritonmm.fuse(mlp), unpack=False))
    assert type(mlp) is MLP and is_packed(mlp)  # unpack=False: the class only
    tritonmm.fuse(mlp)
    tritonmm.unfuse(mlp)  # gives each weight its own storage again
    assert type(mlp) is MLP and all(torch.equal(mlp.state_dict()[k], v) for k, v in sd.items())
    assert not is_packed(mlp) and dict(mlp.named_parameters()) == params
    assert mlp.gate_proj.weight.untyped_storage().nbytes() == mlp.gate_proj.weight.numel() * 4
    other = tritonmm.fuse(MLP(hidden=32, inter=24), pack=False)
    assert not is_packed(other)
    skipped = tritonmm.fuse(MLP(hidden=32, inter=24), filter_fn=lambda m, name: False)
    assert not is_packed(skipped) and type(skipped) is MLP


@pytest.mark.parametrize("lead", [(40,), (3, 17)], ids=["2d", "3d"])
def test_packed_forward_and_backward_match_float64(lead, monkeypatch):
    """One GEMM forward, and both weights' gradients as one GEMM; values and gradients of x and both weights
    within the unfused module's error of float64, twice over (gradients accumulate into the halves of one
    tensor)."""
    torch.manual_seed(0)
    mlp = MLP(hidden=32, inter=24)
    ref = copy.deepcopy(mlp).double()
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    unpacked = tritonmm.fuse(copy.deepcopy(mlp), pack=False)
    calls = count_one_gemm(monkeypatch)
    x = randn(*lead, 32)
    for _ in range(2):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        x64 = x.double().requires_grad_()
        outs = [m(xi) for m, xi in zip((fused, unpacked), xs)]
        want = ref(x64)
        dout = randn(*lead, 32)
        for o in outs:
            o.backward(dout)
        want.backward(dout.double())
        errs = [(o.double() - want).abs().max().item() for o in outs]
        assert errs[0] <= 2 * errs[1] + 1e-6
        for got, other, w in ((xs[0].grad, xs[1].grad, x64.grad),
                              (fused.gate_proj.weight.grad, unpacked.gate_proj.weight.grad, ref.gate_proj.weight.grad),
                              (fused.up_proj.weight.grad, unpacked.up_proj.weight.grad, ref.up_proj.weight.grad)):
            assert not got.isnan().any()
            assert (got.double() - w).abs().max().item() <= 2 * (other.double() - w).abs().max().item() + 1e-6
    assert any(calls), "the packed GEMM did not run"
    assert is_packed(fused)


def test_gated_linear_takes_the_halves_of_one_weight_and_returns_its_gradient(monkeypatch):
    """Weights given as the two halves of one (2N, K) tensor (as a merged gate-up weight): one GEMM, and the
    merged weight's gradient is the two halves' gradients."""
    calls = count_one_gemm(monkeypatch)
    w = (randn(48, 32) / 32**0.5).requires_grad_()
    x = randn(40, 32).requires_grad_()
    out = tritonmm.gated_linear(x, w[:24], w[24:])
    assert any(calls)
    assert_close_to_ref(out.detach(), x.detach(), w[:24].detach(), w[24:].detach())
    dout = randn(40, 24)
    out.backward(dout)
    w64, x64 = w.detach().double().requires_grad_(), x.detach().double().requires_grad_()
    gated.reference(x64, w64[:24], w64[24:]).backward(dout.double())
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)


def test_autocast_with_fp32_weights_casts_once_and_returns_fp32_gradients(monkeypatch):
    torch.manual_seed(0)
    mlp = MLP(hidden=32, inter=24)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    casts = []
    real = gated_args.PackedCast.forward
    monkeypatch.setattr(gated_args.PackedCast, "forward",
                        staticmethod(lambda ctx, *a: casts.append(1) or real(ctx, *a)))
    x = randn(40, 32)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [m(xi) for m, xi in zip((fused, mlp), xs)]
    assert casts == [1] and outs[0].dtype == outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2e-2, atol=2e-2)
    dout = randn(40, 32)
    for o in outs:
        o.float().backward(dout)
    for a, b in ((xs[0].grad, xs[1].grad), (fused.gate_proj.weight.grad, mlp.gate_proj.weight.grad),
                 (fused.up_proj.weight.grad, mlp.up_proj.weight.grad)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def test_what_cannot_be_packed_stays_where_it_is():
    biased = MLP(hidden=32, inter=24, bias=True)
    viewed = MLP(hidden=32, inter=24)
    view = viewed.up_proj.weight[0]  # a view elsewhere would stop seeing the weight's values if it moved
    shared = MLP(hidden=32, inter=24)
    shared.up_proj.weight = shared.gate_proj.weight
    for mlp in (biased, viewed, shared):
        ptrs = [p.data_ptr() for p in mlp.parameters()]
        tritonmm.fuse(mlp)
        assert not is_packed(mlp) and [p.data_ptr() for p in mlp.parameters()] == ptrs
    assert view.data_ptr() == viewed.up_proj.weight.data_ptr()
    x = randn(20, 32)
    torch.testing.assert_close(shared(x), MLP.forward(shared, x))


def test_to_unpacks_still_correct_and_fuse_packs_again():
    torch.manual_seed(0)
    mlp = tritonmm.fuse(MLP(hidden=32, inter=24))
    ref = copy.deepcopy(mlp)
    tritonmm.unfuse(ref)
    mlp.to(torch.float64).to(torch.float32)  # each parameter moved on its own
    assert not is_packed(mlp)
    x = randn(40, 32)
    torch.testing.assert_close(mlp(x), ref(x), rtol=1e-5, atol=1e-5)
    tritonmm.fuse(mlp)
    assert is_packed(mlp)
    torch.testing.assert_close(mlp(x), ref(x), rtol=1e-5, atol=1e-5)


def test_copies_and_saves_keep_values():
    mlp = tritonmm.fuse(MLP(hidden=32, inter=24))
    x = randn(40, 32)
    out = mlp(x)
    buf = io.BytesIO()
    torch.save(mlp.state_dict(), buf)
    buf.seek(0)
    fresh = MLP(hidden=32, inter=24)
    fresh.load_state_dict(torch.load(buf))
    torch.testing.assert_close(fresh(x), out, rtol=1e-5, atol=1e-5)
    clone = copy.deepcopy(mlp)  # (Parameter.__deepcopy__ clones each parameter on its own: unpacked)
    torch.testing.assert_close(clone(x), out)
    assert is_packed(tritonmm.fuse(clone))
    torch.testing.assert_close(clone(x), out)
    buf = io.BytesIO()
    torch.save(mlp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)  # storages are saved once: still packed
    assert is_packed(loaded)
    torch.testing.assert_close(loaded(x), out)
    tritonmm.unfuse(loaded)  # (not packed by this process's fuse: unpacked all the same)
    assert not is_packed(loaded) and type(loaded) is MLP
    torch.testing.assert_close(loaded(x), out)
    packing.pack(mlp.gate_proj, mlp.up_proj, accept=gated_cublas.serves)  # packed already: nothing moves
    torch.testing.assert_close(mlp(x), out)


def test_transformers_save_pretrained_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        want = model(ids).logits
    tritonmm.fuse(model)
    assert all(is_packed(layer.mlp) for layer in model.model.layers)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_packed_weights_need_one_storage():
    """Two tensors on different storages are never taken as packed, even where adjacent (pointer arithmetic
    alone could be fooled by adjacent allocations)."""
    both = randn(48, 32)
    gate, up = both[:24], both[24:]
    assert gated_cublas.packed(gate, up) is not None and gated_cublas.packed(up, gate) is None
    assert gated_cublas.packed(gate, up.clone()) is None
    assert gated_cublas.packed(both[:24, :16], both[24:, :16]) is None  # not contiguous
    other = torch.empty(0).set_(up.untyped_storage(), up.storage_offset(), up.shape, up.stride())
    assert gated_cublas.packed(gate, other) is not None  # the same storage through another tensor
    mirror = torch.empty(0).set_(torch.UntypedStorage(up.untyped_storage().nbytes()), up.storage_offset(), up.shape,
                                 up.stride())
    assert gated_cublas.packed(gate, mirror) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_product_kernels_on_the_halves_of_one_tensor_match_the_contiguous_ones(dtype):
    """The row-strided product and its backward give, bit for bit, what the contiguous ones give, and write
    every element of both halves."""
    from tritonmm.kernels import gated_product

    rows, N = 3, gated_product.BLOCK + 77  # a partial block per row
    gu, dh = randn(rows, 2 * N, dtype=dtype) * 3, randn(rows, N, dtype=dtype)
    g, u = gu[:, :N], gu[:, N:]
    h = torch.full((rows, N), float("nan"), dtype=dtype)
    both = torch.full((rows, 2 * N), float("nan"), dtype=dtype)
    gated_product.gated_product(g, u, h, "silu")
    gated_product.gated_product_backward(dh, g, u, both[:, :N], both[:, N:], "silu")
    gc, uc = g.contiguous(), u.contiguous()
    want_h, want_dg, want_du = (torch.full((rows, N), float("nan"), dtype=dtype) for _ in range(3))
    gated_product.gated_product(gc, uc, want_h, "silu")
    gated_product.gated_product_backward(dh, gc, uc, want_dg, want_du, "silu")
    assert not (want_h.isnan().any() or want_dg.isnan().any() or want_du.isnan().any())
    assert torch.equal(h, want_h) and torch.equal(both[:, :N], want_dg) and torch.equal(both[:, N:], want_du)


def test_autocast_keeps_the_up_bias_of_packed_weights():
    """Packed weights with only an up bias: the bias is applied under autocast (the one-cast path needs both
    biases absent)."""
    w, b_up, x = randn(48, 32) / 32**0.5, randn(24), randn(40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tritonmm.gated_linear(x, w[:24], w[24:], None, b_up)
        want = gated.reference(x, w[:24], w[24:], None, b_up)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_fuse_under_inference_mode_leaves_trainable_parameters():
    mlp = MLP(hidden=32, inter=24)
    with torch.inference_mode():
        tritonmm.fuse(mlp)
    assert is_packed(mlp) and not mlp.gate_proj.weight.is_inference() and not mlp.up_proj.weight.is_inference()
    x = randn(40, 32).requires_grad_()
    mlp(x).sum().backward()
    assert mlp.gate_proj.weight.grad is not None and x.grad is not None


def test_shared_memory_weights_and_user_packed_weights_are_left_as_they_are():
    shared = MLP(hidden=32, inter=24).share_memory()
    tritonmm.fuse(shared)
    assert not is_packed(shared) and shared.gate_proj.weight.is_shared() and shared.up_proj.weight.is_shared()
    merged = MLP(hidden=32, inter=24)
    rows = torch.cat([merged.gate_proj.weight.detach(), merged.up_proj.weight.detach(), randn(8, 32)])
    merged.gate_proj.weight.data, merged.up_proj.weight.data = rows[:24], rows[24:48]  # packed by the user
    tritonmm.unfuse(tritonmm.fuse(merged))
    assert is_packed(merged), "unfuse leaves a storage that holds more than the two weights"


def test_filter_is_asked_once_per_module():
    model = nn.Sequential(MLP(hidden=32, inter=24), MLP(hidden=32, inter=24))
    asked = []
    tritonmm.fuse(model, filter_fn=lambda m, name: asked.append(name) or name == "0")
    assert asked == ["0", "1"] and is_packed(model[0]) and not is_packed(model[1])
    asked.clear()
    tritonmm.fuse(model, filter_fn=lambda m, name: asked.append(name) or True)  # 0 fused already, 1 newly
    assert asked == ["0", "1"] and is_packed(model[1])


@pytest.mark.parametrize("lead", [(40,), (2, 20)], ids=["2d", "3d"])
def test_bound_replay_of_packed_calls_matches_float64_and_falls_back(lead, monkeypatch):
    """Repeated no-grad calls replay one GEMM on the packed weights and one bound launch of the product on its
    halves: the same values as the first call; a pair of the same geometry that is not packed takes the
    unpacked path; a failing launch falls back to torch with a warning."""
    from tritonmm.kernels import gated_product

    torch.manual_seed(0)
    both = randn(48, 32) / 32**0.5
    wg, wu = both[:24], both[24:]
    x = randn(*lead, 32)
    gemms = count_one_gemm(monkeypatch)
    launches = []
    real_launcher = gated_product.halves_launcher
    monkeypatch.setattr(gated_product, "halves_launcher", lambda *a: (lambda launch: lambda args: (
        launches.append(args[2]), launch(args)))(real_launcher(*a)))
    gated_op.clear_cache()
    with torch.no_grad():
        outs = [tritonmm.gated_linear(x, wg, wu) for _ in range(3)]
        assert len(gated_op._fast) == 1 and launches == [24, 24]  # the second and third calls replay
        for out in outs:
            assert_close_to_ref(out, x, wg, wu)
            assert torch.equal(out, outs[0])
        apart = randn(24, 32) / 32**0.5, randn(24, 32) / 32**0.5  # same geometry, two storages
        gemms.clear()
        assert_close_to_ref(tritonmm.gated_linear(x, *apart), x, *apart)
        assert launches == [24, 24] and gemms == [False]  # the unpacked path, through the same replay
    monkeypatch.setattr(gated_product, "_gated_product_halves_kernel", None)  # (a launch that raises TypeError)
    monkeypatch.setattr(gated_product, "LAUNCH_FAILURES", (TypeError,))
    gated_op.clear_cache()
    with torch.no_grad(), pytest.warns(Warning):
        for _ in range(2):
            assert_close_to_ref(tritonmm.gated_linear(x, wg, wu), x, wg, wu)


def test_replay_of_row_strided_weights_that_start_where_packed_ones_would():
    """Row-strided weights whose up weight starts N*K elements after the gate weight (no element shared) are
    not packed: every call, the replays too, matches eager."""
    N, K, S = 25, 32, 64
    buf = randn(N * K + N * S)
    w_gate, w_up = buf.as_strided((N, K), (S, 1), 0), buf.as_strided((N, K), (S, 1), N * K)
    x = randn(40, K)
    gated_op.clear_cache()
    with torch.no_grad():
        for _ in range(3):
            assert_close_to_ref(tritonmm.gated_linear(x, w_gate, w_up), x, w_gate, w_up)


def test_memory_torch_did_not_allocate_stays_where_it_is():
    """A weight on numpy's memory (or DLPack's) has another owner that may write it: fuse does not move it."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    mlp = MLP(hidden=32, inter=24)
    g = np.random.default_rng(0).standard_normal((24, 32)).astype(np.float32)
    mlp.gate_proj.weight = nn.Parameter(torch.from_numpy(g))
    tritonmm.fuse(mlp)
    assert mlp.gate_proj.weight.data_ptr() == g.ctypes.data and not is_packed(mlp)
    g[:] = 0  # the owner writes: the model sees it
    x = randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), mlp.down_proj(mlp.act_fn(x @ mlp.gate_proj.weight.t()) * mlp.up_proj(x)))
        assert not mlp(x).any() or mlp.down_proj.bias is not None


def test_a_packed_model_casts_and_loads_with_swap_module_params_on_conversion():
    """torch.utils.swap_tensors refuses tensors with weak references: none is kept on a packed parameter."""
    torch.manual_seed(0)
    sd = MLP(hidden=32, inter=24).state_dict()
    mlp = tritonmm.fuse(MLP(hidden=32, inter=24))
    assert is_packed(mlp)
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        mlp.load_state_dict(sd)
        mlp.double()
        tritonmm.unfuse(mlp)
        mlp.float()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)
    torch.testing.assert_close(mlp.state_dict(), {k: v.float() for k, v in sd.items()})
