#!/usr/bin/env bash
# the vision tower's rotary kernel and patch GEMM, timed: the tower before/after (attention backends too), gpu_check's
# vision ops, then the resident prompts before (f83cccc in .scratch/before) and after, alternating, llama-bench beside
set -u
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=.:$PWD/.scratch/pylib
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
for side in .scratch/before .; do
  name=$([[ $side == . ]] && echo after || echo before)
  (cd $side && PYTHONPATH=.:$OLDPWD/.scratch/pylib timeout 100 python3 -m benchmarks.vision_tower_bench --out $OUT/tower-$name \
     --image-sizes 448 896 --attention-backends flash efficient cudnn > $OUT/tower-$name.txt 2>&1)
  echo "rc=$?"; grep -E "^[0-9]+ px|^==|alternative|backend" $OUT/tower-$name.txt | sed "s/^/$name /" | cut -c1-300
  echo "== tower $name done at $((SECONDS-t0)) s"
done
timeout 120 python3 scripts/gpu_check.py --only qwen3vl-offload --out $OUT/gpu_check.json > $OUT/gpu_check.txt 2>&1
echo "check rc=$?"; grep -vE "^Writing|it/s\]" $OUT/gpu_check.txt | grep -iE "vision|ok|fail|error|pass" | tail -n 14 | cut -c1-300
echo "== check done at $((SECONDS-t0)) s"
G=$PWD/.scratch/gguf-q4k
timeout 150 python3 -m benchmarks.models.synthetic_gguf $G --layers 48 2>&1 | tail -n 1
echo "== gguf done at $((SECONDS-t0)) s"
cat .scratch/llama.cpp/llama-bench.xz.part-* | xz -d > /tmp/llama-bench && chmod +x /tmp/llama-bench
timeout 60 /tmp/llama-bench -m $G/model-Q4_K.gguf -ngl 99 -ncmoe 0 -fa 1 -t 14 -p 236,508,824 -n 0 -r 5 2>&1 | grep -E "pp[0-9]" | tee $OUT/llama.txt | cut -c90-200
echo "== llama done at $((SECONDS-t0)) s"
side() {  # NAME DIR EXTRA...
  local name=$1 dir=$2; shift 2
  (cd $dir && PYTHONPATH=.:$OLDPWD/.scratch/pylib timeout 75 python3 -m benchmarks.prompt_timeline --out $OUT/$name \
     --config "offload:expert_budget=1TiB,gguf_path=$G" "$@" 2>&1 | grep -vE "^Writing|it/s\]" \
     | grep -E "prefill|Error|error" | sed "s/^/$name /" | cut -c1-200)
  echo "== $name done at $((SECONDS-t0)) s"
}
for s in after448 before448 after896 before896 after448b before448b; do
  case $s in before*) d=.scratch/before ;; *) d=. ;; esac
  case $s in *896) px=896 ;; *) px=448 ;; esac
  (( SECONDS - t0 < ${STOP_AT:-500} )) && side $s $d --rounds 4 --image-size $px
done
timeout 40 /tmp/llama-bench -m $G/model-Q4_K.gguf -ngl 99 -ncmoe 0 -fa 1 -t 14 -p 236,824 -n 0 -r 5 2>&1 | grep -E "pp[0-9]" | tee $OUT/llama2.txt | cut -c90-200
echo "== all done at $((SECONDS-t0)) s"
