"""fuse on nn.Sequential: a Linear directly followed by a known activation module runs as one
tritonmm.linear call with the activation in the GEMM's epilogue; values and gradients against the
unfused modules in float64, module surgery, hooks, compile."""

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritonmm
from tritonmm.core.reference import randn
from tritonmm.modules import fusion

pytestmark = pytest.mark.interpreter

ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU}


def _mlp(act, bias=True, hidden=40):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, hidden, bias=bias), ACTS[act](), nn.Dropout(0.0),
                         nn.Linear(hidden, 24, bias=bias), ACTS[act]())


def _count_epilogues(monkeypatch):
    calls = []
    real = fusion.linear
    monkeypatch.setattr(fusion, "linear", lambda x, w, b, act: calls.append(act) or real(x, w, b, act))
    return calls


@pytest.mark.parametrize("backend", ["default", "triton"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", list(ACTS))
def test_values_and_grads_match_the_unfused_modules_in_float64(act, bias, backend, monkeypatch):
    seq = _mlp(act, bias)
    ref = copy.deepcopy(seq).double()
    fused = tritonmm.fuse(copy.deepcopy(seq))
    assert type(fused).__name__ == "TritonFusedSequential" and isinstance(fused, nn.Sequential)
    calls = _count_epilogues(monkeypatch)
    x = randn(2, 7, 48)
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    forced = tritonmm.force_backend("triton", "pointer") if backend == "triton" else contextlib.nullcontext()
    with forced:
        out = fused(x1)
        g = randn(*out.shape)
        (out * g).sum().backward()
    expected = ref(x2)
    (expected * g.double()).sum().backward()
    assert calls == [act, act], "both Linear + activation pairs run as one call each"
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x1.grad.double(), x2.grad, rtol=1e-4, atol=1e-4)
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_float64_runs_in_torch_and_equals_the_modules():
    seq = _mlp("gelu").double()
    fused = tritonmm.fuse(copy.deepcopy(seq))
    x = randn(5, 48, dtype=torch.float64)
    torch.testing.assert_close(fused(x), seq(x), rtol=0, atol=0)


def test_the_epilogue_runs_in_the_kernel_when_triton_serves(monkeypatch):
    from tritonmm.core import activations

    seq = _mlp("silu")
    fused = tritonmm.fuse(copy.deepcopy(seq))

    def no_torch_activation(*args, **kwargs):
        raise AssertionError("the activation ran outside the kernel")

    x = randn(6, 48)
    expected = seq(x)
    monkeypatch.setattr(activations, "apply_", no_torch_activation)
    monkeypatch.setattr(activations, "apply", no_torch_activation)
    monkeypatch.setattr(F, "silu", no_torch_activation)
    with torch.no_grad(), tritonmm.force_backend("triton", "pointer"):
        torch.testing.assert_close(fused(x), expected, rtol=1e-4, atol=1e-4)


def test_round_trip_state_dict_hooks_ties_and_pickle(monkeypatch):
    model = nn.Sequential(_mlp("gelu"), nn.Linear(24, 48), _mlp("relu"))
    model[2][3].weight = model[0][3].weight  # tied across the two Sequentials
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters(remove_duplicate=False))
    tritonmm.fuse(model)
    assert type(model) is nn.Sequential  # the root has no Linear + activation pair
    assert [type(m).__name__ for m in model] == ["TritonFusedSequential", "Linear", "TritonFusedSequential"]
    assert dict(model.named_parameters(remove_duplicate=False)) == params
    assert model[2][3].weight is model[0][3].weight
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items()) and model.state_dict().keys() == sd.keys()
    x = randn(4, 48)
    calls = _count_epilogues(monkeypatch)
    out = model(x)
    assert calls == ["gelu", "gelu", "relu", "relu"]
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(other[0]).__name__ == "TritonFusedSequential"
        torch.testing.assert_close(other(x), out)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    torch.testing.assert_close(torch.load(buf, weights_only=False)(x), out)
    tritonmm.unfuse(model)
    assert [type(m) for m in model] == [nn.Sequential, nn.Linear, nn.Sequential]
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-5)


