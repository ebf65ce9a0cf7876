"""nn.Linear integration: patch/unpatch, swap/unswap, TritonLinear."""

import pytest
import torch
from torch import nn

import tritonmm
import tritonmm.modules.linear as tnn
from tritonmm.core.reference import randn

pytestmark = pytest.mark.interpreter


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of tritonmm.linear made by the nn integration (under the interpreter no weight is
    free of tritonmm, so every forward reaches it)."""
    from tritonmm import api

    seen = []
    orig = api.linear
    monkeypatch.setattr(api, "linear", lambda *a, **k: seen.append(a[0].shape) or orig(*a, **k))
    return seen


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # weight tying

    def forward(self, idx):
        return self.head(torch.relu(self.proj(self.emb(idx))))


def test_patch_context_manager_and_plain_call(calls):
    lin = nn.Linear(8, 4)
    x = randn(3, 8)
    ref = lin(x)
    assert calls == []
    with tritonmm.patch_linear():
        assert tnn.is_linear_patched()
        torch.testing.assert_close(lin(x), ref)
    assert len(calls) == 1 and not tnn.is_linear_patched()
    lin(x)
    assert len(calls) == 1  # nothing changes after
    tritonmm.patch_linear()
    try:
        lin(x)
        assert len(calls) == 2
    finally:
        tritonmm.unpatch_linear()
    assert nn.Linear.forward is tnn._original_forward


def test_nested_patch_keeps_outer_state():
    with tritonmm.patch_linear():
        with tritonmm.patch_linear():
            pass
        assert tnn.is_linear_patched()
    assert not tnn.is_linear_patched()


def test_swap_preserves_everything(calls):
    torch.manual_seed(0)
    model = Tied()
    hook_calls = []
    model.proj.register_forward_hook(lambda m, i, o: hook_calls.append(o.shape))
    params_before = {n: p for n, p in model.named_parameters()}
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 50, (4, 7))
    ref = model(idx)

    assert tritonmm.swap_linear(model) is model
    assert isinstance(model.proj, nn.Linear) and type(model.proj) is not nn.Linear
    assert model.head.weight is model.emb.weight  # tying survives
    assert {n: p for n, p in model.named_parameters()} == params_before  # same objects
    sd = model.state_dict()
    assert sd.keys() == sd_before.keys() and all(torch.equal(sd[k], sd_before[k]) for k in sd)
    with tritonmm.force_backend("triton"):
        out = model(idx)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and len(hook_calls) == 2
    out.sum().backward()
    assert model.emb.weight.grad is not None

    assert tritonmm.unswap_linear(model) is model
    assert type(model.proj) is nn.Linear and type(model.head) is nn.Linear
    model(idx)
    assert len(calls) == 2 and len(hook_calls) == 3


def test_swap_filter_and_subclasses(calls):
    class MyLinear(nn.Linear):
        pass

    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(8, 8), MyLinear(8, 8), Custom(8, 8), nn.Linear(8, 8))
    tritonmm.swap_linear(model, filter_fn=lambda m, fqn: fqn != "3")
    assert isinstance(model[1], MyLinear) and type(model[1]).__name__ == "TritonSwappedMyLinear"
    assert type(model[2]) is Custom  # its own forward: left alone by default
    assert type(model[3]) is nn.Linear
    model(randn(2, 8))
    assert len(calls) == 2
    tritonmm.unswap_linear(model)
    assert [type(m) for m in model] == [nn.Linear, MyLinear, Custom, nn.Linear]


def test_swap_root_meta_device_dtype_requires_grad():
    lin = nn.Linear(8, 4, device="meta", dtype=torch.bfloat16)
    lin.bias.requires_grad_(False)
    tritonmm.swap_linear(lin)
    assert type(lin) is not nn.Linear
    assert lin.weight.device.type == "meta" and lin.weight.dtype == torch.bfloat16
    assert lin.weight.requires_grad and not lin.bias.requires_grad
    out = lin(torch.empty(3, 8, device="meta", dtype=torch.bfloat16))
    assert out.shape == (3, 4) and out.device.type == "meta"


def test_state_dict_round_trip():
    a, b = Tied(), Tied()
    tritonmm.swap_linear(a)
    b.load_state_dict(a.state_dict())
    tritonmm.swap_linear(b)
    a.load_state_dict(b.state_dict())
    idx = torch.randint(0, 50, (2, 3))
    with tritonmm.force_backend("triton"):
        torch.testing.assert_close(a(idx), b(idx))


def test_triton_linear_module_fuses_activation():
    m = tritonmm.TritonLinear(12, 6, activation="silu")
    x = randn(5, 12)
    with tritonmm.force_backend("triton"):
        torch.testing.assert_close(m(x), torch.nn.functional.silu(torch.nn.functional.linear(x, m.weight, m.bias)))
    assert "silu" in repr(m)


@pytest.mark.parametrize("activation", ["tanh", None, ["relu"]])
def test_triton_linear_rejects_an_unknown_activation_when_built(activation):
    with pytest.raises(ValueError, match="activation"):
        tritonmm.TritonLinear(12, 6, activation=activation)


def test_classes_with_an_init_subclass_of_their_own_are_not_swapped_or_fused():
    """A class hook on subclassing may need arguments (a TypeError halfway through a model) or register the
    swapped class: such modules stay as they are, the others are swapped or fused."""
    registry = {}

    class Registered(nn.Linear):
        def __init_subclass__(cls, kind, **kw):
            super().__init_subclass__(**kw)
            registry[kind] = cls

    class Mine(Registered, kind="mine"):
        pass

    class RegisteredMLP(nn.Module):
        def __init_subclass__(cls, **kw):
            super().__init_subclass__(**kw)
            registry[cls.__name__] = cls

    class MLP(RegisteredMLP):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj

    model = nn.Sequential(nn.Linear(8, 8), Mine(8, 8), nn.Linear(8, 8), MLP())
    before = dict(registry)
    tritonmm.swap_linear(model)
    tritonmm.fuse(model)
    assert [type(m).__name__ for m in model] == ["TritonSwappedLinear", "Mine", "TritonSwappedLinear", "MLP"]
    assert registry == before and not tritonmm.fusion.fusable(model[3])
    x = randn(2, 8)
    ref = nn.Sequential(*[m for m in model])
    torch.testing.assert_close(model(x), ref(x))


def test_unswap_after_a_parametrization_gives_the_original_class_under_it():
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    model = tritonmm.swap_linear(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    parametrizations.weight_norm(model[0])
    x = randn(3, 8)
    want = model(x)
    tritonmm.unswap_linear(model)
    assert type(model[0]).__name__ == "ParametrizedLinear" and type(model[0]).__bases__ == (nn.Linear,)
    torch.testing.assert_close(model(x), want)
    parametrize.remove_parametrizations(model[0], "weight")
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    torch.testing.assert_close(model(x), want)


def test_unswap_leaves_a_user_subclass_of_a_swapped_class_alone():
    swapped = type(tritonmm.swap_linear(nn.Linear(4, 4)))

    class Mine(swapped):
        pass

    model = nn.Sequential(Mine(4, 4))
    tritonmm.unswap_linear(model)
    assert type(model[0]) is Mine
