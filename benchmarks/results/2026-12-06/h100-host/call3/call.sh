#!/usr/bin/env bash
# short: the resident prompt's tile alternatives end to end beside llama-bench (for an H200)
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
export PYTHONPATH=.:.scratch/pylib
G=.scratch/gguf-q4k
timeout 60 python3 -m benchmarks.models.synthetic_gguf $G --layers 48 2>&1 | tail -n 1
cat .scratch/llama.cpp/llama-bench.xz.part-* | xz -d > /tmp/llama-bench && chmod +x /tmp/llama-bench
timeout 30 /tmp/llama-bench -m $G/model-Q4_K.gguf -ngl 99 -ncmoe 0 -fa 1 -t 14 -p 236,508 -n 0 -r 3 2>&1 | grep -E "pp[0-9]" | cut -c100-200
echo "== llama done at $((SECONDS-t0)) s"
timeout $((140 - (SECONDS - t0))) python3 -m benchmarks.tiles_ab --out $OUT/tilesab.json \
  --config "offload:expert_budget=1TiB,gguf_path=$G" --text-tokens 508 --rounds 2 2>&1 | grep -vE "^Writing|it/s\]" | tail -n 2 | cut -c1-700
echo "== all done at $((SECONDS-t0)) s"