def test_hooks_on_the_pair_run_the_unfused_modules(monkeypatch):
    fused = tritonmm.fuse(_mlp("gelu"))
    seen = []
    handle = fused[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    calls = _count_epilogues(monkeypatch)
    fused(randn(3, 48))
    assert seen == [torch.Size([3, 40])] and calls == ["gelu"]  # the second pair is still fused
    handle.remove()
    fused[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    calls.clear()
    ref = _mlp("gelu")
    torch.testing.assert_close(fused(randn(3, 48, generator=torch.Generator().manual_seed(1))),
                               ref(2 * randn(3, 48, generator=torch.Generator().manual_seed(1))), rtol=1e-5, atol=1e-5)
    assert calls == ["gelu"]
    fused[3].forward = lambda t: torch.zeros(*t.shape[:-1], 24)  # accelerate-style instance forward
    calls.clear()
    assert torch.equal(fused(randn(3, 48)), F.gelu(torch.zeros(3, 24)))
    assert calls == []


def test_other_forms_are_left_alone():
    class OwnForward(nn.Sequential):
        def forward(self, x):
            return super().forward(x) + 1

    for seq in (nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.GELU()),
                nn.Sequential(nn.GELU(), nn.Linear(8, 8)),
                OwnForward(nn.Linear(8, 8), nn.GELU()),
                nn.Sequential(tritonmm.TritonLinear(8, 8), nn.GELU())):
        kind = type(seq)
        assert not tritonmm.fusion.fusable(seq) and type(tritonmm.fuse(seq)) is kind


def test_swapped_linears_and_a_modified_sequential(monkeypatch):
    seq = _mlp("silu")
    ref = copy.deepcopy(seq)
    tritonmm.swap_linear(tritonmm.fuse(seq))
    x = randn(5, 48)
    calls = _count_epilogues(monkeypatch)
    torch.testing.assert_close(seq(x), ref(x), rtol=1e-5, atol=1e-5)
    assert calls == ["silu", "silu"]
    seq[1] = nn.Tanh()  # the first pair is gone; the Sequential's forward still runs every module
    ref[1] = nn.Tanh()
    calls.clear()
    torch.testing.assert_close(seq(x), ref(x), rtol=1e-5, atol=1e-5)
    assert calls == ["silu"]


def test_linear_with_an_activation_takes_the_weight_plan_and_checks_the_name():
    x, w, b = randn(3, 16), randn(8, 16), randn(8)
    with torch.no_grad():
        for _ in range(3):  # the first calls make the weight's plan; later ones take it
            torch.testing.assert_close(tritonmm.linear(x, w, b, "gelu_tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"))
        with pytest.raises(ValueError, match="activation"):
            tritonmm.linear(x, w, b, "tanh")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_fused_sequential_fullgraph(dynamic):
    seq = _mlp("gelu")
    ref = copy.deepcopy(seq)
    f = torch.compile(tritonmm.fuse(seq), fullgraph=True, backend="aot_eager", dynamic=dynamic)
    x = randn(3, 48).requires_grad_()
    out = f(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and seq[0].weight.grad is not None


def test_compiled_fused_sequential_compiles_once_for_one_shape(monkeypatch):
    """A trace neither reads nor fills the module-type cache: its first fill would fail the trace's guard."""
    from tritonmm.modules import plain

    monkeypatch.setattr(plain, "_linear_types", {})  # as in a fresh process
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(tritonmm.fuse(_mlp("gelu")), backend=backend, fullgraph=True)
    x = randn(3, 48)
    for _ in range(3):
        f(x)
    assert len(frames) == 1


def test_settles_where_every_pair_goes_to_torch_and_unsettles(monkeypatch):
    """Where dispatch sends every GEMM of each fused pair's weight to torch (as on a GPU whose table never
    picks Triton for them), the Sequential settles into nn.Sequential's forward after one call: no
    tritonmm code per call. Moving it, assigning a module, forcing and clear_cache bring the fused
    forward back; it pickles and unfuses as a fused module."""
    from tritonmm.dispatch import decide

    monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: True)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device: True)
    tritonmm.clear_cache()
    seq = _mlp("gelu")
    ref = copy.deepcopy(seq)
    fused = tritonmm.fuse(seq)
    calls = _count_epilogues(monkeypatch)
    x = randn(3, 48)
    settled = lambda m: "_tritonmm_unsettled" in type(m).__dict__  # noqa: E731
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-6, atol=1e-6)
    assert calls == ["gelu", "gelu"] and settled(fused) and isinstance(fused, nn.Sequential)
    for _ in range(2):
        torch.testing.assert_close(fused(x), ref(x), rtol=1e-6, atol=1e-6)
    assert calls == ["gelu", "gelu"]  # nothing of tritonmm ran
    for other in (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused)):
        assert type(other).__name__ == "TritonFusedSequential" and not settled(other)
    with tritonmm.force_backend("torch"):
        assert not settled(fused)
        fused(x)
        assert not settled(fused)  # no settling while a backend is forced
    fused(x)
    assert settled(fused)
    fused.double()
    assert not settled(fused)
    fused.float()
    fused(x)
    assert settled(fused)
    fused[1] = nn.Tanh()  # the first pair is gone: the fused forward runs (and settles) again
    ref[1] = nn.Tanh()
    assert not settled(fused)
    calls.clear()
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-6, atol=1e-6)
    assert calls == ["gelu"] and settled(fused)
    tritonmm.clear_cache()
    assert not settled(fused)
    fused(x)
    tritonmm.unfuse(fused)
    assert type(fused) is nn.Sequential


