#!/usr/bin/env bash
# HEAD, short: the launcher under the GPU check, then its share alternated in one process, then the split if time is left
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=.:.scratch/pylib
G=.scratch/gguf-q4k
timeout 100 python3 scripts/gpu_check.py --only qwen3vl-offload 2>&1 | grep -vE "^Writing|it/s\]" | tail -n 10 | cut -c1-180
echo "== check done at $((SECONDS-t0)) s"
[[ -f $G/synthetic_gguf.json ]] || timeout 200 python3 -m benchmarks.models.synthetic_gguf $G --layers 48 2>&1 | tail -n 1
CFG="offload:expert_budget=1TiB,gguf_path=$G"
timeout 110 python3 -m benchmarks.tiles_ab --out $OUT/launches.json --config "$CFG" --text-tokens 508 --rounds 6 --launches \
  2>&1 | grep -vE "^Writing|it/s\]" | tail -n 3 | cut -c1-400
echo "== launches done at $((SECONDS-t0)) s"
left=$((${BUDGET:-300} - (SECONDS - t0)))
(( left > 60 )) && timeout $left python3 -m benchmarks.prompt_timeline --out $OUT/split --config "$CFG" --text-tokens 508 \
  --rounds 2 --split 2>&1 | grep -vE "^Writing|it/s\]" | grep -E "ms a|prefill" | cut -c1-150
echo "== all done at $((SECONDS-t0)) s"
