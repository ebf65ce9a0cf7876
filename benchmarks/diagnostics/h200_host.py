"""Per-call host cost of the entry points and of the Triton route's layers on this host, and a profile
(printed). Usage, on a GPU: PYTHONPATH=$PWD python3 benchmarks/diagnostics/h200_host.py"""
import copy, cProfile, pstats, timeit, torch, torch.nn.functional as F, tritonmm
from tritonmm.ops import routes
from tritonmm.kernels import launchers
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
lin = torch.nn.Linear(2048, 5632, device="cuda", dtype=torch.bfloat16); sw = tritonmm.swap_linear(copy.deepcopy(lin))
w = lin.weight.detach(); b = lin.bias.detach()
a = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16); bb = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
g = dict(F=F, torch=torch, tritonmm=tritonmm, lin=lin, sw=sw, x=x, w=w, b=b, a=a, bb=bb)
def t(s, n=20000):
    r = sorted(timeit.timeit(s, globals=g, number=n) / n * 1e9 for _ in range(9)); return r[4]
from tritonmm import api
from tritonmm.core.env import raw_env
tritonmm.linear(x, w, b); tritonmm.matmul(x, w.t())
g.update(api=api, raw_env=raw_env, wt=w.t(), plan=routes.plans.get(id(w)))
print("plan", g["plan"] and g["plan"][0])
from tritonmm.dispatch import decide, tuned
print("weight_free fwd+bwd / fwd:", decide.weight_free(5632, 2048, w.dtype, w.device),
      decide.weight_free(5632, 2048, w.dtype, w.device, False))
print("table entries taking a Triton kernel or the padded path:",
      sorted(k for k, e in tuned._table_for(0).items() if e.get("kernel") == "padded" or e.get("backend") == "triton"))
for s in ["pass", "api._dynamo_compiling()", "api._is_compiling()", "api._plans_get(id(w))", "api._forced()",
          "api._BACKEND not in raw_env", "w.data_ptr()", "api._grad_enabled()", "x.requires_grad"]:
    print(f"{t(s, 100000):9.1f} ns  {s}")
for mode in ("no_grad", "grad"):
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        for s in ["F.linear(x, w, b)", "tritonmm.linear(x, w, b)", "torch.matmul(x, wt)", "tritonmm.matmul(x, wt)"]:
            print(f"{t(s):9.1f} ns  {s}  [{mode}]")
g.update(wp=lin.weight, bp=lin.bias)  # the Parameters, as the model benchmark's per-call rows pass them
with torch.enable_grad():
    tritonmm.linear(x, lin.weight, lin.bias)
    print("plan of lin.weight:", routes.plans.get(id(lin.weight)), "free:", api._free_get(id(lin.weight)))
    for s in ["F.linear(x, wp, bp)", "tritonmm.linear(x, wp, bp)", "wp.data_ptr()", "api._free_get(id(wp))",
              "lin(x)", "sw(x)"]:
        print(f"{t(s):9.1f} ns  {s}  [grad, Parameters]")
with torch.no_grad():
    tritonmm.linear(x, w, b); sw(x)
    for s in ["lin(x)", "sw(x)", "torch.matmul(a, bb)"]:
        print(f"{t(s):9.1f} ns  {s}")
    with tritonmm.force_backend("triton", "pointer"):
        tritonmm.matmul(a, bb)
        route = next(v for v in routes._cache.values() if isinstance(v, routes.Route))
        prepared = next(iter(route.runs.values()))
        launch = prepared.run.__closure__ and None
        g.update(route=route, prepared=prepared)
        g["key"] = routes._direct_key("matmul", a, bb, None, "none")
        for s in ["tritonmm.matmul(a, bb)", "routes.matmul_keyed(a, bb)", "route(a, bb)", "prepared.run(a, bb, None)",
                  'routes._direct_key("matmul", a, bb, None, "none")', "routes.direct.get(key)"]:
            g["routes"] = routes
            print(f"{t(s):9.1f} ns  {s}")
        cProfile.run("for _ in range(20000): tritonmm.matmul(a, bb)", "/tmp/prof")
    cfg = tritonmm.explain(a, bb).config
pstats.Stats("/tmp/prof").sort_stats("tottime").print_stats(14)
