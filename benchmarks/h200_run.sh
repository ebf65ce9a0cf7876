#!/usr/bin/env bash
# Steps run on the lent H200 (device tool): bash benchmarks/h200_run.sh STEP... ; results under $OUT.
#   smoke   one call per kernel path, errors printed
#   overhead host cost per call on 16x64x64 bfloat16 (calls per second): torch.matmul, tritonmm.matmul, the op,
#           each forced kernel; a cProfile of the forced TMA path (printed only)
#   tune    python -m tritonmm.tune --merge (bf16 suite) into configs/tuned/<gpu table>.json, copied to $OUT
#   tune_m128 python -m tritonmm.tune --merge on the llama8b M = 128 rows (nn and nt, bf16; where split-K TMA
#           configs apply) into the table, copied to $OUT
#   tune_decode python -m tritonmm.tune --merge on the llama8b M = 1 and 16 rows (TUNE_LAYOUTS, default nn and nt;
#           TUNE_DTYPE, default bfloat16), into the table
#   tune_fp32 python -m tritonmm.tune --merge, float32 (TF32), nn: llama8b M <= 128, odd, wave, tile, square <= 1024
#   tests   pytest -m gpu
#   bench   python -m tritonmm.bench (every dtype, as in the README) -> $OUT/h200.json, $OUT/h200.png
#   inductor python -m tritonmm.bench --compare inductor on BENCH_TAGS (default odd square) -> $OUT/bench_inductor.*
#   linear  python -m tritonmm.bench --linear -> $OUT/bench_linear.json
#   models  examples/real_models.py -> $OUT/real_models.json
#   gpu_all every gpu-marked test -> $OUT/gpu_all.log
#   stress  python -m tritonmm.stress -> $OUT/stress.json
#   dist    examples/train_distributed.py, ddp/fsdp/tp x tritonmm on/off on every GPU -> $OUT/dist_runs.json
#           (DIST_MODES="on off auto": auto = tritonmm on with the dispatcher choosing instead of forced Triton)
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
T() { local s=$1; shift; timeout "$s" "$@"; echo "[exit $? after step: $*]"; }
TABLE=configs/tuned/h200-sm90-132sms-triton3.6.0.json
# tune_subset NAME TIMEOUT FILTER TUNE-ARGS...: python -m tritonmm.tune --merge into $TABLE on the suite
# shapes s for which the Python expression FILTER holds; log $OUT/tune_NAME.log, table copied to $OUT
tune_subset() {
  local name=$1 limit=$2 filter=$3; shift 3
  python3 -c "
import json; d = json.load(open('configs/shapes.json'))
d['shapes'] = [s for s in d['shapes'] if $filter]
json.dump(d, open('/tmp/$name.json', 'w'))"
  T "$limit" python3 -m tritonmm.tune --shapes "/tmp/$name.json" "$@" --merge --out "$TABLE" 2>&1 | tee "$OUT/tune_$name.log"
  cp "$TABLE" "$OUT/"
}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    info) nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
          python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" ;;
    smoke) T 120 python3 - <<'PY'
import torch, tritonmm
from tritonmm.testing import error_report
torch.manual_seed(0)
for dt in (torch.bfloat16, torch.float16, torch.float32):
    for (M, N, K) in ((1000, 1000, 1000), (4095, 4097, 1023), (16, 4096, 4096), (300, 200, 100)):
        a = torch.randn(M, K, device="cuda").to(dt); b = torch.randn(K, N, device="cuda").to(dt)
        for k in ("tma", "pointer", "splitk", "padded"):
            try:
                with tritonmm.force_backend("torch" if k == "padded" else "triton", k):
                    r = error_report(tritonmm.matmul(a, b), a, b)
                print(dt, M, N, K, k, "ok" if r["ok"] else f"FAIL {r}", flush=True)
            except Exception as e:
                print(dt, M, N, K, k, "ERROR", type(e).__name__, str(e)[:300], flush=True)
PY
    ;;
    overhead) T 120 python3 - <<'PY'
import cProfile, pstats, time, torch, tritonmm
a = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16); b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
def rate(f, n=20000):
    for _ in range(1000): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
print("us/call 16x64x64 bf16: torch.matmul %.2f" % rate(lambda: torch.matmul(a, b)))
print("  tritonmm.matmul (auto: %s) %.2f" % (tritonmm.explain(a, b).backend, rate(lambda: tritonmm.matmul(a, b))))
print("  torch.ops.tritonmm.matmul %.2f" % rate(lambda: torch.ops.tritonmm.matmul(a, b)))
for k in ("pointer", "tma", "splitk"):
    with tritonmm.force_backend("triton", k):
        print("  forced triton %s %.2f" % (k, rate(lambda: tritonmm.matmul(a, b))))
with tritonmm.force_backend("triton", "tma"):
    cProfile.run("for _ in range(5000): tritonmm.matmul(a, b)", "/tmp/prof")
