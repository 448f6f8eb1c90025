#!/usr/bin/env bash
# the 6 GiB Q4_K prompt after a 127-token decode (as decode_bench's reps): default rules against lru, cProfile; then the pair
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
V="vismmoe:expert_budget=6GiB,store_dtype=q4_k"; L="lru:expert_budget=6GiB,store_dtype=q4_k"
for c in "$V" "$L"; do
  tag=${c%%:*}
  timeout 120 python3 -m benchmarks.prompt_timeline --out "$OUT/tl-$tag" --config "$c" --rounds 3 --decode-tokens 127 --profile --top 45 \
    2>&1 | grep -vE "^Writing|it/s\]" > "$OUT/tl-$tag.txt"; head -c 1200 "$OUT/tl-$tag.txt"
done
timeout 130 python3 -m benchmarks.decode_bench --out "$OUT/q4k448" --layers 48 --reps 3 --image_size 448 \
    --decode_tokens 128 --routing synthetic --configs "$V" "$L" > "$OUT/q4k448.log" 2>&1
grep -E '^\{"config"' "$OUT/q4k448.log" | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r["config"], "warm", r["warm_ups"], "decode", [round(x,1) for x in r["decode_tok_s_reps"]], "prefill", [round(x,3) for x in r["prefill_s_reps"]],
      "maxgap", [round(x,1) for x in r["token_gap_ms_max_reps"]], "hits", round(r["decode_hit_rate"],3), "| copied", round(r["prefill_gb_copied"],2), r["prefill_copy_s"], r["prefill_stall_s"])'
find "$OUT/q4k448" -name "*.json" -path "*isolated*" -delete 2>/dev/null
