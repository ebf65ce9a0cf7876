"""The per-call fast path (tritonmm/api.py): which route a geometry takes, and that every route computes
what torch computes (CPU: Triton kernels through the interpreter)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import tritonmm
from tritonmm.core.reference import randn
from tritonmm.dispatch import decide, runners
from tritonmm.ops import routes

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def fresh_cache():
    tritonmm.clear_cache()
    yield
    tritonmm.clear_cache()


def _entries():
    return list(routes._cache.values())


def test_torch_route_is_torchs_own_call():
    """Where every GEMM of a geometry goes to cuBLAS (here: forced), the call is F.linear / torch.matmul
    itself: same values bit for bit, torch's own autograd node."""
    x, w, b = randn(6, 10).requires_grad_(), randn(7, 10).requires_grad_(), randn(7)
    with tritonmm.force_backend("torch"):
        y = tritonmm.linear(x, w, b)
        z = tritonmm.matmul(y, randn(7, 3))
    assert F.linear in _entries() and torch.matmul in _entries()
    assert torch.equal(y, F.linear(x, w, b)) and type(y.grad_fn).__name__ == "AddmmBackward0"
    assert type(z.grad_fn).__name__ == "MmBackward0"


def test_float64_is_torchs_whatever_the_forcing():
    x, w = randn(5, 8, dtype=torch.float64), randn(3, 8, dtype=torch.float64)
    with tritonmm.force_backend("triton"):
        assert torch.equal(tritonmm.linear(x, w), F.linear(x, w))
    assert _entries() == [F.linear]


def test_triton_route_values_and_gradients():
    x, w, b = randn(2, 9, 24).requires_grad_(), randn(12, 24).requires_grad_(), randn(12).requires_grad_()
    y = tritonmm.linear(x, w, b, "gelu")
    assert isinstance(_entries()[0], routes.Route) and type(y.grad_fn).__name__ == "_LinearFunctionBackward"
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.gelu(F.linear(xd, wd, bd))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    ref.square().sum().backward()
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_backward_only_route(monkeypatch):
    """A geometry whose forward is cuBLAS but whose backward GEMMs may reach Triton: calls without
    autograd go to F.linear itself, calls with autograd to tritonmm's Function."""
    answers = iter([True, False])  # forward: torch everywhere; backward: not
    monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: next(answers))
    x, w = randn(4, 16).requires_grad_(), randn(8, 16).requires_grad_()
    with torch.no_grad():
        y0 = tritonmm.linear(x, w)
    route = _entries()[0]
    assert isinstance(route, routes.Route) and route.forward_torch
    assert torch.equal(y0, F.linear(x, w)) and not route.runs  # no runner: torch served it
    y1 = tritonmm.linear(x, w)
    assert type(y1.grad_fn).__name__ == "_LinearFunctionBackward"
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)


def test_second_key_separates_layouts_and_shapes():
    """One route (same element count and weight) serves operands of other strides and shapes, each
    with its own runner and the right result."""
    w = randn(5, 8)
    base = randn(6, 6, 8)
    views = [base[:2, :3], base[:3, :2], randn(6, 8), randn(8, 6).t()]  # equal strides, other shapes; a transpose
    for x in views:
        got = tritonmm.linear(x, w)
        assert got.shape == (*x.shape[:-1], 5)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    (route,) = _entries()
    assert len(route.runs) == len(views)


def test_second_key_checks_the_weights_dtype_and_the_bias():
    x, w = randn(4, 16), randn(8, 16)
    tritonmm.linear(x, w)
    with pytest.raises(RuntimeError, match="dtype"):
        tritonmm.linear(x, w.half())  # same first key (x decides it): the second catches the mismatch
    with pytest.raises(RuntimeError):
        tritonmm.linear(x, w, randn(3))
    with pytest.raises(TypeError, match="bias"):
        tritonmm.linear(x, w, 1.0)


def _route_calls(monkeypatch):
    calls = []
    orig = routes.Route.__call__
    monkeypatch.setattr(routes.Route, "__call__", lambda self, *args: calls.append(1) or orig(self, *args))
    return calls


