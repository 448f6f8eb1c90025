#!/usr/bin/env bash
# the default rules (reservations: auto) against lru at 16 and 32 GiB BF16, 448 px, 128 tokens
set -u
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
for b in ${BUDGETS:-16GiB 32GiB}; do
  left=$(( 585 - (SECONDS-t0) )); [[ $left -gt 60 ]] || break
  timeout $(( left < 290 ? left : 290 )) python3 -m benchmarks.decode_bench --out $OUT/bf16-$b --layers 48 --reps 2 --image_size ${PX:-448} --decode_tokens 128 \
    --routing synthetic --configs vismmoe:expert_budget=$b lru:expert_budget=$b > $OUT/bf16-$b.txt 2>&1
  echo "rc=$?"; grep -E "^\| [a-z]" $OUT/bf16-$b.txt | cut -d'|' -f2-6,10; grep -o '"reservations": "[^"]*"\|"eviction": "[^"]*"' $OUT/bf16-$b.txt | cut -c1-220
  echo "== $b done at $((SECONDS-t0)) s"
done
