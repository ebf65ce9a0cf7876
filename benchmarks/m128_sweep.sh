#!/usr/bin/env bash
# Probe: extra TMA configs (split-K and narrow-N) on the llama8b M = 128 rows, measured by
# python -m tritonmm.tune against torch.matmul, without touching the shipped candidates or table.
#   EXTRA='[[BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps, EPILOGUE_SUBTILE, SPLIT_K], ...]'
#   bash benchmarks/m128_sweep.sh   -> $OUT/m128_sweep.json (a tuned table whose measurements list every config)
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
tmp=$(mktemp -d)
cp -r configs/. "$tmp/"
python3 - "$tmp" <<'PY'
import json, os, sys
d = json.load(open("configs/candidates.json"))
d["tma"]["configs"] += json.loads(os.environ["EXTRA"])
json.dump(d, open(os.path.join(sys.argv[1], "candidates.json"), "w"))
s = json.load(open("configs/shapes.json"))
s["shapes"] = [x for x in s["shapes"] if x["tag"].startswith("llama8b") and x["M"] == 128]
json.dump(s, open(os.path.join(sys.argv[1], "m128.json"), "w"))
PY
TRITONMM_CONFIG_DIR="$tmp" timeout "${SWEEP_TIMEOUT:-240}" python3 -m tritonmm.tune --shapes "$tmp/m128.json" \
  --kernels tma --layout ${LAYOUTS:-nn} --pair-rounds 0 --out "$OUT/m128_sweep.json" 2>&1 | tail -12
