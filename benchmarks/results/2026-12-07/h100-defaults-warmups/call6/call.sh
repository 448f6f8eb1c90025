#!/usr/bin/env bash
# same host: the default rules at 6 GiB Q4_K with SlabCache.worth before (arrays' path) and after (scalar lookup), lru beside
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name --format=csv | tee "$OUT/gpu.txt"
rm -rf /tmp/before && mkdir /tmp/before && cp -r benchmarks vismmoe_kt kernel_launch optimize_rules cpu_kernels /tmp/before/
(cd /tmp/before && patch -p1 -R < "$OLDPWD/.scratch/worth.patch") || exit 3
show() { grep -E '^\{"config"' "$1" | python3 -c '
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(sys.argv[1], r["config"], "warm", r["warm_ups"], "decode", [round(x,1) for x in r["decode_tok_s_reps"]], "prefill", [round(x,3) for x in r["prefill_s_reps"]],
      "maxgap", [round(x,1) for x in r["token_gap_ms_max_reps"]], "| copied", round(r["prefill_gb_copied"],2), round(r["prefill_copy_s"],3), round(r["prefill_stall_s"],3))' "$2"; }
V="vismmoe:expert_budget=6GiB,store_dtype=q4_k"; L="lru:expert_budget=6GiB,store_dtype=q4_k"
(cd /tmp/before && PYTHONPATH=/tmp/before timeout 90 python3 -m benchmarks.decode_bench --out "$OUT/before" --layers 48 --reps 3 --image_size 448 \
    --decode_tokens 128 --routing synthetic --configs "$V" > "$OUT/before.log" 2>&1); show "$OUT/before.log" before
PYTHONPATH=. timeout 150 python3 -m benchmarks.decode_bench --out "$OUT/after" --layers 48 --reps 3 --image_size 448 \
    --decode_tokens 128 --routing synthetic --configs "$V" "$L" > "$OUT/after.log" 2>&1; show "$OUT/after.log" after
find "$OUT" -name "*.json" -path "*isolated*" -delete 2>/dev/null
