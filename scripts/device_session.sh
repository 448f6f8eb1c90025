#!/usr/bin/env bash
# One device-tool call that builds, checks and times (each stage well under the 10-minute limit):
#   bash scripts/device_session.sh check     install, then scripts/gpu_check.py (every rule file, lean decode + graphs)
#   bash scripts/device_session.sh decode    vismmoe_kt/apps/measure/decode_bench.py: stock transformers vs lean eager/graphed/offloaded
#   bash scripts/device_session.sh all       both
# Results go to $OUT (the device tool brings them back). kt-kernel comes from a slim copy carried in
# .scratch/kt (../shared/scripts/slim-kt-kernel.sh .scratch/kt), if present.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vismmoe-out}
mkdir -p "$OUT"
export PYTHONPATH=.:.scratch/kt${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
stage=${1:-all}
if [[ $stage == check || $stage == all ]]; then
  timeout 240 python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" | tee "$OUT/gpu_check.txt"
fi
if [[ $stage == decode || $stage == all ]]; then
  timeout 480 python3 -m vismmoe_kt.apps.measure.decode_bench --out "$OUT" --layers 48 --reps 3 --decode-tokens 32 --profile \
    --configs hf lean-eager lean-graphs lean:16GiB lean:32GiB | tee "$OUT/decode_bench.txt"
fi
