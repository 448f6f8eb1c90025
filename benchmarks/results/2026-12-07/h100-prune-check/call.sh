#!/usr/bin/env bash
# the prune's sync check after the index_fill_ fix; then the 32 GiB BF16 896 px prompt, default against lru, 4 reps
set -u
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
t0=$SECONDS
CHECK_TIMEOUT=200 CHECK_ARGS="--only qwen3vl-offload" bash scripts/device_session.sh check > $OUT/check.log 2>&1
grep -E '"ok"' $OUT/gpu_check.txt | grep -oE '^\{"check": "[^"]*"|"ok": (true|false)|"errors": \[[^]]*\]|"pruned_prefills": [0-9]+|"rules": "[^"]*"|"greedy_tokens_equal": [a-z]+' | paste -sd' ' | sed 's/{"check"/\n{"check"/g; s/{"rules"/\n{"rules"/g'
echo "== check done at $((SECONDS-t0)) s"
export PYTHONPATH=.:.scratch/pylib
timeout $(( 560 - (SECONDS-t0) )) python3 -m benchmarks.decode_bench --out $OUT/d896 --layers 48 --reps 4 --image_size 896 --decode_tokens 128 \
  --routing synthetic --configs vismmoe:expert_budget=32GiB lru:expert_budget=32GiB > $OUT/d896.txt 2>&1
echo "rc=$?"; grep -E "^\| [a-z]|a prompt copied" $OUT/d896.txt | cut -c1-300; grep -o '"prefill_s[a-z_]*": [0-9.]*\|"decode_tok_s_reps": \[[^]]*\]' $OUT/d896.txt
echo "== all done at $((SECONDS-t0)) s"