pstats.Stats("/tmp/prof").sort_stats("tottime").print_stats(18)
PY
    ;;
    tune) T "${TUNE_TIMEOUT:-330}" python3 -m tritonmm.tune --dtype bfloat16 --time-limit "${TUNE_LIMIT:-280}" \
            --merge --out configs/tuned/ 2>&1 | tee "$OUT/tune.log"
          cp configs/tuned/*.json "$OUT/" ;;
    tune_nt) T 150 python3 -m tritonmm.tune --dtype bfloat16 --tags llama8b --layout nt --time-limit "${TUNE_NT_LIMIT:-110}" --merge \
               --out "$TABLE" 2>&1 | tee "$OUT/tune_nt.log" | tail -3
             cp "$TABLE" "$OUT/tuned_merged.json" ;;
    tune_m128) tune_subset m128 "${TUNE_TIMEOUT:-200}" "s['tag'].startswith('llama8b') and s['M'] == 128" \
                 --dtype bfloat16 --layout nn nt ;;
    tune_decode) tune_subset decode "${TUNE_TIMEOUT:-240}" "s['tag'].startswith('llama8b') and s['M'] in (1, 16)" \
                   --dtype ${TUNE_DTYPE:-bfloat16} --layout ${TUNE_LAYOUTS:-nn nt} --time-limit "${TUNE_LIMIT:-200}" ;;
    tune_fp32) tune_subset fp32 "${TUNE_TIMEOUT:-300}" "(s['tag'].startswith('llama8b') and s['M'] <= 128)
                 or s['tag'] in ('odd', 'wave', 'tile') or (s['tag'] == 'square' and s['M'] <= 1024)" \
                 --dtype float32 --layout nn --time-limit "${TUNE_LIMIT:-240}" ;;
    fuzz) T "${FUZZ_TIMEOUT:-240}" python3 -m pytest -m gpu -q --maxfail=5 --durations=10 -p no:cacheprovider \
            tests/test_fuzz.py 2>&1 | tee "$OUT/gpu_fuzz.log" | tail -30 ;;
    tests) T "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q --maxfail=5 --durations=15 -p no:cacheprovider \
             tests/test_gpu.py tests/test_fuzz.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    bench) T "${BENCH_TIMEOUT:-300}" python3 -m tritonmm.bench --rep 60 --json "$OUT/h200.json" --plot "$OUT/h200.png" ;;
    inductor) T "${BENCH_TIMEOUT:-240}" python3 -m tritonmm.bench --dtype bfloat16 --tags ${BENCH_TAGS:-odd square} \
                --compare inductor --json "$OUT/bench_inductor.json" --plot "$OUT/bench_inductor.png" ;;
    linear) T 200 python3 -m tritonmm.bench --linear --dtype bfloat16 --json "$OUT/bench_linear.json" ;;
    models) TRITONMM_AUTOTUNE=0 T 200 python3 examples/real_models.py --json "$OUT/real_models.json" 2>&1 | tail -40 ;;
    gpu_all) T "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q --maxfail=10 --durations=20 -p no:cacheprovider \
               tests/ 2>&1 | tee "$OUT/gpu_all.log" | tail -60 ;;
    reliability) T "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q --maxfail=10 --durations=20 -p no:cacheprovider \
               tests/test_gpu_reliability.py 2>&1 | tee "$OUT/gpu_reliability.log" | tail -60 ;;
    stress) T "${STRESS_TIMEOUT:-240}" python3 -m tritonmm.stress ${STRESS_ARGS:-} --json "$OUT/stress.json" 2>&1 \
              | tee "$OUT/stress.log" | tail -20 ;;
    dist) n=$(nvidia-smi -L | wc -l); mkdir -p /tmp/dist
          for par in ${DIST_PARALLEL:-ddp fsdp tp}; do for on in ${DIST_MODES:-on off}; do
            flags="--tritonmm $on"; [ "$on" = auto ] && flags="--tritonmm on --backend auto"
            T 200 torchrun --nproc-per-node="$n" --master-port=29$((RANDOM % 900 + 100)) examples/train_distributed.py \
              --parallel "$par" $flags --steps "${DIST_STEPS:-50}" --json "/tmp/dist/$par-$on.json" 2>&1 \
              | grep -v "^W\|UserWarning\|warnings.warn" | tail -4
          done; done 2>&1 | tee "$OUT/dist.log"
          python3 - "$OUT/dist_runs.json" <<'PY'
import glob, json, sys
runs = {p.split("/")[-1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/dist/*.json"))}
json.dump(runs, open(sys.argv[1], "w"), indent=1)
for par in ("ddp", "fsdp", "tp"):
    on, off = runs.get(f"{par}-on"), runs.get(f"{par}-off")
    if on and off:
        d = [abs(x - y) for x, y in zip(on["losses"], off["losses"])]
        r = [abs(x - y) / abs(y) for x, y in zip(on["losses"], off["losses"])]
        print(f"{par}: steps {len(d)}, loss first {off['losses'][0]:.4f} last on {on['losses'][-1]:.4f} off "
              f"{off['losses'][-1]:.4f}, max |diff| {max(d):.4g}, max rel {max(r):.3g}, "
              f"median step on {on['median_step_ms']:.1f} ms off {off['median_step_ms']:.1f} ms, "
              f"sum|w| on {on['weights_abs_sum']:.12g} off {off['weights_abs_sum']:.12g}, paths {on['gemm_paths_rank0']}")
PY
          ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date +%T)"
