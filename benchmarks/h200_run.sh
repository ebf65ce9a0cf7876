#!/usr/bin/env bash
# Steps run on an H200 from the repository root: bash benchmarks/h200_run.sh STEP... ; results under $OUT
# (default /tmp/out).
#   info    GPU, clocks, torch/triton versions
#   host    per-call cost of the entry points and of the Triton route's layers on this host, and a profile (printed)
#   tests   pytest -m gpu on TESTS (default tests/test_gpu.py) -> $OUT/gpu_tests.log
#   gpu_all every gpu-marked test -> $OUT/gpu_all.log (about 12 minutes on the H200: split across device calls with
#           the tests step: TESTS="tests/test_gpu.py" (about 5 minutes), TESTS="tests/test_gated_gpu.py
#           tests/test_qkv_gpu.py tests/test_fuzz.py" (about 3), TESTS="tests/test_bench.py tests/test_capture.py
#           tests/test_copy.py tests/test_first_sight.py tests/test_padded.py tests/test_gpu_reliability.py" (about 4))
#   model   python -m tritonmm.bench --model -> $OUT/h200_model.json (MODEL_ARGS adds flags, e.g. one config per
#           device call: --model-configs small --model-phases eager train compile, and the per-call rows in a call of
#           their own: --model-phases per_call; the JSON is rewritten after each phase, so a run cut short keeps them)
#   mlp     python -m tritonmm.bench --mlp -> $OUT/h200_mlp.json (MLP_ARGS adds flags)
#   first_sight  python -m tritonmm.bench --first-sight -> $OUT/h200_first_sight.json
#   suite   python -m tritonmm.bench on SUITE_TAGS (default: every shape) -> $OUT/h200.json, $OUT/h200.png
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
T() { local s=$1; shift; timeout "$s" "$@"; echo "[exit $? after step: $*]"; }
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    info) nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
          python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" ;;
    host) T 90 python3 - <<'PY'
import copy, cProfile, pstats, timeit, torch, torch.nn.functional as F, tritonmm
from tritonmm import routes
from tritonmm.kernels import launchers
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
lin = torch.nn.Linear(2048, 5632, device="cuda", dtype=torch.bfloat16); sw = tritonmm.swap_linear(copy.deepcopy(lin))
w = lin.weight.detach(); b = lin.bias.detach()
a = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16); bb = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
g = dict(F=F, torch=torch, tritonmm=tritonmm, lin=lin, sw=sw, x=x, w=w, b=b, a=a, bb=bb)
def t(s, n=20000):
    r = sorted(timeit.timeit(s, globals=g, number=n) / n * 1e9 for _ in range(9)); return r[4]
from tritonmm import api
from tritonmm._env import raw_env
tritonmm.linear(x, w, b); tritonmm.matmul(x, w.t())
g.update(api=api, raw_env=raw_env, wt=w.t(), plan=routes.plans.get(id(w)))
print("plan", g["plan"] and g["plan"][0])
from tritonmm import dispatch, tuned
print("weight_free fwd+bwd / fwd:", dispatch.weight_free(5632, 2048, w.dtype, w.device),
      dispatch.weight_free(5632, 2048, w.dtype, w.device, False))
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
PY
    ;;
    tests) T "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q --maxfail=5 --durations=15 -p no:cacheprovider \
             ${TESTS:-tests/test_gpu.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    gpu_all) T "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q --maxfail=10 --durations=20 -p no:cacheprovider \
               tests/ 2>&1 | tee "$OUT/gpu_all.log" | tail -60 ;;
    model) T "${MODEL_TIMEOUT:-420}" python3 -m tritonmm.bench --model ${MODEL_ARGS:-} --json "$OUT/h200_model.json" \
             2>&1 | grep -v "Warning\|warn(" | tee "$OUT/model.log" | tail -60 ;;
    mlp) T "${MLP_TIMEOUT:-420}" python3 -m tritonmm.bench --mlp ${MLP_ARGS:-} --json "$OUT/h200_mlp.json" \
             2>&1 | grep -v "Warning\|warn(" | tee "$OUT/mlp.log" | tail -40 ;;
    first_sight) T "${FS_TIMEOUT:-400}" python3 -m tritonmm.bench --first-sight --json "$OUT/h200_first_sight.json" \
             2>&1 | tee "$OUT/first_sight.log" | tail -130 ;;
    suite) T "${BENCH_TIMEOUT:-300}" python3 -m tritonmm.bench --rep 60 ${SUITE_TAGS:+--tags $SUITE_TAGS} \
             --json "$OUT/h200.json" --plot "$OUT/h200.png" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date +%T)"
