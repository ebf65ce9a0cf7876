"""Bad input: the exception type torch.matmul / F.linear raise, with a message naming both sides."""

import pytest
import torch
import torch.nn.functional as F

import tritonmm
from tritonmm.core.reference import randn


def _same_error(fn_tri, fn_ref):
    with pytest.raises(Exception) as ref:
        fn_ref()
    with pytest.raises(type(ref.value)) as tri:
        fn_tri()
    return str(tri.value)


@pytest.mark.parametrize(
    "sa,sb",
    [((3, 4), (5, 6)), ((4,), (5,)), ((2, 3, 4), (5, 6)), ((3, 4), (2, 5, 6)), ((7,), (8, 2)), ((2, 3), (4,))],
    ids=str,
)
def test_inner_dim_mismatch(sa, sb):
    a, b = randn(*sa), randn(*sb)
    msg = _same_error(lambda: tritonmm.matmul(a, b), lambda: torch.matmul(a, b))
    assert str(tuple(sa)) in msg and str(tuple(sb)) in msg


def test_batch_not_broadcastable():
    a, b = randn(2, 3, 4), randn(3, 4, 5)
    msg = _same_error(lambda: tritonmm.matmul(a, b), lambda: torch.matmul(a, b))
    assert "(2, 3, 4)" in msg and "(3, 4, 5)" in msg


def test_zero_dim():
    a, b = torch.tensor(2.0), randn(3)
    msg = _same_error(lambda: tritonmm.matmul(a, b), lambda: torch.matmul(a, b))
    assert "0D" in msg


@pytest.mark.parametrize("da,db", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                   (torch.float32, torch.float64)])
def test_mixed_dtypes_no_promotion(da, db):
    a, b = randn(3, 4, dtype=da), randn(4, 5, dtype=db)
    msg = _same_error(lambda: tritonmm.matmul(a, b), lambda: torch.matmul(a, b))
    assert str(da) in msg and str(db) in msg


def test_a_meta_operand_mixes_with_another_device_as_in_torch():
    """torch.matmul and F.linear take a meta operand beside a CPU one (devices that differ otherwise raise:
    ``test_gpu_reliability.py``); tritonmm answers with torch's shape and device."""
    m, c = randn(5, 3, device="meta"), randn(4, 3)
    pairs = [(lambda: tritonmm.linear(m, c), lambda: F.linear(m, c)),
             (lambda: tritonmm.linear(c, m), lambda: F.linear(c, m)),
             (lambda: tritonmm.matmul(m, c.t()), lambda: torch.matmul(m, c.t())),
             (lambda: tritonmm.matmul(c, m.t()), lambda: torch.matmul(c, m.t()))]
    for got, want in ((t(), r()) for t, r in pairs):
        assert (got.shape, got.device) == (want.shape, want.device)


@pytest.mark.parametrize("args", [(1, "t"), ("t", 2.0), ([1.0], "t")], ids=str)
def test_non_tensor_arguments(args):
    t = randn(3, 3)
    a, b = (t if x == "t" else x for x in args)
    _same_error(lambda: tritonmm.matmul(a, b), lambda: torch.matmul(a, b))


def test_linear_errors():
    x, w, b = randn(4, 8), randn(6, 8), randn(6)
    _same_error(lambda: tritonmm.linear(x, randn(6, 7)), lambda: F.linear(x, randn(6, 7)))
    _same_error(lambda: tritonmm.linear(x, w.half()), lambda: F.linear(x, w.half()))
    _same_error(lambda: tritonmm.linear(x, w, b.double()), lambda: F.linear(x, w, b.double()))  # (F.linear's own)
    with pytest.raises(RuntimeError, match="bias"):
        tritonmm.linear(x, w, randn(5))
    with pytest.raises(ValueError, match="activation"):
        tritonmm.linear(x, w, b, activation="tanh")
    with pytest.raises(TypeError):
        tritonmm.linear(x, 3)


