#!/usr/bin/env bash
# 6 GiB Q4_K prompt: before (76a94a4: pageable row maps), after (main), slab-order on main, lru; one host
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=${OUT:-/tmp/vismmoe-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/.scratch/kt:$PWD/.scratch/pylib${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
timeout 60 python3 -c "import sys, json; sys.path[:0] = ['scripts', '.']; import gpu_check; print(json.dumps(gpu_check.check_copy_sources()))" 2>&1 | tail -2 | tee "$OUT/copy_sources.txt"
q=expert_budget=6GiB,store_dtype=q4_k
px=${1:-448}
dirs=()
for c in before:vismmoe:$q main:vismmoe:$q main:lru:$q slab:vismmoe:$q; do
  side=${c%%:*}; cfg=${c#*:}
  case $side in before) dir=.scratch/before;; slab) dir=.scratch/slab;; *) dir=.;; esac
  d="$OUT/prompts$px/${side}_$(tr -c 'A-Za-z0-9=.\n-' _ <<< "$cfg")"
  extra=""; [[ $c == main:vismmoe:* ]] && extra="--split --profile --top 40"; [[ $c == before:* ]] && extra="--split"
  (cd "$dir" && PYTHONPATH=.:$PYTHONPATH timeout $(( ${PROMPTS_TIMEOUT:-110} + ${extra:+3}0 )) python3 -m benchmarks.prompt_timeline \
     --out "$d" --config "$cfg" --image-size "$px" --rounds 3 --decode-tokens 127 $extra 2>&1 \
     | grep -vE "^Writing|it/s\]" | tail -30) && dirs+=("$d")
  python3 -m benchmarks.prompt_compare "${dirs[@]}" > "$OUT/prompts$px.md" 2>&1 || true
done
cat "$OUT/prompts$px.md"
tar czf "$OUT/prompts$px.tar.gz" -C "$OUT" "prompts$px" && rm -rf "$OUT/prompts$px"
