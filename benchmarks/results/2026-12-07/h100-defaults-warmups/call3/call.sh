#!/usr/bin/env bash
# the 6 GiB Q4_K prompt under the default rules and lru: host issue against the GPU layer by layer, host time by part, cProfile
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
V="vismmoe:expert_budget=6GiB,store_dtype=q4_k"; L="lru:expert_budget=6GiB,store_dtype=q4_k"
for c in "$V" "$L"; do
  tag=${c%%:*}
  timeout 170 python3 -m benchmarks.prompt_timeline --out "$OUT/tl-$tag" --config "$c" --rounds 3 --split --profile --top 40 \
    2>&1 | grep -vE "^Writing|it/s\]" > "$OUT/tl-$tag.txt"; head -c 1500 "$OUT/tl-$tag.txt"
done