def test_no_settling_while_some_pair_can_reach_triton(monkeypatch):
    from tritonmm.dispatch import decide

    monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: True)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, *args: N != 24)  # the second pair's weight: not free
    tritonmm.clear_cache()
    fused = tritonmm.fuse(_mlp("silu"))
    calls = _count_epilogues(monkeypatch)
    for _ in range(3):
        fused(randn(2, 48))
    assert calls == ["silu", "silu"] * 3 and "_tritonmm_unsettled" not in type(fused).__dict__
    plans = tritonmm.dispatch.plans.plans
    assert plans[id(fused[0].weight)][0] == 2 and plans[id(fused[3].weight)][0] == 0


def test_a_settled_root_sequential_compiles_fullgraph(monkeypatch):
    from tritonmm.dispatch import decide

    monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: True)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, *args: True)
    tritonmm.clear_cache()
    seq = _mlp("relu")
    ref = copy.deepcopy(seq)
    fused = tritonmm.fuse(seq)
    x = randn(3, 48)
    fused(x)
    assert "_tritonmm_unsettled" in type(fused).__dict__
    torch.testing.assert_close(torch.compile(fused, fullgraph=True, backend="aot_eager")(x), ref(x), rtol=1e-6,
                               atol=1e-6)


def test_a_slice_of_a_settled_sequential_is_unsettled(monkeypatch):
    """nn.Sequential's slicing builds ``type(self)(...)``: from a settled module it makes a fused one that
    follows forcing and clear_cache like any other."""
    from tritonmm.dispatch import decide

    monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: True)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, *args: True)
    tritonmm.clear_cache()
    fused = tritonmm.fuse(_mlp("gelu"))
    fused(randn(2, 48))
    assert "_tritonmm_unsettled" in type(fused).__dict__
    head = fused[0:2]
    assert type(head).__name__ == "TritonFusedSequential" and "_tritonmm_unsettled" not in type(head).__dict__
    calls = _count_epilogues(monkeypatch)
    x = randn(2, 48)
    with tritonmm.force_backend("triton", "pointer"):
        torch.testing.assert_close(head(x), F.gelu(F.linear(x, fused[0].weight, fused[0].bias)), rtol=1e-5, atol=1e-5)
    assert calls == ["gelu"]


def test_replaced_forwards_and_calls_and_tensor_subclass_weights_are_not_fused(monkeypatch):
    """What fusing would skip is kept: a class-level forward replaced on nn.Linear or an activation, a
    Linear subclass overriding ``__call__``, a weight subclass with its own F.linear."""
    x = randn(3, 16)

    def check(seq, fused_calls):
        ref = copy.deepcopy(seq)
        tritonmm.fuse(seq)
        calls = _count_epilogues(monkeypatch)
        torch.testing.assert_close(seq(x), ref(x), rtol=1e-5, atol=1e-5)
        assert len(calls) == fused_calls
        monkeypatch.undo()

    orig = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, t: orig(self, t) * 2)
    check(nn.Sequential(nn.Linear(16, 8), nn.GELU()), 0)
    monkeypatch.setattr(nn.SiLU, "forward", lambda self, t: F.silu(t) + 1)
    check(nn.Sequential(nn.Linear(16, 8), nn.SiLU()), 0)

    class CallLinear(nn.Linear):
        def __call__(self, t):
            return super().__call__(t) + 100

    check(nn.Sequential(CallLinear(16, 8), nn.ReLU()), 0)

    class Doubled(nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is F.linear:
                with torch._C.DisableTorchFunctionSubclass():
                    return F.linear(args[0], args[1] * 2, *args[2:], **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs or {})

    seq = nn.Sequential(nn.Linear(16, 8), nn.GELU())
    seq[0].weight = Doubled(seq[0].weight.detach())
    check(seq, 0)
    check(nn.Sequential(nn.Linear(16, 8), nn.GELU()), 1)  # (the checks can see a fused call)
