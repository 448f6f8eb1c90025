#!/usr/bin/env bash
# where the default rules' 6 GiB Q4_K prompt loses 50 ms against lru's; and whether a first rep after the warm-up is slow
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
V="vismmoe:expert_budget=6GiB,store_dtype=q4_k"; L="lru:expert_budget=6GiB,store_dtype=q4_k"
for c in "$V" "$L"; do
  tag=${c%%:*}
  timeout 130 python3 -m benchmarks.prompt_timeline --out "$OUT/tl-$tag" --config "$c" --rounds 3 --split --profile --top 25 \
    2>&1 | grep -vE "^Writing|it/s\]" > "$OUT/tl-$tag.txt"; tail -c 2500 "$OUT/tl-$tag.txt" | head -40
done
timeout 150 python3 -m benchmarks.decode_bench --out "$OUT/ht" --layers 48 --reps 1 --image_size 448 --decode_tokens 16 \
  --routing synthetic --kernels --configs "$V" "$L" > "$OUT/ht.txt" 2>&1
for t in $(find "$OUT/ht" -name "trace-*.json.gz"); do echo "== $t"; python3 -m benchmarks.host_trace "$t"; done > "$OUT/host_trace.txt" 2>&1
find "$OUT/ht" -name "trace-*" -delete; head -c 3000 "$OUT/host_trace.txt"
timeout 170 python3 -m benchmarks.decode_bench --out "$OUT/reps" --layers 48 --reps 4 --image_size 448 --decode_tokens 128 \
  --routing synthetic --configs "$V" "$L" 2>&1 | grep -E "^\|" | tee "$OUT/reps.txt"