@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_direct_key_serves_repeat_calls_and_only_those(op, monkeypatch):
    """A plain call without autograd that a cached Triton route served once is served by one key and one
    lookup (routes.direct), not by the Route; a call with a gradient, under autocast, on a neg-bit view, with
    a weight of another dtype or strides, or after an environment variable changed the decision, is not
    served by that entry, and each gets what torch computes."""
    x, w, b = randn(4, 16), randn(8, 16), randn(8)
    if op == "linear":
        call, want = (lambda x, w: tritonmm.linear(x, w, b, "relu")), (lambda x, w: F.relu(F.linear(x, w, b)))
    else:
        call, want = (lambda x, w: tritonmm.matmul(x, w.t())), (lambda x, w: torch.matmul(x, w.t()))
    call(x, w)
    assert len(routes.direct) == 1 and isinstance(_entries()[0], routes.Route)
    calls = _route_calls(monkeypatch)
    for _ in range(2):
        torch.testing.assert_close(call(x, w), want(x, w), rtol=1e-5, atol=1e-5)
    assert not calls and len(routes.direct) == 1
    y = call(x.clone().requires_grad_(), w)
    assert len(calls) == 1 and y.grad_fn is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = call(x, w)
    assert len(calls) == 2 and got.dtype == torch.bfloat16
    neg = (x.to(torch.complex64) * 1j).conj().imag  # x's values negated, by a neg-bit view
    assert neg.is_neg()
    torch.testing.assert_close(call(neg, w), want(-x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3
    wt = w.t().contiguous().t()  # same values, other strides: its own runner
    torch.testing.assert_close(call(x, wt), want(x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 4
    with pytest.raises(RuntimeError, match="dtype"):
        call(x, w.double())  # (the Route's own checks raise)
    n = len(calls)
    monkeypatch.setenv("TRITONMM_BACKEND", "torch")
    assert torch.equal(call(x, w), want(x, w))  # torch's own call, bit for bit: the Triton entry did not serve it
    assert len(calls) == n and not isinstance(_entries()[-1], routes.Route)
    monkeypatch.delenv("TRITONMM_BACKEND")
    call(x, w)
    assert len(calls) == n  # the entry serves again
    tritonmm.clear_cache()
    assert not routes.direct


def test_fx_symbolic_trace_while_direct_entries_exist():
    """torch.fx's Proxies (whose truth value raises) reach the keyed functions with direct entries present:
    they are recorded as the ops, with gradients enabled too."""
    x, w, b = randn(3, 8), randn(5, 8), randn(5)
    tritonmm.matmul(x, w.t()), tritonmm.linear(x, w, b)
    assert routes.direct
    with torch.enable_grad():
        gm = torch.fx.symbolic_trace(lambda a, c: tritonmm.matmul(a, c))
        gl = torch.fx.symbolic_trace(lambda a, c, d: tritonmm.linear(a, c, d))
    assert {n.target for n in gm.graph.nodes if n.op == "call_function"} == {torch.ops.tritonmm.matmul}
    assert {n.target for n in gl.graph.nodes if n.op == "call_function"} == {torch.ops.tritonmm.linear}
    torch.testing.assert_close(gm(x, w.t()), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gl(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_matmul_and_linear_of_one_square_weight_keep_their_own_entries():
    """matmul reads b as (K, N), linear as (N, K): on a square weight their direct keys differ, whichever comes
    first."""
    a, w = randn(4, 8), randn(8, 8)
    for first in ("matmul", "linear"):
        tritonmm.clear_cache()
        calls = [lambda: tritonmm.matmul(a, w), lambda: tritonmm.linear(a, w)]
        if first == "linear":
            calls.reverse()
        for _ in range(2):
            for call in calls:
                call()
        assert len(routes.direct) == 2
        torch.testing.assert_close(tritonmm.matmul(a, w), a @ w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tritonmm.linear(a, w), a @ w.t(), rtol=1e-5, atol=1e-5)


def test_an_unhashable_activation_raises_the_value_error():
    x, w = randn(4, 8), randn(5, 8)
    for _ in range(2):
        tritonmm.linear(x, w)
        with pytest.raises(ValueError, match="activation"):
            tritonmm.linear(x, w, None, ["relu"])


def test_an_unhashable_activation_on_a_planned_weight_raises_the_value_error(everything_torch):
    x, w = randn(4, 8), randn(5, 8)
    tritonmm.linear(x, w), tritonmm.linear(x, w)
    assert routes.free_ptrs.get(id(w)) == w.data_ptr()
    with pytest.raises(ValueError, match="activation"):
        tritonmm.linear(x, w, None, ["relu"])


_CALLS = ("matmul", "matmul_t", "linear", "linear_bias_gelu", "linear_relu", "linear_grad")


def _operand(rows, cols, layout):
    if layout == "T":
        return randn(cols, rows).t()
    if layout == "sliced":
        return randn(2 * rows, cols + 3)[::2, 3:]
    return randn(rows, cols)


@given(M=st.integers(1, 12), K=st.sampled_from([4, 8, 9, 16]), square=st.booleans(),
       x_layout=st.sampled_from(["N", "T", "sliced"]), w_layout=st.sampled_from(["N", "T", "sliced"]),
       calls=st.lists(st.sampled_from(_CALLS), min_size=3, max_size=8))
def test_interleaved_calls_on_shared_operands_match_float64(M, K, square, x_layout, w_layout, calls):
    """matmul and linear calls in any order on the same operands (a square weight included: matmul reads it
    as (K, N), linear as (N, K)), with and without bias, activation and gradient, each against float64: repeat
    calls are served by direct keys and must stay each call's own."""
    N = K if square else K + 3
    x, w, b = _operand(M, K, x_layout), _operand(N, K, w_layout), randn(N)
    wk = _operand(K, N, w_layout)  # a (K, N) right operand for matmul
    xd, wd, bd, wkd = (t.double() for t in (x, w, b, wk))
    for call in calls:
        if call == "matmul":
            got, want = tritonmm.matmul(x, wk), xd @ wkd
        elif call == "matmul_t":
            got, want = tritonmm.matmul(x, w.t()), xd @ wd.t()
        elif call == "linear":
            got, want = tritonmm.linear(x, w), F.linear(xd, wd)
        elif call == "linear_bias_gelu":
            got, want = tritonmm.linear(x, w, b, "gelu"), F.gelu(F.linear(xd, wd, bd))
        elif call == "linear_relu":
            got, want = tritonmm.linear(x, w, None, "relu"), F.relu(F.linear(xd, wd))
        else:
            xg = x.detach().requires_grad_()
            got = tritonmm.linear(xg, w, b)
            got.sum().backward()
            torch.testing.assert_close(xg.grad.double(), torch.ones(M, N, dtype=torch.float64) @ wd,
                                       rtol=1e-4, atol=1e-4)
            got, want = got.detach(), F.linear(xd, wd, bd)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{call}: {m}")
    assert torch.equal(x.double(), xd) and torch.equal(w.double(), wd)  # inputs unchanged


def test_a_deferred_route_enters_no_direct_entry():
    """A route first-sight tuning keeps for one call only (inside CUDA-graph capture) must decide again on its
    next call: it leaves nothing in routes.direct."""
    x, w = randn(4, 16), randn(8, 16)
    route = routes.Route(F.linear, False, "linear", "none")
    torch.testing.assert_close(routes._deferred(route)(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert route.runs and not routes.direct


def test_a_failed_kernel_served_through_the_direct_key_warns_once(monkeypatch):
    """A runner whose kernel fails falls back to torch for good, one warning, also when it is reached
    through routes.direct."""
    from tritonmm.kernels import launch as launch_mod

    x, w = randn(4, 16), randn(8, 16)
    tritonmm.linear(x, w)
    (prepared,) = routes.direct.values()
    assert prepared.decision.backend == "triton"
    inner = prepared.run

    def failing(*args):
        raise launch_mod.LAUNCH_FAILURES[0]("no resources")

    cells = [c for c in inner.__closure__ if callable(c.cell_contents) and c.cell_contents.__name__ == "run"]
    cells[0].cell_contents = failing
    with pytest.warns(runners.KernelFailedWarning):
        got = tritonmm.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(tritonmm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert prepared.decision.backend == "torch"


def test_autocast_on_the_triton_route_casts_the_current_weight():
    """fp32 weights under bf16 autocast: the Triton route casts as F.linear does, and a weight changed
    through ``.data`` between autocast regions (no version bump) is cast anew (torch clears its cache
    when a region ends)."""
    lin = torch.nn.Linear(16, 8)
    x = randn(4, 16)
    with tritonmm.force_backend("triton", "pointer"):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = tritonmm.linear(x, lin.weight, lin.bias)
                want = F.linear(x, lin.weight, lin.bias)
            assert got.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            lin.weight.data.copy_(randn(8, 16) * 3)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_dispatch_modes_see_every_route(backend):
    """A dispatch mode (e.g. a FLOP counter) sees the op (Triton route) or torch's own ops (torch route):
    no route bypasses it."""
    x, w = randn(4, 16), randn(8, 16)
    with tritonmm.force_backend(backend):
        tritonmm.linear(x, w)  # the route exists before the mode starts
        with _Recorder() as rec:
            tritonmm.linear(x, w)
    want = "tritonmm.linear" if backend == "auto" else "aten."
    assert any(op.startswith(want) for op in rec.ops), rec.ops


def _aot_graphs(fn, *args, dynamic=False):
    """The forward graphs AOTAutograd produces for ``fn`` compiled with fullgraph=True."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def backend(gm, inputs):
        def fw(g, ins):
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, inputs, fw_compiler=fw)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    return out, [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_torch_decision_is_plain_aten(dynamic):
    """Under torch.compile a cuBLAS decision leaves only aten ops in the graph: nothing of tritonmm runs
    per call."""
    x, w, b = randn(6, 16), randn(8, 16), randn(8)
    with tritonmm.force_backend("torch"):
        out, targets = _aot_graphs(lambda x: tritonmm.linear(x, w, b, "relu") @ w, x, dynamic=dynamic)
    assert not any("tritonmm" in t for t in targets) and any("addmm" in t or "mm" in t for t in targets), targets
    torch.testing.assert_close(out, F.relu(F.linear(x, w, b)) @ w)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_triton_decision_runs_the_kernel(dynamic):
    """Under the interpreter a Triton decision is the kernel behind the opaque kernel op (on CUDA it is a
    wrap_triton launch: tests/test_gpu.py)."""
    x, w, b = randn(6, 16), randn(8, 16), randn(8)
    out, targets = _aot_graphs(lambda x: tritonmm.linear(x, w, b, "silu"), x, dynamic=dynamic)
    assert any("tritonmm.kernel_linear" in t for t in targets), targets
    torch.testing.assert_close(out, F.silu(F.linear(x, w, b)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_export_keeps_the_op(backend):
    """torch.export records tritonmm's op (a high-level, serializable graph), whatever the decision."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.lin(x)

    m = tritonmm.swap_linear(M())
    x = randn(4, 16)
    with tritonmm.force_backend(backend):
        ep = torch.export.export(m, (x,))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "tritonmm.linear.default" in targets, targets
    torch.testing.assert_close(ep.module()(x), F.linear(x, m.lin.weight, m.lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_opcheck_kernel_ops(kernel):
    a, b = randn(9, 24), randn(24, 7)
    torch.library.opcheck(torch.ops.tritonmm.kernel_matmul.default, (a, b, kernel, ""))
    torch.library.opcheck(torch.ops.tritonmm.kernel_linear.default, (a, b.t(), randn(7), "gelu", kernel, ""))


def test_padded_rule_needs_an_unaligned_k_or_n(monkeypatch):
    """The padded path is for unaligned K or N; aligned sizes stay plain cuBLAS, so the fast path can call
    torch directly for them."""
    monkeypatch.setattr(decide._tuned, "entry", lambda device, dtype, p: None)
    monkeypatch.setattr(decide._tuned, "has_kernel", lambda *a: False)
    cuda = torch.device("cuda")
    bf16 = torch.bfloat16
    assert decide.torch_everywhere([(4096, 4096, 4096, 1)], bf16, cuda)
    assert not decide.torch_everywhere([(4096, 4097, 4096, 1)], bf16, cuda)
    assert decide.torch_everywhere([(16, 4097, 4096, 1)], bf16, cuda)  # memory-bound: no copies
    assert not decide._pads(4096, 4096, 4096, bf16) and decide._pads(4096, 4096, 4095, bf16)


@pytest.fixture
def everything_torch(monkeypatch):
    """Dispatch as on a GPU whose table never picks Triton for these sizes (the interpreter otherwise
    sends every CPU call to Triton)."""
    monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: True)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device: True)


def test_weight_plan_skips_the_key(everything_torch, monkeypatch):
    """A weight free of tritonmm gets a plan on its first call; later calls are F.linear itself with no
    key built, until the weight changes storage or shape, or something is forced. A swapped layer
    settles on its second call: it then runs nn.Linear's own forward (new data included) until forcing."""
    keyed = []
    orig = routes.linear_keyed
    monkeypatch.setattr(routes, "linear_keyed", lambda *a: keyed.append(1) or orig(*a))
    lin = tritonmm.swap_linear(torch.nn.Linear(16, 8))
    x = randn(4, 16)
    lin(x)
    assert len(keyed) == 1 and routes.plans[id(lin.weight)][0]
    for _ in range(3):
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
        tritonmm.linear(x, lin.weight)
    assert len(keyed) == 1 and "_tritonmm_unsettled" in type(lin).__dict__  # settled
    lin.weight.data = randn(8, 16)  # new storage
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    tritonmm.linear(x, lin.weight)  # the functional call checks the storage: the plan is stale
    assert len(keyed) == 2
    with tritonmm.force_backend("torch"):
        lin(x)  # forcing unsettles the layer and bypasses plans
    assert len(keyed) == 3 and "_tritonmm_unsettled" not in type(lin).__dict__
    tritonmm.clear_cache()
    assert not routes.plans


def test_settled_layer_costs_nothing_and_unsettles(everything_torch, monkeypatch):
    """Settled layers run nn.Linear's forward (no tritonmm code per call), keep isinstance, hooks,
    state_dict and unswap; moving or replacing their weights, forcing and clear_cache unsettle them."""
    import copy
    import io

    from tritonmm.modules import linear as tnn

    looked = []
    monkeypatch.setattr(tnn, "_plans_get", lambda k: looked.append(k) or routes.plans.get(k))
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    hooked = []
    handle = model[0].register_forward_hook(lambda m, i, o: hooked.append(o.shape))
    x = randn(3, 16)
    want = model(x).detach()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    tritonmm.swap_linear(model)
    for _ in range(2):
        model(x)
    settled = lambda m: "_tritonmm_unsettled" in type(m).__dict__  # noqa: E731
    assert settled(model[0]) and settled(model[2]) and isinstance(model[0], torch.nn.Linear)
    before = len(looked)
    for _ in range(3):
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    assert len(looked) == before and len(hooked) == 6  # no tritonmm code ran; hooks did
    handle.remove()  # (a lambda does not pickle)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(model)):  # copies start swapped
        assert "_tritonmm_base" in type(other[0]).__dict__ and not settled(other[0])
        torch.testing.assert_close(other(x), want, rtol=0, atol=0)
    model.double()
    assert not settled(model[0]) and not settled(model[2])  # new dtype: decided again
    torch.testing.assert_close(model(x.double()), want.double(), rtol=1e-6, atol=1e-6)
    model.float()
    model(x), model(x)
    assert settled(model[2])
    model[2].weight = torch.nn.Parameter(randn(4, 8))
    assert not settled(model[2])
    model(x), model(x)
    tritonmm.clear_cache()
    assert not settled(model[0]) and not settled(model[2])
    model(x), model(x)
    tritonmm.unswap_linear(model)
    assert type(model[0]) is torch.nn.Linear and type(model[2]) is torch.nn.Linear


class Doubled(torch.nn.Linear):
    def forward(self, input):
        return super().forward(input) * 2


class Scale(torch.nn.Module):
    def forward(self, w):
        return w * 0.5


class Kinded(torch.nn.Linear):
    kinds: dict = {}

    def __init_subclass__(cls, *, kind, **kwargs):
        super().__init_subclass__(**kwargs)
        Kinded.kinds[kind] = cls


class Mine(Kinded, kind="mine"):
    pass


def test_patched_layers_settle_until_unpatched(everything_torch, monkeypatch):
    """Under patch_linear a layer whose weight every GEMM sends to torch settles as a swapped one does: a
    subclass of its own class running nn.Linear's forward (no tritonmm code per call). Subclasses with a
    forward of their own, lazy and parametrized modules do not settle; pickling and deepcopy give the
    module's own class; swap_linear swaps it from its own class; unpatch_linear restores every class."""
    import copy
    import io

    from torch.nn.utils import parametrize

    from tritonmm.modules import linear as tnn

    looked = []
    monkeypatch.setattr(tnn, "_plans_get", lambda k: looked.append(k) or routes.plans.get(k))
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), Doubled(8, 8), torch.nn.Linear(8, 4))
    tied = torch.nn.Linear(8, 4)
    parametrize.register_parametrization(tied, "weight", Scale())
    x = randn(3, 16)
    want, want_tied = model(x).detach(), tied(x[:, :8]).detach()
    settled = lambda m: "_tritonmm_unsettled" in type(m).__dict__  # noqa: E731
    with tritonmm.patch_linear():
        for _ in range(2):
            torch.testing.assert_close(model(x), want, rtol=0, atol=0)
            torch.testing.assert_close(tied(x[:, :8]), want_tied, rtol=0, atol=0)
        assert settled(model[0]) and settled(model[3]) and not settled(model[2]) and not settled(tied)
        assert isinstance(model[0], torch.nn.Linear) and type(model[0]).__name__ == "Linear"
        before = len(looked)
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
        assert len(looked) - before == 1  # only Doubled's call (super().forward: the patched forward) looked
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        for other in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
            assert type(other[0]) is torch.nn.Linear and type(other[2]) is Doubled
            torch.testing.assert_close(other(x), want, rtol=0, atol=0)
        model[3].weight = torch.nn.Parameter(model[3].weight.detach() * 3)
        assert not settled(model[3]) and type(model[3]) is torch.nn.Linear  # replaced: decided again
        want = model(x).detach()
        model(x)
        assert settled(model[3])
        swapped = tritonmm.swap_linear(copy.copy(model))  # (the same modules)
        assert "_tritonmm_base" in type(model[0]).__dict__ and type(model[0]).__dict__["_tritonmm_base"] is torch.nn.Linear
        tritonmm.unswap_linear(swapped)
        model(x), model(x)
        assert settled(model[0])
    assert type(model[0]) is torch.nn.Linear and type(model[3]) is torch.nn.Linear and type(model[2]) is Doubled
    before = len(looked)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    assert len(looked) == before  # unpatched: nn.Linear's own forward
    with tritonmm.patch_linear():
        model(x), model(x)
        assert settled(model[0])
        with tritonmm.force_backend("torch"):  # forcing unsettles
            assert not settled(model[0])
            model(x)
            assert not settled(model[0])


def test_patched_settled_layers_pickle_without_tritonmm_and_stay_out_of_user_classes(everything_torch):
    """A settled layer pickles as its own class (no reference to tritonmm in the bytes); a parametrization
    registered after it settled is built on its own class (removing it gives that class back); a class with
    an __init_subclass__ of its own is never subclassed by tritonmm."""
    import io
    import pickle

    from torch.nn.utils import parametrize

    lin, mine, x = torch.nn.Linear(16, 8), Mine(16, 8), randn(3, 16)
    with tritonmm.patch_linear():
        lin(x), lin(x), mine(x), mine(x)
        assert "_tritonmm_patched" in type(lin).__dict__ and type(mine) is Mine and Kinded.kinds == {"mine": Mine}
        for data in (pickle.dumps(lin), pickle.dumps(lin, protocol=0)):
            assert b"tritonmm" not in data and type(pickle.loads(data)) is torch.nn.Linear
        lin(x), lin(x)
        buf = io.BytesIO()
        torch.save(lin, buf)
        assert b"tritonmm" not in buf.getvalue()
        lin(x), lin(x)
        parametrize.register_parametrization(lin, "weight", Scale())
        assert type(lin).__bases__ == (torch.nn.Linear,)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    parametrize.remove_parametrizations(lin, "weight")
    assert type(lin) is torch.nn.Linear


def test_settled_layer_under_compile(everything_torch):
    model = tritonmm.swap_linear(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU()))
    x = randn(4, 16)
    model(x), model(x)
    assert "_tritonmm_unsettled" in type(model[0]).__dict__
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)


def test_weight_plan_for_a_weight_that_may_reach_triton(monkeypatch):
    """A weight that is not free keeps taking the keyed route (here: to Triton for this M)."""
    monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device: False)
    w, x = randn(8, 16), randn(4, 16)
    with tritonmm.force_backend("torch"):
        tritonmm.linear(x, w)
    assert id(w) not in routes.plans  # forced: no plan made
    tritonmm.linear(x, w)
    assert isinstance(_entries()[-1], routes.Route) and id(w) not in routes.plans  # a Triton route: no plan


def test_weight_free_reads_every_gemm_of_the_weight(monkeypatch):
    """A table entry for the forward (N, K), the input gradient (K, N) or the weight gradient (M = N,
    N = K) of a weight takes it off the plan; entries for other sizes do not; unaligned sizes never plan."""
    from tritonmm.dispatch import tuned

    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_stages": 4, "num_warps": 4}
    win = {"backend": "triton", "kernel": "pointer", "config": cfg, "triton_us": 10.0, "torch_us": 40.0}
    cuda = torch.device("cuda", 0)

    def free_with(key):
        monkeypatch.setattr(tuned, "_table_for", lambda index: {key: win})
        tuned.weight_used.cache_clear()
        return decide.weight_free(512, 1024, torch.bfloat16, cuda)

    assert not free_with("bfloat16:16:512:1024:nt")  # forward
    assert not free_with("float16:128:1024:512:nn")  # input gradient, sibling dtype
    assert not free_with("bfloat16:512:1024:4096:tn")  # weight gradient: M = N, N = K
    assert free_with("bfloat16:16:512:2048:nt")  # another K
    assert free_with("float32:16:512:1024:nt")  # float32 entries do not touch a bfloat16 weight
    assert free_with("bfloat16:16:520:1024:nt")  # another N
    assert not decide.weight_free(512, 1020, torch.bfloat16, cuda)  # K not 16-byte aligned
    tuned.weight_used.cache_clear()


def test_forward_only_plan(monkeypatch):
    """A weight free of tritonmm in its forward only (its gradients may reach Triton): calls without
    autograd are F.linear itself; calls that need gradients take the route, whose Function runs them."""
    monkeypatch.setattr(decide, "torch_everywhere",
                        lambda problems, dtype, device: len(problems) == 1)  # the forward's list: torch
    monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device, backward=True: not backward)
    keyed = []
    orig = routes.linear_keyed
    monkeypatch.setattr(routes, "linear_keyed", lambda *a: keyed.append(1) or orig(*a))
    w, x = randn(8, 16).requires_grad_(), randn(4, 16)
    with torch.no_grad():
        tritonmm.linear(x, w)
        assert routes.plans[id(w)][0] == 1 and id(w) not in routes.free_ptrs
        y = tritonmm.linear(x, w)
    assert len(keyed) == 1 and torch.equal(y, F.linear(x, w))
    z = tritonmm.linear(x, w)  # autograd: not planned
    assert len(keyed) == 2 and type(z.grad_fn).__name__ == "_LinearFunctionBackward"


@pytest.mark.parametrize("entry", ["linear", "swapped"])
def test_sizes_whose_forward_resolved_to_torch_are_served_from_the_plan(entry, monkeypatch):
    """A weight some GEMM of which may reach Triton (plan 0): a 16-bit call without autograd or autocast whose
    forward resolved to torch is F.linear itself at its next call of as many input elements; other sizes,
    calls with autograd, under autocast or forced, of another dtype or with an activation take the route, and a
    moved weight or clear_cache forgets the sizes."""
    monkeypatch.setattr(decide, "torch_everywhere",  # the forward at 12 rows goes to torch, all else to Triton
                        lambda problems, dtype, device: len(problems) == 1 and problems[0][0] == 12)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device, backward=True: False)
    keyed = []
    orig = routes.linear_keyed
    monkeypatch.setattr(routes, "linear_keyed", lambda *a: keyed.append(a[0].shape) or orig(*a))
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=True).to(torch.bfloat16)
    w, b = lin.weight, lin.bias
    call = (lambda x: tritonmm.linear(x, w, b)) if entry == "linear" else tritonmm.swap_linear(lin)
    x, x3 = randn(12, 16, dtype=torch.bfloat16), randn(3, 4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(call(x), F.linear(x, w, b))
        assert routes.plans[id(w)][0] == 0 and routes.plans[id(w)][3] == {12 * 16}
        keyed.clear()
        for a in (x, x3):  # (3, 4, 16): as many elements
            torch.testing.assert_close(call(a), F.linear(a, w, b))
        assert keyed == []
        call(randn(5, 16, dtype=torch.bfloat16))  # Triton at 5 rows
        with torch.autocast("cpu", dtype=torch.bfloat16):
            call(x)
        with tritonmm.force_backend("torch"):
            call(x)
        monkeypatch.setenv("TRITONMM_BACKEND", "torch")
        call(x[:7])  # torch, forced: not kept
        monkeypatch.delenv("TRITONMM_BACKEND")
        call(x[:7])
        assert keyed == [(5, 16), (12, 16), (12, 16), (7, 16), (7, 16)]
        if entry == "linear":
            keyed.clear()
            tritonmm.linear(x, w, b, "relu")
            assert keyed == [(12, 16)]
    keyed.clear()
    out = call(x.clone().requires_grad_())
    assert keyed == [(12, 16)] and out.grad_fn is not None
    with torch.no_grad():
        keyed.clear()
        w.data = w.data.clone()  # moved: a new plan
        call(x)
        assert keyed == [(12, 16)] and routes.plans[id(w)][3] == {12 * 16}
        tritonmm.clear_cache()
        keyed.clear()
        call(x)
        assert keyed == [(12, 16)]
    f32 = torch.nn.Linear(16, 8)
    with torch.no_grad():
        tritonmm.linear(randn(12, 16), f32.weight)
    assert routes.plans[id(f32.weight)][3] == set()  # float32: precision settings take part in the decision


def test_sizes_kept_in_a_plan_serve_only_the_weight_as_planned_and_plain_inputs(monkeypatch):
    """A weight reshaped or reinterpreted in place (same address) or an fx Proxy input is not served from the
    sizes its plan keeps: the route decides, and explain agrees with what runs."""
    import torch.fx

    monkeypatch.setattr(decide, "torch_everywhere",
                        lambda problems, dtype, device: len(problems) == 1 and problems[0][0] == 12
                        and dtype is torch.bfloat16)
    monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device, backward=True: False)
    keyed = []
    orig = routes.linear_keyed
    monkeypatch.setattr(routes, "linear_keyed", lambda *a: keyed.append(a[0].shape) or orig(*a))
    for change in ("t_", "view_dtype"):
        w = randn(8, 16, dtype=torch.bfloat16)
        with torch.no_grad():
            tritonmm.linear(randn(12, 16, dtype=torch.bfloat16), w)
            if change == "t_":
                w.t_()
                x = randn(24, 8, dtype=torch.bfloat16)  # as many elements
            else:
                w.data = w.data.view(torch.float16)
                x = randn(12, 16, dtype=torch.float16)
            keyed.clear()
            assert tritonmm.explain(x, w.t()).backend == "triton"
            torch.testing.assert_close(tritonmm.linear(x, w), F.linear(x, w), rtol=1e-2, atol=1e-2)
            assert keyed == [x.shape], change
    w = randn(8, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        tritonmm.linear(randn(12, 16, dtype=torch.bfloat16), w)

    class Closure(torch.nn.Module):
        def forward(self, a):
            return tritonmm.linear(a, w)

    graph = torch.fx.symbolic_trace(Closure()).graph  # grad mode: a Proxy's requires_grad is not truth-tested
    calls = [n.target for n in graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.tritonmm.linear.default] or [str(c) for c in calls] == ["tritonmm.linear"], calls


def _settled(m) -> bool:
    return "_tritonmm_unsettled" in type(m).__dict__


def test_bound_forward_taken_before_settling_keeps_working(everything_torch):
    """A forward bound while swapped (accelerate keeps ``module._old_forward = module.forward``) runs the
    swapped forward on a settled module: it must not try to settle it again."""
    lin = torch.nn.Linear(8, 4)
    ref = F.linear
    tritonmm.swap_linear(lin)
    old = lin.forward
    x = randn(3, 8)
    for _ in range(4):
        torch.testing.assert_close(old(x), ref(x, lin.weight, lin.bias), rtol=0, atol=0)
    assert _settled(lin)


def test_parametrized_after_swap_never_settles(everything_torch):
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return w * 2

    lin = tritonmm.swap_linear(torch.nn.Linear(8, 4))
    parametrize.register_parametrization(lin, "weight", Double())
    x = randn(3, 8)
    for _ in range(50):
        torch.testing.assert_close(lin(x), F.linear(x, lin.parametrizations.weight.original * 2, lin.bias))
    assert not _settled(lin)


def test_settled_subclass_keeps_its_own_apply_and_setattr(everything_torch):
    class Fp32Bias(torch.nn.Linear):
        seen: list = []

        def _apply(self, fn, recurse=True):
            out = super()._apply(fn, recurse)
            self.bias.data = self.bias.data.float()
            return out

        def __setattr__(self, name, value):
            Fp32Bias.seen.append(name)
            super().__setattr__(name, value)

    lin = tritonmm.swap_linear(Fp32Bias(8, 4))
    x = randn(3, 8)
    lin(x), lin(x)
    assert _settled(lin)
    lin.double()
    assert lin.weight.dtype == torch.float64 and lin.bias.dtype == torch.float32 and not _settled(lin)
    lin.float()
    lin(x), lin(x)
    Fp32Bias.seen.clear()
    lin.weight = torch.nn.Parameter(randn(4, 8))
    assert Fp32Bias.seen == ["weight"] and not _settled(lin)


def test_nothing_settles_while_any_thread_forces(everything_torch):
    import threading

    lin = tritonmm.swap_linear(torch.nn.Linear(8, 4))
    x = randn(3, 8)
    with tritonmm.force_backend("torch"):
        worker = threading.Thread(target=lambda: [lin(x) for _ in range(3)])
        worker.start()
        worker.join()
        assert not _settled(lin)
    lin(x), lin(x)
    assert _settled(lin)


def test_jit_trace_of_a_swapped_model_passes_its_check(everything_torch):
    model = tritonmm.swap_linear(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    x = randn(5, 8)
    traced = torch.jit.trace(model, x)  # check_trace reruns the model: both runs must take one path
    torch.testing.assert_close(traced(x), model(x))
    model(x), model(x)
    torch.jit.trace(model, x)  # settled


def test_compile_fullgraph_of_a_settled_root_layer(everything_torch):
    lin = tritonmm.swap_linear(torch.nn.Linear(8, 4))
    x = randn(3, 8)
    compiled = torch.compile(lin, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), F.linear(x, lin.weight, lin.bias))
    lin(x), lin(x)
    assert _settled(lin)
    torch.testing.assert_close(compiled(x), F.linear(x, lin.weight, lin.bias))


def test_vmap_over_weights_after_a_cached_call(everything_torch):
    from torch.func import functional_call, vmap

    lin = tritonmm.swap_linear(torch.nn.Linear(8, 4))
    x = randn(3, 8)
    W, B = randn(5, 4, 8), randn(5, 4)
    lin(x)  # caches the route and makes a plan
    got = vmap(lambda w, b: functional_call(lin, {"weight": w, "bias": b}, (x,)))(W, B)
    torch.testing.assert_close(got, torch.stack([F.linear(x, w, b) for w, b in zip(W, B)]))
    got = vmap(lambda w: tritonmm.linear(x, w))(W)
    torch.testing.assert_close(got, torch.stack([F.linear(x, w) for w in W]))


@pytest.mark.parametrize("settle", [False, True])
def test_fx_symbolic_trace_of_swapped_layers(settle, monkeypatch):
    """torch.fx records a swapped layer as tritonmm's op (a settled one as F.linear); the traced module
    computes what the model does."""
    if settle:
        monkeypatch.setattr(decide, "torch_everywhere", lambda problems, dtype, device: True)
        monkeypatch.setattr(decide, "weight_free", lambda N, K, dtype, device: True)
    model = tritonmm.swap_linear(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    x = randn(3, 8)
    if settle:
        model(x), model(x)
        assert _settled(model[0])
    gm = torch.fx.symbolic_trace(model)
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert ops == ({F.linear} if settle else {torch.ops.tritonmm.linear})
    torch.testing.assert_close(gm(x), model(x))
    a = randn(3, 8)
    gm = torch.fx.symbolic_trace(lambda a, b: tritonmm.matmul(a, b))
    b = randn(8, 5)
    torch.testing.assert_close(gm(a, b), a @ b)


def test_planned_weight_under_dynamo_export_and_an_environment_setting(everything_torch, monkeypatch):
    """The plan check is skipped under Dynamo (a data pointer would break the graph) and taken in eager;
    non-strict export traces the op or F.linear, both right; a set TRITONMM_BACKEND or TRITONMM_KERNEL,
    even to "" or "auto", bypasses the plan."""
    keyed = []
    orig = routes.linear_keyed
    monkeypatch.setattr(routes, "linear_keyed", lambda *a: keyed.append(1) or orig(*a))
    w, x = randn(8, 16), randn(4, 16)
    tritonmm.linear(x, w)
    assert routes.plans[id(w)][0] == 2 and routes.free_ptrs[id(w)] == w.data_ptr() and len(keyed) == 1

    def fn(x):
        return tritonmm.linear(x, w) + tritonmm.matmul(x, w.t())

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), 2 * F.linear(x, w))
    assert len(keyed) == 1  # no eager route taken while tracing

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = tritonmm.swap_linear(torch.nn.Linear(16, 8))

        def forward(self, x):
            return self.lin(x)

    m = M()
    m(x), m(x)  # planned and settled in eager
    for strict in (True, False):
        ep = torch.export.export(m, (x,), strict=strict)
        torch.testing.assert_close(ep.module()(x), F.linear(x, m.lin.weight, m.lin.bias))
    for name in ("TRITONMM_BACKEND", "TRITONMM_KERNEL"):
        for value in ("", "auto"):
            monkeypatch.setenv(name, value)
            before = len(keyed)
            torch.testing.assert_close(tritonmm.linear(x, w), F.linear(x, w))
            assert len(keyed) == before + 1
            monkeypatch.delenv(name)
    tritonmm.linear(x, w)
    assert len(keyed) == before + 1  # unset again: the plan serves
