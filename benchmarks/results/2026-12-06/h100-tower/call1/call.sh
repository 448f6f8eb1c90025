#!/usr/bin/env bash
# H200: llama-bench pp, the vision tower's kernels (and compiled), the resident prompt's tile alternatives, the tiles tuned
# and adopted, the launcher A/B, the 896 px timeline
set -u
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=.:.scratch/pylib
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
G=.scratch/gguf-q4k
[[ -f $G/synthetic_gguf.json ]] || timeout 120 python3 -m benchmarks.models.synthetic_gguf $G --layers 48 2>&1 | tail -n 1
echo "== gguf at $((SECONDS-t0)) s"
cat .scratch/llama.cpp/llama-bench.xz.part-* | xz -d > /tmp/llama-bench && chmod +x /tmp/llama-bench
timeout 60 /tmp/llama-bench -m $G/model-Q4_K.gguf -ngl 99 -ncmoe 0 -fa 1 -t 14 -p 236,508,824 -n 0 -r 5 2>&1 | grep -E "pp[0-9]" | tee $OUT/llama.txt | cut -c90-200
echo "== llama done at $((SECONDS-t0)) s"
timeout 110 python3 -m benchmarks.vision_tower_bench --out $OUT/tower --image-sizes 448 896 --reps 20 --compile 2>&1 | grep -vE "^Writing|it/s\]|Warning|warn" | tail -n 45 | cut -c1-200
echo "== tower done at $((SECONDS-t0)) s"
CFG="offload:expert_budget=1TiB,gguf_path=$G"
run_ab() {  # NAME TIMEOUT ARGS...
  local name=$1 t=$2; shift 2
  timeout $t python3 -m benchmarks.tiles_ab --out $OUT/$name.json --config "$CFG" "$@" 2>&1 | grep -vE "^Writing|it/s\]" | tail -n 4 | cut -c1-600
  echo "== $name done at $((SECONDS-t0)) s"
}
run_ab tiles 170 --text-tokens 508 --rounds 3
timeout 120 python3 -m benchmarks.prefill_kernel_bench --out $OUT/prefillk --tune --tune-tokens 236 --adopt > $OUT/prefillk.txt 2>&1
grep -E "adopted|expert-major" $OUT/prefillk.txt | tail -n 8 | cut -c1-300
cp vismmoe_kt/runtime/kernels/tuning.json $OUT/tuning.json
echo "== tune done at $((SECONDS-t0)) s"
left=$((585 - (SECONDS - t0)))
(( left > 60 )) && run_ab launches $(( left < 120 ? left : 120 )) --text-tokens 508 --rounds 4 --launches
echo "== all done at $((SECONDS-t0)) s"
