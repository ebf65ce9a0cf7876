"""torch.library integration: opcheck, FakeTensor, torch.compile(fullgraph=True) static and dynamic, torch.export."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tritonmm
from tritonmm.core.reference import randn

pytestmark = pytest.mark.interpreter

MATMUL_INPUTS = [
    ((17, 23), (23, 9)),
    ((23,), (23, 9)),
    ((2, 17, 23), (23,)),
    ((2, 1, 17, 23), (3, 23, 9)),
    ((0, 23), (23, 9)),
    ((17, 0), (0, 9)),
]


@pytest.mark.parametrize("kernel", ["pointer", "tma", "cublas"])
@pytest.mark.parametrize("shapes", MATMUL_INPUTS + [((3, 2, 6, 5), (2, 3, 1, 5, 7))], ids=str)  # + three levels
def test_opcheck_matmul(shapes, kernel):
    a = randn(*shapes[0]).requires_grad_()
    b = randn(*shapes[1]).requires_grad_()
    with tritonmm.force_backend(*(("torch",) if kernel == "cublas" else ("triton", kernel))):
        torch.library.opcheck(torch.ops.tritonmm.matmul.default, (a, b))


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_linear(activation, bias):
    x = randn(3, 5, 24).requires_grad_()
    w = randn(12, 24).requires_grad_()
    b = randn(12).requires_grad_() if bias else None
    with tritonmm.force_backend("triton"):
        torch.library.opcheck(torch.ops.tritonmm.linear.default, (x, w, b, activation))


def test_fake_tensor_shapes_and_errors():
    with FakeTensorMode():
        a, b = torch.empty(4, 1, 7, 5), torch.empty(3, 5, 6)
        out = torch.ops.tritonmm.matmul(a, b)
        assert out.shape == (4, 3, 7, 6)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            torch.ops.tritonmm.matmul(a, torch.empty(6, 2))
        y = torch.ops.tritonmm.linear(torch.empty(2, 3, 8), torch.empty(5, 8), None, "gelu")
        assert y.shape == (2, 3, 5)


def _model(x, w, b):
    h = tritonmm.matmul(x, w)
    return tritonmm.linear(torch.relu(h), b.t(), None, "silu").sum(-1)


def _count_graph_breaks(fn, *args, **kw):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_break_count


def test_no_graph_breaks():
    x, w, b = randn(16, 24), randn(24, 32), randn(32, 8)
    assert _count_graph_breaks(_model, x, w, b) == 0


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(dynamic, backend):
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True, dynamic=dynamic, backend=backend)
    with tritonmm.force_backend("triton"):
        for M in (16, 21, 33):  # new sizes: recompiles (static) or reuses the dynamic graph
            x, w, b = randn(M, 24), randn(24, 32), randn(32, 8)
            torch.testing.assert_close(compiled(x, w, b), _model(x, w, b), rtol=1e-5, atol=1e-5)


def test_compile_backward():
    torch._dynamo.reset()
    x = randn(20, 24).requires_grad_()
    w = randn(24, 32).requires_grad_()
    b = randn(32, 8).requires_grad_()
    compiled = torch.compile(_model, fullgraph=True, dynamic=True, backend="aot_eager")
    with tritonmm.force_backend("triton"):
        compiled(x, w, b).sum().backward()
        grads = [t.grad.clone() for t in (x, w, b)]
        for t in (x, w, b):
            t.grad = None
        _model(x, w, b).sum().backward()
    for g, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)


def test_export():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(randn(12, 24))

        def forward(self, x):
            return tritonmm.linear(x, self.w, None, "gelu") @ torch.ones(12, 3)

    x, m = randn(5, 24), M()
    ep = torch.export.export(m, (x,))
    assert any("tritonmm.linear" in str(n.target) for n in ep.graph.nodes)
    with tritonmm.force_backend("triton"):
        torch.testing.assert_close(ep.module()(x), m(x))
        torch.testing.assert_close(m(x), torch.nn.functional.gelu(x @ m.w.t()) @ torch.ones(12, 3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_compiled_cublas_decision_on_rows_that_do_not_fold_is_one_mm(op):
    """A cuBLAS decision traced for a 3-D input whose rows do not fold as a view (the last position of each
    sequence, as a prefill's logits take it) runs one mm on the rows (a copy), not a bmm against the broadcast
    weight (a batched GEMV per sequence on cuBLAS); values against float64."""
    from torch._dynamo.backends.common import aot_autograd

    x, w = randn(4, 9, 24)[:, -1:], randn(12, 24)
    assert not x.is_contiguous()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    def fn(x, w):
        return tritonmm.linear(x, w) if op == "linear" else tritonmm.matmul(x, w.t())

    torch._dynamo.reset()
    with tritonmm.force_backend("torch"):
        out = torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(x, w)
    torch.testing.assert_close(out, (x.double() @ w.double().t()).to(out.dtype), rtol=1e-5, atol=1e-5)
    assert out.shape == (4, 1, 12)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert not any("bmm" in t for t in targets), targets
    assert any(t.startswith("aten.mm") or t.startswith("aten.addmm") for t in targets), targets
