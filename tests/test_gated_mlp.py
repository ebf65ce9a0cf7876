"""The fused MLP's training nodes (:mod:`tritonmm.ops.gated_mlp`) under the interpreter: values and gradients
against float64, odd sizes, autocast, a second backward, double backward, and the calls it leaves to other paths."""

import copy

import pytest
import torch
from torch import nn

import tritonmm
from tritonmm.core.reference import randn
from tritonmm.dispatch import gated
from tritonmm.ops import gated_mlp

pytestmark = pytest.mark.interpreter


class MLP(nn.Module):
    def __init__(self, hidden=40, inter=24, act=None, down_bias=False, dtype=torch.float32):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=down_bias, dtype=dtype)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.fixture
def counted(monkeypatch):
    """The product threshold at 0 (the Function at these sizes); the list of the Function's forward calls."""
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)
    calls = []
    real = gated_mlp._product
    monkeypatch.setattr(gated_mlp, "_product", lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


def _step(module, x, dy, retain=False):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(dy.to(out.dtype), retain_graph=retain)
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


def _close_to_float64(got, want, eager):
    """Each of ``got`` within twice eager's error against float64 (plus a rounding's worth)."""
    for i, (g, w, e) in enumerate(zip(got, want, eager)):
        assert g.dtype == e.dtype and g.shape == e.shape, i
        assert not g.isnan().any(), i
        err, eager_err = (g.double() - w).abs().max().item(), (e.double() - w).abs().max().item()
        rounding = 1e-2 * w.abs().max().item() * (g.dtype != torch.float32)
        assert err <= 2 * eager_err + rounding + 1e-6, (i, err, eager_err)


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU()], ids=str)
@pytest.mark.parametrize("down_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_and_gradients_against_float64(act, down_bias, dtype, counted):
    torch.manual_seed(0)
    mlp = MLP(hidden=40, inter=24, act=act, down_bias=down_bias, dtype=dtype)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x, dy = randn(3, 7, 40, dtype=dtype), randn(3, 7, 40, dtype=dtype)
    x0 = x.clone()
    got = _step(fused, x, dy)
    assert counted and counted[0] == (21, 48), "the training Function did not run"
    want = _step(copy.deepcopy(mlp).double(), x.double(), dy.double())
    _close_to_float64(got, want, _step(mlp, x, dy))
    assert torch.equal(x, x0)
    for p, q in zip(fused.parameters(), mlp.parameters()):
        assert torch.equal(p, q)  # parameters read, not written


def test_odd_sizes(counted):
    torch.manual_seed(1)
    mlp = MLP(hidden=33, inter=19, down_bias=True)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x, dy = randn(37, 33), randn(37, 33)
    got = _step(fused, x, dy)
    assert counted
    _close_to_float64(got, _step(copy.deepcopy(mlp).double(), x.double(), dy.double()), _step(mlp, x, dy))


def test_a_second_backward_through_the_retained_graph(counted):
    """The first backward writes the gradients over the saved projections; a second recomputes them."""
    torch.manual_seed(2)
    fused = tritonmm.fuse(MLP())
    x = randn(30, 40).requires_grad_()
    dy = randn(30, 40)
    out = fused(x)
    out.backward(dy, retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in fused.parameters()]
    x.grad = None
    fused.zero_grad(set_to_none=True)
    out.backward(dy)
    for a, b in zip([x.grad] + [p.grad for p in fused.parameters()], first):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("after_a_first", [False, True], ids=["first", "after a first backward"])
def test_double_backward_differentiates_the_expression(after_a_first, counted):
    """A gradient penalty; also after a first backward (retain_graph=True) wrote over the saved projections."""
    torch.manual_seed(3)
    mlp = MLP()
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    penalties, x0 = [], randn(20, 40)
    for module in (fused, mlp):
        x = x0.clone().requires_grad_()
        y = module(x).square().sum()
        if after_a_first:
            y.backward(retain_graph=True)
            module.zero_grad(set_to_none=True)
        (dx,) = torch.autograd.grad(y, x, create_graph=True)
        dx.square().sum().backward()
        penalties.append([p.grad for p in module.parameters()])
    assert counted
    for a, b in zip(*penalties):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_input_modified_in_place_before_the_backward_raises(counted):
    fused = tritonmm.fuse(MLP())
    x = randn(20, 40).requires_grad_()
    xin = x * 1.0
    out = fused(xin)
    xin.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_autocast_casts_as_f_linear_does(counted):
    """fp32 weights under bf16 autocast: outputs and gradients of eager's dtypes, values within bf16 rounding."""
    torch.manual_seed(4)
    mlp = MLP()
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x, dy = randn(30, 40), randn(30, 40)
    outs = []
    for module in (fused, mlp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(_step(module, x, dy))
    assert counted
    for a, b in zip(*outs):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_calls_it_leaves_to_other_paths(monkeypatch):
    """No gradient, below PRODUCT_MIN_FLOPS, up to GATED_MAX_M rows, unpacked weights: not the Function."""
    calls = []
    real = gated_mlp._Down.apply
    monkeypatch.setattr(gated_mlp._Down, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(5)
    mlp = MLP()
    packed, unpacked = tritonmm.fuse(copy.deepcopy(mlp)), tritonmm.fuse(copy.deepcopy(mlp), pack=False)
    x = randn(30, 40).requires_grad_()
    packed(x).sum().backward()  # below the default threshold
    monkeypatch.setattr(gated, "PRODUCT_MIN_FLOPS", 0)
    with torch.no_grad():
        packed(x)
    packed(randn(gated.GATED_MAX_M, 40).requires_grad_()).sum().backward()
    unpacked(x).sum().backward()
    assert not calls
    packed(x).sum().backward()
    assert calls == [1]


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_gradients_over_the_projections_and_the_product_over_dh(act):
    """The backward's one pass, in place on the halves of one (M, 2N) tensor, gives what the out-of-place pass gives
    and the product exactly as the forward's pass rounds it."""
    from tritonmm.dispatch import gated_cublas

    M, N = 37, 40
    gu, dh = randn(M, 2 * N, dtype=torch.bfloat16), randn(M, N, dtype=torch.bfloat16)
    g, u = gu[:, :N], gu[:, N:]
    dg, du, h = torch.empty_like(g), torch.empty_like(u), torch.empty_like(dh)
    gated_cublas.product(g, u, h, act)
    gated_cublas._load().gated_product_backward(dh, g.contiguous(), u.contiguous(), dg, du, act)
    dh_in_place, gu_in_place = dh.clone(), gu.clone()
    gated_cublas.grads_into(dh_in_place, gu_in_place[:, :N], gu_in_place[:, N:], act)
    assert torch.equal(gu_in_place[:, :N], dg) and torch.equal(gu_in_place[:, N:], du)
    assert torch.equal(dh_in_place, h)


def test_only_the_down_projection_trained(counted):
    """Frozen gate and up weights, an input without a gradient: the down weight's and bias's gradients."""
    torch.manual_seed(6)
    mlp = MLP(down_bias=True)
    for p in (mlp.gate_proj.weight, mlp.up_proj.weight):
        p.requires_grad_(False)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x, dy = randn(30, 40), randn(30, 40)
    grads = []
    for module in (fused, mlp):
        module(x).backward(dy)
        grads.append((module.down_proj.weight.grad, module.down_proj.bias.grad))
    assert len(counted) == 2  # the forward's product, and the backward's for the down weight's gradient
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_activation_memory_kept_for_the_backward_is_half_eagers(counted):
    """Eager keeps four (M, N) activations (gate projection, its activation, up projection, product); the Function
    keeps the two projections (:func:`tritonmm.bench.mlp.saved_bytes`, parameters and input left out)."""
    from tritonmm.bench.mlp import saved_bytes

    mlp = MLP(hidden=40, inter=24)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x = randn(64, 40).requires_grad_()
    eager_bytes = saved_bytes(lambda: mlp(x), (*mlp.parameters(), x))
    fused_bytes = saved_bytes(lambda: fused(x), (*fused.parameters(), x))
    assert counted
    assert eager_bytes == 4 * 64 * 24 * 4
    assert fused_bytes == 2 * 64 * 24 * 4




def test_in_place_changes_torch_allows_are_allowed(counted):
    """Only what torch saves is checked: the down bias changed in place after the forward; a frozen MLP whose input
    is changed in place after it (a residual added in place)."""
    torch.manual_seed(7)
    mlp = MLP(down_bias=True)
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    outs, x0 = [], randn(30, 40)
    for module in (fused, mlp):
        x = x0.clone().requires_grad_()
        y = module(x)
        with torch.no_grad():
            module.down_proj.bias.add_(1)
        y.sum().backward()
        outs.append([x.grad] + [p.grad for p in module.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for module in (fused, mlp):
        module.zero_grad(set_to_none=True)
        module.requires_grad_(False)
    outs, x0 = [], randn(30, 40)
    for module in (fused, mlp):
        leaf = x0.clone().requires_grad_()
        h = leaf * 1.0
        h += module(h)
        h.sum().backward()
        outs.append(leaf.grad)
    assert len(counted) >= 2
    torch.testing.assert_close(*outs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("between", ["copying hooks", "unfuse", "layout-changing hooks"])
def test_second_backward_and_saved_tensor_hooks(between, counted):
    """Hooks that copy the saved tensors, or give them back in another layout; unfuse between two backwards."""
    torch.manual_seed(8)
    mlp = MLP()
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x0, dy = randn(30, 40), randn(30, 40)
    hooks = {"copying hooks": (lambda t: t.clone(), lambda t: t),
             "layout-changing hooks": (lambda t: t.t().contiguous() if t.dim() == 2 else t,
                                       lambda t: t.t() if t.dim() == 2 else t),
             "unfuse": (lambda t: t, lambda t: t)}[between]
    results = []
    for module in (fused, mlp):
        x = x0.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            y = module(x)
        y.backward(dy, retain_graph=True)
        first = [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
        if between == "unfuse" and module is fused:
            tritonmm.unfuse(module)
        x.grad = None
        module.zero_grad(set_to_none=True)
        y.backward(dy)
        results.append((first, [x.grad] + [p.grad for p in module.parameters()]))
    assert counted
    for (f1, s1), (f2, s2) in [results]:
        for a, b, c, d in zip(f1, s1, f2, s2):
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(b, d, rtol=1e-4, atol=1e-5)


def test_saved_tensors_a_hook_keeps_are_not_changed(counted):
    kept = []
    fused = tritonmm.fuse(MLP())
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = fused(randn(30, 40).requires_grad_())
    before = [t.clone() for t in kept]
    y.sum().backward()
    assert counted and all(torch.equal(a, b) for a, b in zip(before, kept))


def test_batched_gradients(counted):
    """``is_grads_batched`` and a vectorized jacobian (torch's batched tensors reach the backward)."""
    torch.manual_seed(9)
    mlp = MLP()
    fused = tritonmm.fuse(copy.deepcopy(mlp))
    x, v = randn(30, 40), randn(3, 30, 40)
    grads = []
    for module in (fused, mlp):
        xx = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(module(xx), xx, v, is_grads_batched=True)
        jac = torch.autograd.functional.jacobian(lambda t: module(t).sum(0), x[:20], vectorize=True)
        grads.append((g, jac))
    assert counted
    assert grads[0][0].shape == (3, 30, 40) and grads[0][1].shape == (40, 20, 40)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_down_weights_gradient_is_accumulated_before_the_gate_and_up_weights_are_computed(counted):
    """dWd reaches ``.grad`` (its hooks run) before the gate and up weights' gradients exist, as in eager, so the
    backward never holds all three weights' gradients at once."""
    fused = tritonmm.fuse(MLP())
    seen = []
    fused.down_proj.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append((fused.gate_proj.weight.grad, fused.up_proj.weight.grad)))
    fused(randn(30, 40).requires_grad_()).sum().backward()
    assert counted and seen == [(None, None)]
    assert fused.gate_proj.weight.grad is not None and fused.up_proj.weight.grad is not None


def test_the_gate_weights_gradient_is_accumulated_before_the_up_weights_is_computed(counted, monkeypatch):
    """Wg's gradient reaches ``.grad`` before the node that computes Wu's gradient and dx runs, as for two
    ``nn.Linear`` layers, so the backward holds one of the two weights' gradients at a time."""
    fused = tritonmm.fuse(MLP())
    seen, real = [], gated_mlp._GateUp.backward
    monkeypatch.setattr(gated_mlp._GateUp, "backward", staticmethod(
        lambda ctx, dgu: seen.append(fused.gate_proj.weight.grad is not None) or real(ctx, dgu)))
    fused(randn(30, 40).requires_grad_()).sum().backward()
    assert counted and seen == [True]
    assert fused.up_proj.weight.grad is not None
