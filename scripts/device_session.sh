#!/usr/bin/env bash
# One device-tool call per line below (each stage well under the 10-minute limit of one command):
#   bash scripts/device_session.sh check            install, then scripts/gpu_check.py (every rule file, lean decode + graphs)
#   bash scripts/device_session.sh bench PART...    scripts/bench_h200.sh PART (synthetic routing), one after another
#   bash scripts/device_session.sh decode           the decode benchmark (stock transformers vs lean eager/graphed/offloaded)
#   bash scripts/device_session.sh check bench 1    stages combine
# Results go to $OUT (the device tool brings them back). kt-kernel comes from a slim copy carried in
# .scratch/kt (../shared/scripts/slim-kt-kernel.sh .scratch/kt), if present.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vismmoe-out}
mkdir -p "$OUT"
export PYTHONPATH=.:.scratch/kt${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
while [[ $# -gt 0 ]]; do
  case $1 in
    check) timeout 240 python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" | tee "$OUT/gpu_check.txt"; shift ;;
    decode) timeout 480 python3 -m vismmoe_kt.apps.measure.decode_bench --out "$OUT" --layers 48 --reps 3 \
              --decode-tokens 32 --profile --configs hf lean-eager lean-graphs lean:16GiB lean:32GiB | tee "$OUT/decode_bench.txt"
            shift ;;
    bench) shift
           while [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; do
             bash scripts/bench_h200.sh "$1" "$OUT" 2>"$OUT/bench_part$1.err" | tee "$OUT/bench_part$1.txt"
             tail -3 "$OUT/bench_part$1.err"
             shift
           done ;;
    *) echo "unknown stage $1 (check, decode, bench PART...)" >&2; exit 2 ;;
  esac
done
