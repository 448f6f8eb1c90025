#!/usr/bin/env bash
# before (dc577ff) / mid (9bbac35: host-read-free picture prompt, routing columns) / after (+ direct Triton launches)
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=.:.scratch/pylib
G=.scratch/gguf-q4k
[[ -f $G/synthetic_gguf.json ]] || timeout 300 python3 -m benchmarks.models.synthetic_gguf $G --layers 48 2>&1 | tail -n 1
cat .scratch/llama.cpp/llama-bench.xz.part-* | xz -d > /tmp/llama-bench && chmod +x /tmp/llama-bench
timeout 120 /tmp/llama-bench -m $G/model-Q4_K.gguf -ngl 99 -ncmoe 0 -fa 1 -t 14 -p 236,508,824 -n 0 -r 5 2>&1 | grep -E "pp[0-9]" | tee $OUT/llama.txt
echo "== llama done at $((SECONDS-t0)) s"
side() {  # NAME DIR EXTRA...: prompt_timeline in DIR's code
  local name=$1 dir=$2; shift 2
  (cd $dir && PYTHONPATH=.:$OLDPWD/.scratch/pylib timeout ${SIDE_TIMEOUT:-110} python3 -m benchmarks.prompt_timeline --out $OUT/$name \
     --config "offload:expert_budget=1TiB,gguf_path=$OLDPWD/$G" --text-tokens 508 "$@" 2>&1 | grep -vE "^Writing|it/s\]" \
     | grep -E "prefill|ms a|Error|error" | sed "s/^/$name /" | cut -c1-200)
  echo "== $name done at $((SECONDS-t0)) s"
}
for s in ${SIDES:-before mid after after2 mid2 before2 after896 before896}; do
  case $s in before*) d=.scratch/before ;; mid*) d=.scratch/mid ;; *) d=. ;; esac
  case $s in *896) extra="--image-size 896 --text-tokens 0" ;; *) extra="" ;; esac
  (( SECONDS - t0 < ${STOP_AT:-480} )) && side $s $d --rounds ${ROUNDS:-4} $extra
done
echo "== all done at $((SECONDS-t0)) s"
