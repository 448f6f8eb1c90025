#!/usr/bin/env bash
# The full `vismmoe-kt bench` run on one H200 (Qwen3-VL-30B-A3B shapes, all 48 layers), in parts
# that each fit one device-tool call (under 10 minutes): part 1 the budget-free baselines, parts 2-3
# accelerate (fewer decoded tokens: it decodes at about 0.15 tokens/s), parts 4-9 LRU and the
# VisMMOE ablation, three configurations per call (each loads 58 GiB into page-locked memory, 1-1.5 min).
#
#   bash scripts/bench_h200.sh PART OUT_DIR      # PART = 1..9; results in OUT_DIR/partPART/
#   python3 -m vismmoe_kt.apps.measure.merge_bench OUT_DIR/merged OUT_DIR/part*/bench.json   # one table and chart
#
# Every part re-measures the copy bandwidth; compare configurations within a part first.
set -euo pipefail
part=${1:?usage: bench_h200.sh PART OUT_DIR}
out=${2:?usage: bench_h200.sh PART OUT_DIR}
common=(--synthetic qwen3-vl-30b-a3b --layers 48 --image-sizes 448 896 --warmup 1 --repeats 3 --decode-tokens 16
        --cpu_infer 16 --output "$out/part$part" --profile)
small=16GiB   # expert budget standing for a 24 GB card (about 4 GB of other weights and activations besides)
large=32GiB   # ... and for a 40 GB card
case $part in
  1) configs=(all-on-gpu all-pinned kt-cpu); budgets=() ;;
  2) configs=(accelerate); budgets=($small); common+=(--decode-tokens 4 --repeats 2) ;;
  3) configs=(accelerate); budgets=($large); common+=(--decode-tokens 4 --repeats 2) ;;
  4) configs=(lru vismmoe-base vismmoe+compress); budgets=($small) ;;
  5) configs=(vismmoe+predict vismmoe-full hybrid-full); budgets=($small) ;;
  6) configs=(hybrid-base hybrid+compress hybrid+predict); budgets=($small) ;;
  7) configs=(lru vismmoe-base vismmoe+compress); budgets=($large) ;;
  8) configs=(vismmoe+predict vismmoe-full hybrid-full); budgets=($large) ;;
  9) configs=(hybrid-base hybrid+compress hybrid+predict); budgets=($large) ;;
  *) echo "PART must be 1..9, got $part" >&2; exit 2 ;;
esac
# later flags win in argparse, so part 2-3's --decode-tokens/--repeats replace the common ones
exec python3 -m vismmoe_kt.apps.cli bench "${common[@]}" --configs "${configs[@]}" ${budgets:+--budgets "${budgets[@]}"}
