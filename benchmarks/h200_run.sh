#!/usr/bin/env bash
# Steps run on an H200 from the repository root: bash benchmarks/h200_run.sh STEP... ; results under $OUT
# (default /tmp/out).
#   info    GPU, clocks, torch/triton versions
#   tests   pytest -m gpu on TESTS (default tests/test_gpu.py) -> $OUT/gpu_tests.log
#   gpu_all every gpu-marked test -> $OUT/gpu_all.log (about 12 minutes on the H200: split across device calls with
#           the tests step: TESTS="tests/test_gpu.py" (about 5 minutes), TESTS="tests/test_gated_gpu.py
#           tests/test_qkv_gpu.py tests/test_fuzz.py" (about 3), TESTS="tests/test_bench.py tests/test_capture.py
#           tests/test_copy.py tests/test_first_sight.py tests/test_padded.py tests/test_gpu_reliability.py" (about 4))
#   model   python -m tritonmm.bench --model -> $OUT/h200_model.json (MODEL_ARGS adds flags, e.g. one config per
#           device call: --model-configs small --model-phases eager train compile, and the per-call rows in a call of
#           their own: --model-phases per_call; --unfolded adds fuse without the RMSNorm folds in the eager and CUDA-graph
#           phases; the JSON is rewritten after each phase, so a run cut short keeps them)
#   mlp     python -m tritonmm.bench --mlp -> $OUT/h200_mlp.json (MLP_ARGS adds flags)
#   first_sight  python -m tritonmm.bench --first-sight -> $OUT/h200_first_sight.json
#   suite   python -m tritonmm.bench on SUITE_TAGS (default: every shape) -> $OUT/h200.json, $OUT/h200.png
#   qkv     python3 benchmarks/diagnostics/h200_qkv.py -> $OUT/h200_qkv.json
#   host    benchmarks/diagnostics/h200_host.py: per-call host cost and a profile (printed)
#   gpu_par every gpu-marked test in three groups run side by side on the one GPU -> $OUT/gpu_par_*.log (about 6.5
#           minutes on an H100)
#   prefill_ab  benchmarks/diagnostics/prefill_packed_ab.py -> $OUT/prefill_packed_ab.json
#   gluon   benchmarks/diagnostics/gluon_ws_gemm.py: warp-specialized Gluon GEMMs checked, then timed against cuBLAS
#           -> $OUT/gluon_ws_gemm.json
#   host_parts  benchmarks/diagnostics/mlp_host_parts.py: a fused MLP call's host time by part, in a prefill and
#           alone -> $OUT/mlp_host_parts.json
#   compile_swap  benchmarks/diagnostics/compile_swap_probe.py: compiled prefill, swap_linear against off, with the
#           last position's logits and with all -> $OUT/compile_swap_probe.json
#   decode_ab  benchmarks/diagnostics/decode_path_ab.py: eager decode and 1 x 512 prefill, fuse as shipped and with
#           the torch expression up to 16 rows -> $OUT/decode_path_ab.json
#   decode_sweep  benchmarks/diagnostics/decode_gemm_sweep.py: decode-sized GEMMs (1 and 16 rows) over a wide config
#           grid of the pointer, split-K and TMA kernels (swap-AB too) against cuBLAS -> $OUT/decode_gemm_sweep.json
#   replay_kernels  benchmarks/diagnostics/replay_kernels.py: a CUDA-graph replay of the 8B-sized forward (1 x 16 and
#           1 x 128), off against fuse: wall time and each kernel's time -> $OUT/replay_kernels.json
#   norm_prologue  benchmarks/diagnostics/norm_prologue_gemm.py: an RMSNorm folded into the GEMM after it, at decode
#           sizes, against transformers' norm + cuBLAS, in CUDA graphs -> $OUT/norm_prologue_gemm.json
#   static_kernels  benchmarks/diagnostics/static_decode_kernels.py: the compiled static-cache decode, off against fuse
#           (also with q/k/v traced as one GEMM, and that with the lm_head swapped), wall time and each kernel's time
#           per token -> $OUT/static_decode_kernels.json
#   mlp_parts  benchmarks/diagnostics/mlp_forward_parts.py: a LlamaMLP forward's time alone, back to back, on the host
#           and per kernel -> $OUT/mlp_forward_parts.json
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
T() { local s=$1; shift; timeout "$s" "$@"; echo "[exit $? after step: $*]"; }
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    info) nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
          python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" ;;
    host) T 90 python3 benchmarks/diagnostics/h200_host.py ;;
    gpu_par) for g in "tests/test_gpu.py" "tests/test_gpu_reliability.py tests/test_fuzz.py" \
                "tests/test_gated_gpu.py tests/test_qkv_gpu.py tests/test_bench.py tests/test_capture.py tests/test_copy.py tests/test_first_sight.py tests/test_padded.py tests/test_norm_fold.py tests/test_qkv_fold.py"; do
               n=$(basename "${g%% *}" .py)
               T "${TESTS_TIMEOUT:-520}" python3 -m pytest -m gpu -q -p no:cacheprovider $g > "$OUT/gpu_par_$n.log" 2>&1 &
             done; wait; tail -n 3 "$OUT"/gpu_par_*.log ;;
    gluon) T "${GLUON_TIMEOUT:-500}" python3 benchmarks/diagnostics/gluon_ws_gemm.py 2>&1 | tail -30 ;;
    host_parts) T "${PARTS_TIMEOUT:-200}" python3 benchmarks/diagnostics/mlp_host_parts.py 2>&1 | grep -v "Warning\|warn(" ;;
    compile_swap) T "${PROBE_TIMEOUT:-300}" python3 benchmarks/diagnostics/compile_swap_probe.py 2>&1 | grep -v "Warning\|warn(" | tail -80 ;;
    decode_ab) T "${AB_TIMEOUT:-300}" python3 benchmarks/diagnostics/decode_path_ab.py ${AB_ARGS:-} 2>&1 | grep -v "Warning\|warn(" | tail -10 ;;
    decode_sweep) T "${SWEEP_TIMEOUT:-300}" python3 benchmarks/diagnostics/decode_gemm_sweep.py "${SWEEP_SECONDS:-250}" \
             2>&1 | grep -v "Warning\|warn(" ;;
    replay_kernels) T "${REPLAY_TIMEOUT:-240}" python3 benchmarks/diagnostics/replay_kernels.py ${REPLAY_ARGS:-} 2>&1 \
             | grep -v "Warning\|warn(" ;;
    norm_prologue) T "${NORM_TIMEOUT:-240}" python3 benchmarks/diagnostics/norm_prologue_gemm.py 2>&1 | tail -20 ;;
    static_kernels) T "${STATIC_TIMEOUT:-300}" python3 benchmarks/diagnostics/static_decode_kernels.py ${STATIC_ARGS:-} \
             2>&1 | grep -v "Warning\|warn(" ;;
    mlp_parts) T "${PARTS_TIMEOUT:-300}" python3 benchmarks/diagnostics/mlp_forward_parts.py 2>&1 | grep -v "Warning\|warn(" ;;
    prefill_ab) T "${AB_TIMEOUT:-400}" python3 benchmarks/diagnostics/prefill_packed_ab.py ${AB_ARGS:-} 2>&1 | tail -10 ;;
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
    qkv) T "${QKV_TIMEOUT:-400}" python3 benchmarks/diagnostics/h200_qkv.py 2>&1 | tail -40 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date +%T)"
