#!/usr/bin/env bash
# The `python -m benchmarks.bench` run on one H200 (Qwen3-VL-30B-A3B shapes, all 48 layers, synthetic routing:
# the default for --synthetic models), in parts that each fit under 10 minutes. Loading an offloaded
# configuration fills 58 GiB of page-locked host memory (about 1-1.5 min); the rest load in seconds.
#
#   bash scripts/bench_h200.sh PART OUT_DIR      # PART = 1..8; results in OUT_DIR/partPART/
#   python3 -m benchmarks.merge_bench OUT_DIR/merged OUT_DIR/part*/bench.json   # one table and chart
#
# Every part re-measures the copy bandwidth; compare configurations within a part first. The same
# seed gives every configuration the same sequence of requests' routing (synthetic:0).
set -euo pipefail
part=${1:?usage: bench_h200.sh PART OUT_DIR}
out=${2:?usage: bench_h200.sh PART OUT_DIR}
common=(--synthetic qwen3-vl-30b-a3b --layers 48 --image-sizes 448 896 --warmup 1 --repeats 3 --decode-tokens 16
        --cpu_infer 12 --routing synthetic:0 --output "$out/part$part"
        --predictor benchmarks/results/2026-11-30/predictor-synthetic-48x128/predictor.pt)  # +predict and -full: the calibrated lookahead
small=16GiB   # expert budget standing for a 24 GB card (about 4 GB of other weights and activations besides)
large=32GiB   # ... and for a 40 GB card
case $part in
  1) configs=(all-on-gpu all-pinned lru vismmoe-base); budgets=($small) ;;
  2) configs=(vismmoe+compress vismmoe+predict vismmoe-full); budgets=($small) ;;
  3) configs=(lru vismmoe-base); budgets=($large) ;;
  4) configs=(vismmoe+compress vismmoe+predict vismmoe-full); budgets=($large) ;;
  5) configs=(kt-cpu hybrid-base hybrid-full); budgets=($small) ;;   # kt-kernel from .scratch/kt
  6) configs=(hybrid+compress hybrid+predict); budgets=($small) ;;
  7) configs=(accelerate); budgets=($small); common+=(--decode-tokens 4 --repeats 2) ;;
  8) configs=(accelerate); budgets=($large); common+=(--decode-tokens 4 --repeats 2) ;;
  *) echo "PART must be 1..8, got $part" >&2; exit 2 ;;
esac
# later flags win in argparse, so part 7-8's --decode-tokens/--repeats replace the common ones
exec python3 -m benchmarks.bench "${common[@]}" --configs "${configs[@]}" ${budgets:+--budgets "${budgets[@]}"}
