#!/usr/bin/env bash
# ahead's first GPU run (check_reservations) and the prune's check; then the 6 GiB Q4_K defaults with the reservations trial
set -u
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
t0=$SECONDS
CHECK_TIMEOUT=180 CHECK_ARGS="--only qwen3vl-offload" bash scripts/device_session.sh check > $OUT/check.log 2>&1
grep -E '"ok"' $OUT/gpu_check.txt | grep -oE '^\{"check": "[^"]*"|"ok": (true|false)|"errors": \[[^]]*\]|"kept": "[^"]*"|"greedy_tokens_equal": [a-z]+|"chained[a-z_]*": [0-9]+' | paste -sd' ' | sed 's/{"check"/\n{"check"/g' | cut -c1-400
echo "== check done at $((SECONDS-t0)) s"
export PYTHONPATH=.:$PWD/.scratch/pylib
G=.scratch/gguf-q4k
timeout 150 python3 -m benchmarks.models.synthetic_gguf $G --layers 48 2>&1 | tail -n 1
echo "== gguf done at $((SECONDS-t0)) s"
q="expert_budget=6GiB,gguf_path=$G"
timeout $(( 585 - (SECONDS-t0) )) python3 -m benchmarks.decode_bench --out $OUT/q4k448 --layers 48 --reps 2 --image_size 448 --decode_tokens 128 \
  --routing synthetic --configs vismmoe:$q lru:$q lru:$q,reservations=ahead > $OUT/q4k448.txt 2>&1
echo "rc=$?"; grep -E "^\| [a-z]" $OUT/q4k448.txt | cut -d'|' -f2-6,10; grep -o '"reservations": "[^"]*"\|"eviction": "[^"]*"' $OUT/q4k448.txt | cut -c1-200
echo "== all done at $((SECONDS-t0)) s"
