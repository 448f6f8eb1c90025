#!/usr/bin/env bash
# the default rules against lru at 6 GiB Q4_K, 896 px, with the bench's warm-ups until no capture
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name --format=csv | tee "$OUT/gpu.txt"
V="vismmoe:expert_budget=6GiB,store_dtype=q4_k"; L="lru:expert_budget=6GiB,store_dtype=q4_k"
PYTHONPATH=. timeout ${SECS:-150} python3 -m benchmarks.decode_bench --out "$OUT/q4k896" --layers 48 --reps 3 --image_size 896 \
    --decode_tokens 128 --routing synthetic --configs "$V" "$L" > "$OUT/q4k896.log" 2>&1
grep -E '^\{"config"' "$OUT/q4k896.log" | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r["config"], "warm", r["warm_ups"], "decode", [round(x,1) for x in r["decode_tok_s_reps"]], "prefill", [round(x,3) for x in r["prefill_s_reps"]],
      "maxgap", [round(x,1) for x in r["token_gap_ms_max_reps"]], "hits", round(r["decode_hit_rate"],3), "| copied", round(r["prefill_gb_copied"],2), round(r["prefill_copy_s"],3), round(r["prefill_stall_s"],3), "|", r.get("eviction"), "|", r.get("reservations"))'
grep -E '^\| (vismmoe|lru)' "$OUT/q4k896.log"
find "$OUT" -name "*.json" -path "*isolated*" -delete 2>/dev/null
