#!/usr/bin/env bash
# the default rules (qwen3vl.yaml) against lru, 128 decoded tokens, synthetic routing: the target cells
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
t0=$SECONDS
pair() {  # NAME PX REPS SECONDS BUDGET-SETTINGS
  timeout "$4" python3 -m benchmarks.decode_bench --out "$OUT/$1" --layers 48 --reps "$3" --image_size "$2" \
    --decode_tokens 128 --routing synthetic --configs "vismmoe:$5" "lru:$5" > "$OUT/$1.log" 2>&1
  grep -E '^\{"config"' "$OUT/$1.log" | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r["config"], "decode", [round(x,1) for x in r["decode_tok_s_reps"]], "prefill", [round(x,3) for x in r["prefill_s_reps"]],
      "maxgap", [round(x,1) for x in r["token_gap_ms_max_reps"]], "hits", round(r["decode_hit_rate"],3), "pinned", r["pinned_layers"], "|", r.get("eviction"), "|", r.get("reservations"), "| copied", round(r["prefill_gb_copied"],2), r["prefill_copy_s"], r["prefill_stall_s"])'
  grep -E '^\| (vismmoe|lru)' "$OUT/$1.log"; echo "[$1 done at $((SECONDS - t0)) s]"
  find "$OUT/$1" -name "*.json" -path "*isolated*" -delete 2>/dev/null
}
pair q4k448 448 4 110 expert_budget=6GiB,store_dtype=q4_k
pair q4k896 896 2 110 expert_budget=6GiB,store_dtype=q4_k
pair bf16x16-896 896 2 210 expert_budget=16GiB
[[ $((SECONDS - t0)) -lt 400 ]] && pair bf16x32-448 448 2 $(( 560 - (SECONDS - t0) )) expert_budget=32GiB