def test_inputs_untouched_on_error():
    a, b = randn(3, 4), randn(5, 6)
    a0, b0 = a.clone(), b.clone()
    with pytest.raises(RuntimeError):
        tritonmm.matmul(a, b)
    assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.parametrize("var,value", [("TRITONMM_BACKEND", "fast"), ("TRITONMM_KERNEL", "wgmma"),
                                       ("TRITONMM_AUTOTUNE", "maybe")])
def test_bad_environment_values_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    a, b = randn(8, 8), randn(8, 8)
    with pytest.raises(ValueError, match=var):
        if var == "TRITONMM_AUTOTUNE":
            from tritonmm.core.env import autotune_enabled

            autotune_enabled()
        else:
            tritonmm.explain(a, b)


def test_force_backend_rejects_unknown():
    with pytest.raises(ValueError):
        with tritonmm.force_backend("numpy"):
            pass
    with pytest.raises(ValueError):
        with tritonmm.force_backend("triton", "wgmma"):
            pass


@pytest.mark.parametrize("value", ["bogus", " 1", "2"])
def test_triton_interpret_value_triton_would_not_read_is_an_error(monkeypatch, value):
    """Triton reads such a value as off, so tritonmm would ask it to interpret a CPU kernel it then compiles."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    tritonmm.clear_cache()
    a, b = randn(8, 8), randn(8, 8)
    try:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            tritonmm.explain(a, b)
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            tritonmm.matmul(a, b)
    finally:
        monkeypatch.undo()
        tritonmm.clear_cache()


@pytest.mark.parametrize("value,on", [("YES", True), ("y", True), ("On", True), ("n", False), ("", False)])
def test_triton_interpret_reads_as_triton_does(monkeypatch, value, on):
    from tritonmm.core.env import interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is on


@pytest.mark.parametrize("dtype,shape", [(torch.float64, (4, 4)), (torch.float32, (0, 4))], ids=["float64", "empty"])
def test_bad_environment_value_reported_for_every_call(monkeypatch, dtype, shape):
    """Also where the variable would not matter (torch-served dtype, empty problem): a typo never hides."""
    monkeypatch.setenv("TRITONMM_BACKEND", "tirton")
    a, b = randn(*shape, dtype=dtype), randn(shape[1], 3, dtype=dtype)
    with pytest.raises(ValueError, match="TRITONMM_BACKEND"):
        tritonmm.matmul(a, b)


@pytest.mark.parametrize("call", ["swap_linear", "unswap_linear", "fuse", "unfuse"])
@pytest.mark.parametrize("model", [None, "model", torch.nn.Linear], ids=["None", "str", "class"])
def test_module_functions_name_an_argument_that_is_not_a_module(call, model):
    with pytest.raises(TypeError, match=rf"tritonmm\.{call}\(\): argument 'model' must be an nn\.Module"):
        getattr(tritonmm, call)(model)


def test_unknown_activation_has_one_message_and_order():
    """linear, TritonLinear, the op and gated_linear name the activation and list the known ones in one order (the
    gated linear takes all but "none")."""
    x, w = randn(2, 8), randn(4, 8)
    calls = {"tritonmm.linear": lambda: tritonmm.linear(x, w, None, "swish"),
             "op": lambda: torch.ops.tritonmm.linear(x, w, None, "swish"),
             "TritonLinear": lambda: tritonmm.TritonLinear(8, 4, activation="swish"),
             "tritonmm.gated_linear": lambda: tritonmm.gated_linear(x, w, w, activation="swish")}
    messages = {}
    for name, call in calls.items():
        with pytest.raises(ValueError) as err:
            call()
        messages[name] = str(err.value)
    linear = "unknown activation 'swish'; expected one of ('none', 'silu', 'gelu', 'gelu_tanh', 'relu')"
    assert messages["tritonmm.linear"] == messages["op"] == f"tritonmm.linear: {linear}"
    assert messages["TritonLinear"] == f"TritonLinear: {linear}"
    assert messages["tritonmm.gated_linear"] == f"tritonmm.gated_linear: {linear}".replace("'none', ", "")
