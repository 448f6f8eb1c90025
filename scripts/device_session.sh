#!/usr/bin/env bash
# One device-tool call per line below (each stage well under the 10-minute limit of one command):
#   bash scripts/device_session.sh check            install, then scripts/gpu_check.py (every rule file, lean decode + graphs;
#                                                   CHECK_ARGS="--only qwen3vl": the kernels, then Qwen3-VL's rule files)
#   bash scripts/device_session.sh bench PART...    scripts/bench_h200.sh PART (synthetic routing), one after another
#   bash scripts/device_session.sh kernel           the decode experts' kernels: resident, zero-copy from the host, copies
#   bash scripts/device_session.sh decode [PX]      the decode benchmark at PX px (448): stock transformers, lean graphed,
#                                                   lru at 16 GiB, lean offloaded at 16 and 32 GiB (synthetic
#                                                   routing): five configurations in one process
#   bash scripts/device_session.sh predict PX BUDGET  decode at PX px, BUDGET: lru, vismmoe, vismmoe with the
#                                                   lookahead predictor (benchmarks/results/2026-11-30/predictor-synthetic-48x128) at
#                                                   every MoE layer, every 2nd and every 5th (prefetch_stride),
#                                                   synthetic routing (about 9 min)
#   bash scripts/device_session.sh kernels PX BUDGET  all resident, lru, vismmoe, vismmoe + lookahead at PX px, BUDGET,
#                                                   each with one request under torch.profiler: device time per
#                                                   decode step by kernel and stream, idle and overlapped time
#   bash scripts/device_session.sh ktcpu [PX]       every routed expert on kt-kernel (needs .scratch/kt), decode graphed
#                                                   on the lean path: the default worker plan and 16 workers
#                                                   (KTCPU_CONFIGS overrides, e.g. "kt-cpu:cpu_backend=kt-kernel,cpu_dtype=int4
#                                                   kt-cpu:cpu_backend=kt-kernel,cpu_dtype=int4,gpu_prefill_tokens=64")
#   bash scripts/device_session.sh gpuprefill       scripts/gpu_check.py --gpu-prefill: the kt-cpu rule's layerwise GPU
#                                                   prefill (model dtype, Q8_0, Q4_K copies; shares 1, 0.5, auto) vs its CPU twin
#   bash scripts/device_session.sh ktquant [LAYERS] kt-kernel experts in BF16, INT8 and INT4 (quantized at load), LAYERS
#                                                   (16) of the 48 layers
#   bash scripts/device_session.sh hybrid PX BUDGET lru, offload-only and the hybrid mode (misses split with kt-kernel
#                                                   INT8 inside the decode graph; and every miss on the CPU)
#   bash scripts/device_session.sh q8 PX BUDGET     lru and VisMMOE with the host store in the model's dtype, VisMMOE
#                                                   in Q8_0, Q4_0, Q4_K and Q5_K
#   bash scripts/device_session.sh stores           the quantized host stores (Q8_0, Q4_0, Q4_K, Q5_K): the GPU's Triton
#                                                   kernels against the CPU's torch twins (scripts/gpu_check.py --stores)
#   bash scripts/device_session.sh ggufwrite        the synthetic model's 48 layers written as a GGUF checkpoint (Q4_K
#                                                   experts, Q8_0 rest) under .scratch/gguf-q4k, timed
#   bash scripts/device_session.sh gguf PX BUDGET   lru and VisMMOE on BF16 against VisMMOE loaded from that GGUF (Q4_K
#                                                   in the host store) and quantized to Q4_K at load (writes it first
#                                                   if it is not there)
#   bash scripts/device_session.sh peer [PX]        llama.cpp's llama-bench beside decode_bench on that GGUF (writes it
#                                                   first if missing): our Q4_K configurations from the file (resident,
#                                                   VisMMOE and lru at 6 GiB, VisMMOE at 12 GiB; PEER_CONFIGS overrides)
#                                                   and llama-bench at each one's -ncmoe split, 0 and 48; the binary
#                                                   from .scratch/llama.cpp/llama-bench.xz.part-* (carry it); PEER_TEXT=512:
#                                                   a text-only prompt of 512 tokens instead of the picture (pp512 beside it);
#                                                   PEER_SECONDS (570): the stage's seconds, to share a call with others
#   bash scripts/device_session.sh peerbatch [PX]   8 requests together, every expert resident in Q4_K: ours (decode_bench
#                                                   --concurrency 1 8 on the GGUF; PEERBATCH_CONFIG: one or more configurations,
#                                                   PEERBATCH_REPS override;
#                                                   PEERBATCH_KERNELS=1: the batched steps' kernels profiled too) and
#                                                   llama-batched-bench's 8 parallel sequences of a PX-px prompt's length
#                                                   (236 tokens at 448) and 128 decoded each, -npl 1,8, with
#                                                   .scratch/llama-batched/llama-batched-bench.xz.part-* carried
#                                                   (scripts/build_llama_peer.sh builds them on a machine without a GPU)
#   bash scripts/device_session.sh qslabs PX BUDGET  VisMMOE on BF16 against the Q4_K GGUF with dequantized and with
#                                                   quantized slabs (slab_format), and quantized slabs at half BUDGET
#                                                   (GGUF_CONFIGS overrides the list)
#   bash scripts/device_session.sh batch PX N...    every expert resident (graphed), and offloaded at 16 GiB: one
#                                                   request graphed against N decoded together for each N (batched
#                                                   generation, CUDA graphs per batch size), synthetic routing
#                                                   (BATCH_ROUTING, BATCH_CONFIGS override; BATCH_ARGS adds
#                                                   decode_bench flags, e.g. --prefill-budget 0; a configuration's
#                                                   batch_experts=... picks the batched step's kernels; BATCH_TAG names
#                                                   the output apart)
#   bash scripts/device_session.sh batchoff PX N... offloaded batching at 16 GiB (the batch's offloaded layers through the
#                                                   decode table): BF16 slabs, and Q4_K store and slabs (quantized at
#                                                   load), synthetic routing, one process each (BATCH_CONFIGS overrides)
#   bash scripts/device_session.sh kbatch           a batched step's resident experts, kernels alone: grouped GEMM, the
#                                                   table kernels and the expert-major ones at 2-16 tokens, and the
#                                                   expert-major tiles swept (decode_kernel_bench --batch --tune)
#   bash scripts/device_session.sh kqbatch          the same step on Q4_K slabs: the GEMVs token by token and in one launch
#                                                   (the tuned form and dp4a), the quantized expert-major kernels, their
#                                                   tiles swept (decode_kernel_bench --batch --quantized --tune;
#                                                   KQBATCH_ARGS= runs the tuned tiles alone)
#                                                   (end to end: BATCH_CONFIGS=offload:expert_budget=16GiB,store_dtype=q4_k,
#                                                   batch_experts=expert-major bash scripts/device_session.sh batchoff 448 8)
#   bash scripts/device_session.sh realblayer       ReaLB's MoE layer on one GPU, each expert-parallel rank's compute in turn:
#                                                   bf16, fp8-all, realb, fixed M_d for RxN (ranks x 448 px requests,
#                                                   REALB_RUNS, default 2x16 4x16 8x16 8x32 8x64), synthetic routing;
#                                                   REALB_ARGS="--affinity 0.283 --image-share 0.5": the labelled what-if,
#                                                   each picture its own experts, half the prompts text
#   bash scripts/device_session.sh epdp PX N...     (nvidia-h200-x2) expert parallelism over two GPUs: one request, then N
#                                                   requests on every rank, data parallel (EP_CONFIGS: ep ep-graphs
#                                                   ep-realb ep-realb-seq ep-lowprec-all); the profile has ReaLB's gate and switched pairs
#   bash scripts/device_session.sh smoke            a tiny model's offloaded decode with an (untrained) lookahead predictor,
#                                                   graphed: the side-stream prefetch captured and checked
#   bash scripts/device_session.sh fits             decode with a trace whose experts fit 32 GiB (lru, vismmoe) against
#                                                   all-resident; then stock vs all-resident at 448 px
#   bash scripts/device_session.sh family [PX]      #24's rows for a non-Qwen family at full published shapes (MODEL,
#                                                   default deepseek-ocr2; MODEL_LAYERS cuts layers, e.g. 24 for
#                                                   glm-4.5v): python -m benchmarks.bench all-on-gpu, all-pinned, lru and
#                                                   vismmoe-full at a budget of FAMILY_BUDGET (30%: that share of the
#                                                   model's routed experts), PX px (448), synthetic routing
#                                                   (FAMILY_CONFIGS picks configurations; ernie-4.5-vl-28b-a3b: the
#                                                   budget is its text experts', the vision experts keep 2 GiB)
#   bash scripts/device_session.sh ablation BUDGET  VisMMOE's offload-only ladder against lru at BUDGET (448 and 896 px,
#                                                   synthetic routing, the calibrated predictor): bench_h200.sh's
#                                                   parts 1-2 or 3-4 without the resident baselines, in one call
#   bash scripts/device_session.sh compare DIR      the same decode_bench (COMPARE_CONFIGS: every expert resident, Q4_K slabs
#                                                   at 16 GiB; --kernels) on the code in DIR (a `git archive` of an earlier
#                                                   commit, carried, e.g. .scratch/before) and on this tree, one call: before/after
#                                                   (COMPARE_TIMEOUT seconds a side, default 260)
#   bash scripts/device_session.sh kqcompare DIR    the quantized slabs' GEMVs alone (decode_kernel_bench --quantized): DIR's code
#                                                   (a `git archive`, carried; - for none) at its tuned shapes, then this tree's with
#                                                   --tune; each format's fastest (KQ_FORMATS: q4_k,q4_k:bytes,q8_0,q5_k; KQ_FORMS:
#                                                   the load forms swept, e.g. shared,dp4a)
#   bash scripts/device_session.sh prefillk         a prompt's routed experts on Q4_K slabs at 236, 512 and 824 tokens, kernels
#                                                   alone (benchmarks/prefill_kernel_bench.py); PK_TUNE=1 sweeps the tiles
#                                                   (at PK_TUNE_TOKENS tokens, 512; 236: a 448 px prompt's); PK_ADOPT=1
#                                                   writes the fastest into this machine's tuning.json for the later stages
#   bash scripts/device_session.sh prefillncu       ncu's counters for those kernels, each tile form twice at PN_TOKENS (236)
#                                                   tokens (prefill_kernel_bench --profile-once): occupancy, issue, stalls
#   bash scripts/device_session.sh tilesab          the resident 448 px prompt (and a 508-token text one) under the committed
#                                                   prefill tiles, the tokens-first, weights-first and weights-ahead ones
#                                                   in turn, one process (benchmarks/tiles_ab.py; TILESAB_ARGS overrides
#                                                   its flags; "--text-tokens 508 --launches": direct Triton launches
#                                                   against Triton's own path instead)
#   bash scripts/device_session.sh timeline         where the resident 448 px and 508-token text prompts' time goes: the
#                                                   host's issue against the GPU layer by layer, the host's time split by
#                                                   part (benchmarks/prompt_timeline.py --split; TIMELINE_ARGS adds flags,
#                                                   e.g. --profile), and llama-bench's pp236/pp508 beside it when
#                                                   .scratch/llama.cpp is carried
#   bash scripts/device_session.sh prefillcompare DIR  those rows in DIR's code (a tree before a change, carried),
#                                                   then in this tree's, one call
#   bash scripts/device_session.sh tower [DIR]      a picture's vision tower alone at 448 and 896 px (benchmarks/vision_tower_bench.py:
#                                                   replayed and eager, its kernels by kind), in DIR's code first where given (a
#                                                   tree before a change, carried; TOWER_ARGS adds flags, e.g. --compile or
#                                                   "--attention-backends flash efficient cudnn")
#   bash scripts/device_session.sh defaults PX...   the default rules (qwen3vl.yaml) against lru at 16 and 32 GiB BF16 and
#                                                   6 GiB Q4_K, 128 decoded tokens, synthetic routing, per PX
#                                                   (DEFAULTS_CONFIGS, DEFAULTS_TOKENS, DEFAULTS_TIMEOUT override)
#   bash scripts/device_session.sh promptab [PX]    lru's and the default rules' prompts and decodes in turn in one process
#                                                   (benchmarks/prompt_ab.py: both models loaded, ABBA rounds, each
#                                                   prompt after a 127-token decode, ratios paired by round): 6 GiB
#                                                   Q4_K, PX px (896); PROMPTAB_CONFIGS (the first the baseline),
#                                                   PROMPTAB_ROUNDS (4), PROMPTAB_TIMEOUT (560) override. Both stores
#                                                   must fit the host: Q4_K ones do, two BF16 ones (58 GiB each) do not
#   bash scripts/device_session.sh prompts [PX]     the default rules' prompt against lru's, each after a 127-token decode (as
#                                                   decode_bench's reps start), layer by layer (prompt_timeline, then
#                                                   prompt_compare): at 6 GiB Q4_K, PX px (896), the default, lru, the
#                                                   default without compression (keep 1.0) and without a pinned layer
#                                                   (PROMPTS_CONFIGS, PROMPTS_TIMEOUT override; at 16 GiB BF16 give each
#                                                   120 s); each prompt's copies logged too, so the comparison says where
#                                                   the link sat idle and why (next copy not issued, or waiting on
#                                                   compute); the timelines tarred; PROMPTS_BEFORE=DIR (a `git archive`
#                                                   of an earlier tree, carried): the first configuration in DIR's code too
#   bash scripts/device_session.sh whatif [PX BUDGET STRENGTH]  #46's sensitivity curve, one point a call: lru, VisMMOE
#                                                   without compression (offload) and with it (vismmoe: keep 0.5) at
#                                                   PX (1344) and BUDGET (16GiB), 128 decoded tokens, routing
#                                                   synthetic:affinity=STRENGTH (0.283: the paper's +32%; 0: the
#                                                   calibrated router) (WHATIF_CONFIGS, WHATIF_TOKENS override)
#   bash scripts/device_session.sh hosttrace        one resident request profiled; its prefill's host time by runtime call and
#                                                   op (benchmarks/host_trace.py), its decode's gaps of the host per step
#                                                   (HOSTTRACE_CONFIGS: another configuration; PROFILE_STACKS=1: Python
#                                                   frames in the trace, each wait named by the code that issued it)
#   bash scripts/device_session.sh routing          #46: trains the routing-study model (routing-12x64) in /tmp/routing (on
#                                                   the machine's disk, outside $OUT), stopping after ROUTING_TRAIN_SECONDS
#                                                   (330) of training with a checkpoint; call it again (the machine still
#                                                   held) and it resumes. Once trained: held-out accuracy (teacher-forced,
#                                                   and greedy under qwen3vl.yaml at keep 1.0, 0.7, 0.5), then the affinity
#                                                   study on the model with scenes prompts (ROUTING_STUDY_PROMPTS, 8); a
#                                                   step that no longer fits the call is left to the next call. To $OUT:
#                                                   training.json, routing_train.txt, affinity_study.json/.md/.txt,
#                                                   affinity_traces.tar.gz (the traces unpruned and at keep 0.5)
#                                                   (ROUTING_STEPS 1500, ROUTING_BATCH 64, ROUTING_WORKERS 14 override;
#                                                   ROUTING_ARGS: the recipe's flags, by default "--lr 3e-3
#                                                   --describe_share 0.25 --simple_steps 500";
#                                                   a smoke run of the whole path in about a minute: ROUTING_SPEC=routing-tiny
#                                                   ROUTING_STEPS=20 ROUTING_DIR=/tmp/routing-smoke)
#   bash scripts/device_session.sh routingprof      #46: 4 training steps of routing-12x64 (batch 64) profiled after 3 more, in
#                                                   float32 and with --bf16 (BF16 autocast and BF16 grouped GEMMs for the
#                                                   experts): wall and device time a step, syncs, launches, top ops (2-3 min;
#                                                   ROUTINGPROF_TIMEOUT, 150: the seconds of each)
#   bash scripts/device_session.sh check bench 1    stages combine
# Results go to $OUT (the device tool brings them back). kt-kernel comes from a slim copy carried in
# .scratch/kt (its AMX and AVX-512-BF16 builds only: docs/design.md "Ecosystem facts we rely on"), if present; the gguf package from .scratch/pylib
# (cp -r .venv/lib/python3.*/site-packages/gguf .scratch/pylib/), for the GGUF stages.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vismmoe-out}
mkdir -p "$OUT"
# the gguf package (pure Python; the machine has no index to install it from) travels in .scratch/pylib
export PYTHONPATH=.:.scratch/kt:.scratch/pylib${PYTHONPATH:+:$PYTHONPATH}
GGUF_DIR=.scratch/gguf-q4k  # an ignored path: it stays on the device machine between calls while it is held
# decode_bench configurations (NAME:key=value,...: a placement and --set's kwargs, benchmarks/configurations.py)
RESIDENT=offload:expert_budget=1TiB,graphs=cuda  # every expert resident, each decode step a CUDA graph
KT_INT8=cpu_backend=kt-kernel,cpu_dtype=int8      # the hybrid mode's CPU experts: kt-kernel's INT8 copy
PREDICTOR=benchmarks/results/2026-11-30/predictor-synthetic-48x128/predictor.pt
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
rows_up() {  # a decode_bench run's per-configuration rows (OUT/X/isolated/C/) to OUT/X-C.json: deeper files do
            # not come back from the device machine
  for row in "$1"/isolated/*/decode_bench.json; do
    [[ -f $row ]] && cp "$row" "$1-$(basename "$(dirname "$row")").json"
  done
  rm -rf "$1/isolated"
}
while [[ $# -gt 0 ]]; do
  case $1 in
    check) timeout ${CHECK_TIMEOUT:-420} python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" ${CHECK_ARGS:-} \
             | tee "$OUT/gpu_check.txt" || echo "check: failed (the stages after it still run)"; shift ;;
    kernel) timeout 400 python3 -m benchmarks.decode_kernel_bench --out "$OUT" --tune | tee "$OUT/decode_kernel_bench.txt"
            shift ;;
    decode) shift
            px=448
            if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then px=$1; shift; fi
            timeout 570 python3 -m benchmarks.decode_bench --out "$OUT/decode$px" --layers 48 --reps 5 \
              --image-size "$px" --decode-tokens 32 --configs hf "$RESIDENT" lru:expert_budget=16GiB \
              offload:expert_budget=16GiB offload:expert_budget=32GiB \
              | tee "$OUT/decode_bench$px.txt" ;;
    smoke) shift
           python3 -c "
import torch
from vismmoe_kt.predictor.model import LookaheadPredictor, PredictorConfig
torch.manual_seed(0)
LookaheadPredictor(PredictorConfig(num_layers=6, num_experts=64, hidden_size=32, visual_size=96, window=5,
                                   hidden_source='synthetic')).save('$OUT/tiny_predictor.pt')"
           timeout 300 python3 -m benchmarks.decode_bench --out "$OUT/smoke" --tiny tiny-6x64 --routing synthetic \
             --reps 2 --decode-tokens 16 --image-size 224 --configs offload:expert_budget=12MiB \
             "offload:expert_budget=12MiB,predictor=$OUT/tiny_predictor.pt,prefetch_min_probability=0" \
             | tee "$OUT/smoke.txt"
           # an `if`: a `grep && exit` that finds nothing would leave the stage (and the script) with status 1
           if grep -q '"graphed_steps": 0' "$OUT/smoke/decode_bench.json"; then echo "smoke: steps not graphed" >&2; exit 3; fi ;;
    predict) shift
             px=$1 budget=$2; shift 2
             timeout "${PREDICT_TIMEOUT:-580}" python3 -m benchmarks.decode_bench --out "$OUT/predict$px-$budget" \
               --layers 48 --reps 3 --image-size "$px" --decode-tokens 32 \
               --configs ${PREDICT_CONFIGS:-"lru:expert_budget=$budget" "offload:expert_budget=$budget" \
                 "offload:expert_budget=$budget,predictor=$PREDICTOR" \
                 "offload:expert_budget=$budget,predictor=$PREDICTOR,prefetch_stride=2" \
                 "offload:expert_budget=$budget,predictor=$PREDICTOR,prefetch_stride=5"} \
               | tee "$OUT/predict$px-$budget.txt" ;;
    kernels) shift  # one profiled request per configuration: where the decode step's device time goes
             px=$1 budget=$2; shift 2
             timeout 560 python3 -m benchmarks.decode_bench --out "$OUT/kernels$px-$budget" --layers 48 \
               --reps 1 --image-size "$px" --decode-tokens 32 --kernels \
               --configs ${KERNEL_CONFIGS:-"$RESIDENT" "lru:expert_budget=$budget" "offload:expert_budget=$budget" \
                 "offload:expert_budget=$budget,predictor=$PREDICTOR" \
                 "offload:expert_budget=$budget,predictor=$PREDICTOR,prefetch_stride=5"} \
               | tee "$OUT/kernels$px-$budget.txt" ;;
    ktcpu) shift  # every routed expert on kt-kernel, decode on the lean path (graphed), two worker counts
           px=${1:-448}; [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]] && shift
           python3 -c "import kt_kernel; print('kt-kernel', kt_kernel.__cpu_variant__)"
           timeout 560 python3 -m benchmarks.decode_bench --out "$OUT/ktcpu$px" --layers 48 \
             --reps 3 --image-size "$px" --decode-tokens 16 \
             --configs ${KTCPU_CONFIGS:-kt-cpu:cpu_backend=kt-kernel kt-cpu:cpu_backend=kt-kernel,cpu_infer=16} \
             | tee "$OUT/ktcpu$px.txt" ;;
    ktquant) shift  # kt-kernel BF16 / INT8 / INT4 experts, LAYERS of the 48 layers (load time: quantization)
             layers=${1:-16}; [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]] && shift
             timeout 400 python3 -m benchmarks.decode_bench --out "$OUT/ktquant$layers" \
               --layers "$layers" --reps 3 --image-size 448 --decode-tokens 16 \
               --configs kt-cpu:cpu_backend=kt-kernel kt-cpu:cpu_backend=kt-kernel,cpu_dtype=int8 \
               kt-cpu:cpu_backend=kt-kernel,cpu_dtype=int4 | tee "$OUT/ktquant$layers.txt" ;;
    hybrid) shift  # VisMMOE hybrid decode in the graph (kt-kernel INT8 on misses) against lru and offload-only
            px=$1 budget=$2; shift 2
            timeout "${HYBRID_TIMEOUT:-590}" python3 -m benchmarks.decode_bench --out "$OUT/hybrid$px-$budget" --layers 48 \
              --reps 3 --image-size "$px" --decode-tokens 32 \
              --configs ${HYBRID_CONFIGS:-"lru:expert_budget=$budget" "offload:expert_budget=$budget" \
                "hybrid:expert_budget=$budget,$KT_INT8" "hybrid:expert_budget=$budget,$KT_INT8,miss_policy=cpu"} \
              | tee "$OUT/hybrid$px-$budget.txt" || true
            rows_up "$OUT/hybrid$px-$budget" ;;
    q8) shift  # the host store in Q8_0 / Q4_0 / Q4_K / Q5_K (a half to a quarter of the PCIe bytes per miss) vs BF16
        px=$1 budget=$2; shift 2
        timeout 570 python3 -m benchmarks.decode_bench --out "$OUT/q8-$px-$budget" --layers 48 --reps 3 \
          --image-size "$px" --decode-tokens 32 \
          --configs "lru:expert_budget=$budget" "offload:expert_budget=$budget" \
            "offload:expert_budget=$budget,store_dtype=q8_0" "offload:expert_budget=$budget,store_dtype=q4_0" \
            "offload:expert_budget=$budget,store_dtype=q4_k" "offload:expert_budget=$budget,store_dtype=q5_k" \
          | tee "$OUT/q8-$px-$budget.txt" ;;
    stores) shift
            timeout 300 python3 scripts/gpu_check.py --stores --out "$OUT/gpu_stores.json" | tee "$OUT/gpu_stores.txt" || echo "stores: failed (the stages after it still run)" ;;
    gpuprefill) shift
                timeout 300 python3 scripts/gpu_check.py --gpu-prefill --out "$OUT/gpu_prefill.json" | tee "$OUT/gpu_prefill.txt" ;;
    ggufwrite) shift
               timeout 560 python3 -m benchmarks.models.synthetic_gguf "$GGUF_DIR" --layers 48 | tee "$OUT/gguf_write.txt"
               cp "$GGUF_DIR/synthetic_gguf.json" "$OUT/" ;;
    gguf) shift  # VisMMOE from a Q4_K GGUF checkpoint against BF16 (lru, VisMMOE) and Q4_K quantized at load
          px=$1 budget=$2; shift 2
          [[ -f "$GGUF_DIR/synthetic_gguf.json" ]] || timeout 560 python3 -m benchmarks.models.synthetic_gguf "$GGUF_DIR" --layers 48
          # a process per configuration: each one's host RSS is its own (and a row survives a timeout)
          timeout "${GGUF_TIMEOUT:-570}" python3 -m benchmarks.decode_bench --out "$OUT/gguf-$px-$budget" \
            --layers 48 --reps 3 --image-size "$px" --decode-tokens 32 --isolate \
            --configs ${GGUF_CONFIGS:-"offload:expert_budget=$budget,gguf_path=$GGUF_DIR" "offload:expert_budget=$budget" \
              "lru:expert_budget=$budget" "offload:expert_budget=$budget,store_dtype=q4_k"} \
            | tee "$OUT/gguf-$px-$budget.txt" || true
          rows_up "$OUT/gguf-$px-$budget" ;;
    peer) shift  # llama.cpp's llama-bench on the same Q4_K GGUF, at the splits matching our budgets; under 570 s
          px=448
          if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then px=$1; shift; fi
          t0=$SECONDS
          parts=(.scratch/llama.cpp/llama-bench.xz.part-*)
          if [[ ! -f ${parts[0]} ]]; then echo "peer: no .scratch/llama.cpp/llama-bench.xz.part-* (carry .scratch/llama.cpp)" >&2; exit 2; fi
          cat "${parts[@]}" | xz -d > /tmp/llama-bench
          chmod +x /tmp/llama-bench
          [[ -f "$GGUF_DIR/synthetic_gguf.json" ]] || timeout 300 python3 -m benchmarks.models.synthetic_gguf "$GGUF_DIR" --layers 48
          # what is left of the stage's PEER_SECONDS (570); llama-bench gets at most 200 of it (5 splits, pp and tg, 2 depths)
          left=$(( ${PEER_SECONDS:-570} - (SECONDS - t0) ))
          timeout "$left" python3 -m benchmarks.decode_bench --out "$OUT/peer$px" --layers 48 --reps 3 \
            --image-size "$px" ${PEER_TEXT:+--text_tokens "$PEER_TEXT"} --decode-tokens 32 --routing synthetic \
            --configs ${PEER_CONFIGS:-"offload:expert_budget=1TiB,gguf_path=$GGUF_DIR" \
              "offload:expert_budget=6GiB,gguf_path=$GGUF_DIR" "lru:expert_budget=6GiB,gguf_path=$GGUF_DIR" \
              "offload:expert_budget=12GiB,gguf_path=$GGUF_DIR"} \
            --peer llama.cpp --peer-gguf "$GGUF_DIR/model-Q4_K.gguf" --llama-bench /tmp/llama-bench \
            --peer-threads 14 --peer-timeout $(( left > 260 ? 200 : left / 2 )) \
            | tee "$OUT/peer$px.txt" || true ;;
    peerbatch) shift  # 8 requests together, all resident: ours and llama-batched-bench, same GGUF, one call
          px=448
          if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then px=$1; shift; fi
          parts=(.scratch/llama-batched/llama-batched-bench.xz.part-*)  # built off this machine: scripts/build_llama_peer.sh
          [[ -f ${parts[0]} ]] || { echo "peerbatch: no .scratch/llama-batched/llama-batched-bench.xz.part-* (carry .scratch/llama-batched)" >&2; exit 2; }
          tool=/tmp/llama-batched-bench
          cat "${parts[@]}" | xz -d > "$tool" && chmod +x "$tool"
          # built elsewhere, its runpath may not be where this image keeps CUDA 13's runtime and cuBLAS: add
          # the toolkit's folders and torch's nvidia wheels (which carry both)
          nvlibs=$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, 'cu13', 'lib') for p in nvidia.__path__))" 2>/dev/null || true)
          peerlibs=$(ls -d /usr/local/cuda*/targets/x86_64-linux/lib /usr/local/cuda*/lib64 2>/dev/null | tr '\n' ':')$nvlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
          LD_LIBRARY_PATH=$peerlibs ldd "$tool" | grep "not found" || true
          [[ -f "$GGUF_DIR/synthetic_gguf.json" ]] || timeout 300 python3 -m benchmarks.models.synthetic_gguf "$GGUF_DIR" --layers 48
          timeout 330 python3 -m benchmarks.decode_bench --out "$OUT/peerbatch$px" --layers 48 --reps "${PEERBATCH_REPS:-3}" \
            --image-size "$px" --decode-tokens 128 --routing synthetic --concurrency 1 8 ${PEERBATCH_KERNELS:+--kernels} \
            --configs ${PEERBATCH_CONFIG:-offload:expert_budget=16GiB,gguf_path=$GGUF_DIR} \
            | tee "$OUT/peerbatch$px.txt" || true
          # llama.cpp routes by the random weights' own router; its experts all on the GPU (-ngl 99, no -ncmoe)
          # our prompt's length (a picture's tokens and the question), else 448 px's 236
          prompt=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['rows'][0]['prompt_tokens'])" \
            "$OUT/peerbatch$px/decode_bench.json" 2>/dev/null || echo 236)
          LD_LIBRARY_PATH=$peerlibs timeout 200 "$tool" -m "$GGUF_DIR/model-Q4_K.gguf" -ngl 99 -fa on -t 14 -c 8192 -b 2048 -ub 512 \
            -npp "$prompt" -ntg 128 -npl 1,8 2>&1 | tee "$OUT/peerbatch$px-llama.txt" | tail -8 || true ;;
    qslabs) shift  # quantized slabs: the GGUF's Q4_K blocks kept on the GPU too, decoded by the decode GEMVs
            px=$1 budget=$2; shift 2
            half=$(( ${budget%GiB} / 2 ))GiB
            GGUF_CONFIGS=${GGUF_CONFIGS:-"offload:expert_budget=$budget
              offload:expert_budget=$budget,gguf_path=$GGUF_DIR,slab_format=dequantized
              offload:expert_budget=$budget,gguf_path=$GGUF_DIR,slab_format=quantized
              offload:expert_budget=$half,gguf_path=$GGUF_DIR,slab_format=quantized"} \
              bash "$0" gguf "$px" "$budget" ;;
    batch) shift  # continuous batching: the single graphed request against N together, for each N
           px=$1; shift
           levels=()
           while [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; do levels+=("$1"); shift; done
           timeout "${BATCH_TIMEOUT:-570}" python3 -m benchmarks.decode_bench \
             --out "$OUT/batch$px${BATCH_TAG:-}" --layers 48 --reps 3 --image-size "$px" --decode-tokens 32 \
             --routing "${BATCH_ROUTING:-synthetic}" --concurrency "${levels[@]}" \
             --configs ${BATCH_CONFIGS:-"$RESIDENT" offload:expert_budget=16GiB} ${BATCH_ARGS:-} \
             | tee "$OUT/batch$px${BATCH_TAG:-}.txt" ;;
    batchoff) shift  # offloaded batching, one configuration per process (each loads its own store)
           px=$1; shift
           levels=()
           while [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; do levels+=("$1"); shift; done
           timeout "${BATCH_TIMEOUT:-570}" python3 -m benchmarks.decode_bench --out "$OUT/batchoff$px" \
             --layers 48 --reps 3 --image-size "$px" --decode-tokens 32 --routing synthetic --isolate \
             --concurrency "${levels[@]}" \
             --configs ${BATCH_CONFIGS:-offload:expert_budget=16GiB offload:expert_budget=16GiB,store_dtype=q4_k} ${BATCH_ARGS:-} \
             | tee "$OUT/batchoff$px.txt" || true
           rows_up "$OUT/batchoff$px" ;;
    kbatch) shift  # a batched step's resident experts: grouped GEMM, the table kernels, the expert-major kernels
            timeout 400 python3 -m benchmarks.decode_kernel_bench --out "$OUT/kbatch" --batch --tune \
              > "$OUT/kbatch.txt" 2>&1 || true
            tail -c 3000 "$OUT/kbatch.txt" ;;
    realblayer) shift  # ReaLB's MoE layer, each EP rank's expert compute on one GPU: R ranks x N requests
              for spec in ${REALB_RUNS:-2x16 4x16 8x16 8x32 8x64}; do
                timeout 170 python3 -m benchmarks.realb_layer_bench --out "$OUT/realblayer-$spec" \
                  --ranks "${spec%x*}" --requests "${spec#*x}" ${REALB_ARGS:-} 2>&1 | tee "$OUT/realblayer-$spec.txt" | tail -7 || true
              done ;;
    kqbatch) shift  # the same step on Q4_K slabs: GEMVs token by token, in one launch, the quantized expert-major kernels
             # KQBATCH_ARGS= (empty): the tuned tiles alone, no sweep (about a minute)
             timeout 500 python3 -m benchmarks.decode_kernel_bench --out "$OUT/kqbatch" --batch --quantized \
               ${KQBATCH_ARGS---tune} > "$OUT/kqbatch.txt" 2>&1 || true
             tail -c 3000 "$OUT/kqbatch.txt" ;;
    epdp) shift  # nvidia-h200-x2: expert parallelism over both GPUs (NCCL), BF16 / ReaLB / ReaLB-seq: one request
          # (rank 0's, the other rank serving its experts), then N requests on every rank (data parallel, lockstep)
          px=$1; shift
          levels=()
          while [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; do levels+=("$1"); shift; done
          timeout 570 torchrun --nproc-per-node 2 -m benchmarks.bench --synthetic qwen3-vl-30b-a3b --layers 48 \
            --image-sizes "$px" --warmup 1 --repeats 3 --decode-tokens 16 --routing synthetic:0 --profile \
            --configs ${EP_CONFIGS:-ep ep-graphs ep-realb ep-realb-seq ep-lowprec-all} --concurrency "${levels[@]}" --output "$OUT/epdp$px" \
            2>&1 | tail -40 | tee "$OUT/epdp$px.txt" || true ;;
    compare) shift  # before/after in one call: DIR's code, then this tree's, each in its own process
             ref=$1; shift
             for side in "$ref" .; do
               name=$([[ $side == . ]] && echo after || echo before)
               (cd "$side" && PYTHONPATH=. timeout ${COMPARE_TIMEOUT:-260} python3 -m benchmarks.decode_bench --out "$OUT/$name" --layers 48 \
                  --reps 2 --image_size 448 --decode_tokens 32 --routing synthetic --kernels \
                  --configs ${COMPARE_CONFIGS:-"$RESIDENT" offload:expert_budget=16GiB,store_dtype=q4_k} | tee "$OUT/$name.txt") || true
               rm -f "$OUT/$name"/trace-*
             done ;;
    kqcompare) shift  # the quantized slabs' GEMVs alone: DIR's code at its tuned shapes, then this tree's sweep
               ref=$1; shift
               formats=${KQ_FORMATS:-q4_k,q4_k:bytes,q8_0,q5_k}
               [[ $ref == - ]] || (cd "$ref" && PYTHONPATH=. timeout ${KQ_TIMEOUT:-150} python3 -m benchmarks.decode_kernel_bench \
                  --out "$OUT/kq-before" --quantized --formats "$formats" > "$OUT/kq-before.txt") || true
               PYTHONPATH=. timeout ${KQ_TUNE_TIMEOUT:-400} python3 -m benchmarks.decode_kernel_bench --out "$OUT/kq-after" \
                 --quantized --tune --formats "$formats" ${KQ_FORMS:+--forms "$KQ_FORMS"} > "$OUT/kq-after.txt" || true
               [[ $ref == - ]] || grep -E '"(tuned|us_per_layer|gb_s|relative_error_vs_dequantized)"|"q[0-9]' "$OUT/kq-before.txt" || true
               tail -n 8 "$OUT/kq-after.txt" ;;
    prefillk) shift  # a prompt's experts on Q4_K slabs, kernels alone (PK_TUNE=1: the expert-major tiles swept
                     # at PK_TUNE_TOKENS tokens, 512)
              # (PK_ADOPT=1 with PK_TUNE: the fastest written into this machine's tuning.json for the stages after)
              timeout ${PK_TIMEOUT:-300} python3 -m benchmarks.prefill_kernel_bench --out "$OUT/prefillk" \
                ${PK_TUNE:+--tune --tune-tokens ${PK_TUNE_TOKENS:-512} ${PK_ADOPT:+--adopt}} | tee "$OUT/prefillk.txt" \
                || true ;;
    prefillncu) shift  # ncu (the hardware counters; Firecracker machines) on the prompt's expert kernels, each
                       # tile form twice at PN_TOKENS (236) tokens: time, occupancy, issue slots, stall reasons
              ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
              [[ -n $ncu ]] || { echo "prefillncu: no ncu on this machine" >&2; exit 2; }
              timeout ${PN_TIMEOUT:-200} "$ncu" --clock-control none -k regex:"_(gate_up|down)_q_" -c 12 \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                --section SchedulerStats --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
                python3 -m benchmarks.prefill_kernel_bench --out "$OUT/prefillncu" --profile-once ${PN_TOKENS:-236} \
                > "$OUT/prefillncu.txt" 2>&1 || echo "prefillncu: ncu failed (its output: prefillncu.txt)"
              grep -E "profiled:|_q_(rows|blocks)|Duration|Warp Cycles Per Issued|Occupancy|Issue Slots Busy|Registers Per|Throughput|stalled_" \
                "$OUT/prefillncu.txt" | grep -vE " 0(\.0+)?$" | cut -c1-140 | head -150 || true ;;
    tilesab) shift  # the resident prompt under tuning alternatives in turn, one process (benchmarks/tiles_ab.py;
                    # TILESAB_ARGS: its --alt flags, --rounds, --text-tokens)
             [[ -f "$GGUF_DIR/synthetic_gguf.json" ]] || timeout 300 python3 -m benchmarks.models.synthetic_gguf "$GGUF_DIR" --layers 48
             timeout ${TILESAB_TIMEOUT:-300} python3 -m benchmarks.tiles_ab --out "$OUT/tilesab.json" \
               --config "offload:expert_budget=1TiB,gguf_path=$GGUF_DIR" ${TILESAB_ARGS:---text-tokens 508} \
               | tee "$OUT/tilesab.txt" || true ;;
    timeline) shift  # a resident prompt's host issue against the GPU, layer by layer, and the host's time by part
              [[ -f "$GGUF_DIR/synthetic_gguf.json" ]] || timeout 300 python3 -m benchmarks.models.synthetic_gguf "$GGUF_DIR" --layers 48
              parts=(.scratch/llama.cpp/llama-bench.xz.part-*)
              if [[ -f ${parts[0]} ]]; then  # llama.cpp's prompt rates on the same file, for scale
                cat "${parts[@]}" | xz -d > /tmp/llama-bench && chmod +x /tmp/llama-bench
                timeout 60 /tmp/llama-bench -m "$GGUF_DIR/model-Q4_K.gguf" -ngl 99 -ncmoe 0 -fa 1 -t 14 -p 236,508 -n 0 \
                  -r 5 2>&1 | grep -E "pp[0-9]" | tee "$OUT/timeline-llama.txt" || true
              fi
              timeout ${TIMELINE_TIMEOUT:-200} python3 -m benchmarks.prompt_timeline --out "$OUT/timeline" \
                --config "offload:expert_budget=1TiB,gguf_path=$GGUF_DIR" --text-tokens 508 --split ${TIMELINE_ARGS:-} \
                2>&1 | grep -vE "^Writing|it/s\]" | tee "$OUT/timeline.txt" || true ;;
    tower) shift  # the vision tower alone: DIR's code (before), then this tree's (after)
           ref=""
           if [[ $# -gt 0 && -d $1 ]]; then ref=$1; shift; fi
           for side in ${ref:+"$ref"} .; do
             name=$([[ $side == . ]] && echo after || echo before)
             (cd "$side" && PYTHONPATH=. timeout ${TOWER_TIMEOUT:-120} python3 -m benchmarks.vision_tower_bench \
                --out "$OUT/tower-$name" --image-sizes 448 896 ${TOWER_ARGS:-} > "$OUT/tower-$name.txt" 2>&1) || true
             grep -E "^[0-9]+ px|^==|^ +[0-9.]+ us" "$OUT/tower-$name.txt" | sed "s/^/$name /" || true
           done ;;
    prefillcompare) shift  # the same kernels' rows in DIR's code (before), then in this tree's (after)
              ref=$1; shift
              for side in "$ref" .; do
                name=$([[ $side == . ]] && echo after || echo before)
                (cd "$side" && PYTHONPATH=. timeout ${PK_TIMEOUT:-150} python3 -m benchmarks.prefill_kernel_bench \
                   --out "$OUT/prefill-$name" > "$OUT/prefill-$name.txt" 2>&1) || true
                grep "expert-major" "$OUT/prefill-$name.txt" | sed "s/^/$name /" || true
              done ;;
    defaults) shift  # the default rules (qwen3vl.yaml: VisMMOE whole) against lru at the same budgets, per PX
              configs=${DEFAULTS_CONFIGS:-"vismmoe:expert_budget=16GiB lru:expert_budget=16GiB vismmoe:expert_budget=32GiB
                lru:expert_budget=32GiB vismmoe:expert_budget=6GiB,store_dtype=q4_k lru:expert_budget=6GiB,store_dtype=q4_k"}
              # a BF16 configuration at 896 px takes about 90 s (a 55 s load, 2 reps of 128 tokens)
              n=$(wc -w <<< "$configs")
              for px in "${@:-448}"; do
                [[ $px =~ ^[0-9]+$ ]] || break
                shift || true
                timeout ${DEFAULTS_TIMEOUT:-$(( n * 100 < 570 ? n * 100 : 570 ))} python3 -m benchmarks.decode_bench \
                  --out "$OUT/defaults$px" --layers 48 --reps 2 --image_size "$px" --decode_tokens ${DEFAULTS_TOKENS:-128} \
                  --routing synthetic --configs $configs | tee "$OUT/defaults$px.txt" || true
                rows_up "$OUT/defaults$px"
              done ;;
    promptab) shift  # lru's and the default rules' prompts and decodes in turn, one process (the host's drift cancels)
              px=896
              if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then px=$1; shift; fi
              q=expert_budget=6GiB,store_dtype=q4_k
              timeout ${PROMPTAB_TIMEOUT:-560} python3 -m benchmarks.prompt_ab --out "$OUT/promptab$px.json" \
                --configs ${PROMPTAB_CONFIGS:-"lru:$q" "vismmoe:$q"} --image-size "$px" --rounds ${PROMPTAB_ROUNDS:-4} \
                --decode-tokens 127 2>&1 | grep -vE "^Writing|it/s\]" | tee "$OUT/promptab$px.txt" || true ;;
    prompts) shift  # where the default rules' prompt loses to lru's: each configuration's prompt after a decode, layer by layer
             px=896
             if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then px=$1; shift; fi
             q=expert_budget=6GiB,store_dtype=q4_k
             dirs=()
             configs=(${PROMPTS_CONFIGS:-"vismmoe:$q" "lru:$q" "vismmoe:$q,keep_ratio=1.0" "vismmoe:$q,pinned_layers=0"})
             # PROMPTS_BEFORE=DIR: the first configuration in DIR's code first (a tree before a change, carried)
             for c in ${PROMPTS_BEFORE:+"before:${configs[0]}"} "${configs[@]}"; do
               side=.; [[ $c == before:* ]] && side=$PROMPTS_BEFORE
               d="$OUT/prompts$px/$(tr -c 'A-Za-z0-9=.\n-' _ <<< "$c")"
               (cd "$side" && PYTHONPATH=.:$PYTHONPATH timeout ${PROMPTS_TIMEOUT:-110} python3 -m benchmarks.prompt_timeline \
                  --out "$d" --config "${c#before:}" --image-size "$px" --rounds 3 --decode-tokens 127 2>&1 \
                  | grep -vE "^Writing|it/s\]" | tail -3) && dirs+=("$d")
             done
             python3 -m benchmarks.prompt_compare "${dirs[@]}" | tee "$OUT/prompts$px.md" || true
             if [[ -d $OUT/prompts$px ]]; then tar czf "$OUT/prompts$px.tar.gz" -C "$OUT" "prompts$px" && rm -rf "$OUT/prompts$px"; fi ;;
    whatif) shift  # #46: the affinity what-if in the bench, end to end: lru, VisMMOE without and with compression
            px=${1:-1344}; budget=${2:-16GiB}; strength=${3:-0.283}
            shift $(( $# < 3 ? $# : 3 ))
            routing=synthetic
            [[ $strength == 0 ]] || routing="synthetic:affinity=$strength"  # 0: the calibrated router itself
            timeout ${WHATIF_TIMEOUT:-570} python3 -m benchmarks.decode_bench --out "$OUT/whatif-$px-$budget-$strength" \
              --layers 48 --reps 2 --image_size "$px" --decode_tokens ${WHATIF_TOKENS:-128} --routing "$routing" \
              --configs ${WHATIF_CONFIGS:-lru:expert_budget=$budget offload:expert_budget=$budget \
                vismmoe:expert_budget=$budget} | tee "$OUT/whatif-$px-$budget-$strength.txt" || true
            rows_up "$OUT/whatif-$px-$budget-$strength" ;;
    hosttrace) shift
               timeout 240 python3 -m benchmarks.decode_bench --out "$OUT/hosttrace" --layers 48 --reps 1 --image_size 448 \
                 --decode_tokens 16 --routing synthetic --kernels --configs ${HOSTTRACE_CONFIGS:-"$RESIDENT"} \
                 | tee "$OUT/hosttrace.txt" || true
               python3 -m benchmarks.host_trace "$OUT"/hosttrace/trace-*.json.gz | tee "$OUT/host_trace.txt"
               rm -f "$OUT"/hosttrace/trace-* ;;
    family) shift  # #24: bench rows for a non-Qwen family (its own rule files: benchmarks/bench/configs.py RULE_FILES)
            px=448
            if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then px=$1; shift; fi
            model=${MODEL:-deepseek-ocr2}
            timeout "${FAMILY_TIMEOUT:-570}" python3 -m benchmarks.bench --synthetic "$model" ${MODEL_LAYERS:+--layers "$MODEL_LAYERS"} \
              --image-sizes "$px" --warmup 1 --repeats 3 --decode-tokens 32 --routing synthetic:0 --cpu_infer 12 \
              --configs ${FAMILY_CONFIGS:-all-on-gpu all-pinned lru vismmoe-full} --budgets "${FAMILY_BUDGET:-30%}" \
              --output "$OUT/family-$model-$px" 2>"$OUT/family-$model-$px.err" | tee "$OUT/family-$model-$px.txt" || true
            tail -5 "$OUT/family-$model-$px.err" ;;
    bench) shift
           while [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; do
             bash scripts/bench_h200.sh "$1" "$OUT" 2>"$OUT/bench_part$1.err" | tee "$OUT/bench_part$1.txt"
             tail -3 "$OUT/bench_part$1.err"
             shift
           done ;;
    ablation) shift  # #19's ladder at one BUDGET in two processes (each writes its own bench.json, so a
                     # late timeout loses the second half only): lru, base, +compress; then +predict, -full
              budget=$1; shift; t0=$SECONDS
              args=(--synthetic qwen3-vl-30b-a3b --layers 48 --image-sizes 448 896 --warmup 1 --repeats 3
                    --decode-tokens 16 --cpu_infer 12 --routing synthetic:0 --budgets "$budget"
                    --predictor benchmarks/results/2026-11-30/predictor-synthetic-48x128/predictor.pt)
              timeout 330 python3 -m benchmarks.bench "${args[@]}" --configs lru vismmoe-base vismmoe+compress \
                --output "$OUT/ablation-$budget-a" 2>"$OUT/ablation-$budget-a.err" | tee "$OUT/ablation-$budget-a.txt" || true
              timeout $((585 - (SECONDS - t0))) python3 -m benchmarks.bench "${args[@]}" --configs vismmoe+predict \
                vismmoe-full --output "$OUT/ablation-$budget-b" 2>"$OUT/ablation-$budget-b.err" | tee "$OUT/ablation-$budget-b.txt" ;;
    routing) shift  # #46: train (resumable across calls), evaluate, then the affinity study, in one call's 585 s
             dir=${ROUTING_DIR:-/tmp/routing} t0=$SECONDS
             export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing is downloaded: the model is built in code
             if [[ ! -f $dir/training.json ]]; then
               args=(--device cuda --out "$dir" --spec "${ROUTING_SPEC:-routing-12x64}" --steps "${ROUTING_STEPS:-1500}"
                     --batch "${ROUTING_BATCH:-64}" --workers "${ROUTING_WORKERS:-14}" --checkpoint_every 500
                     --no_progress --stop_after "${ROUTING_TRAIN_SECONDS:-330}" --eval_per_type 64 --pruned_eval
                     --pruned_per_type "${ROUTING_PRUNED_PER_TYPE:-32}" --keep 0.7,0.5 --prune_layer 2
                     $([[ -n ${ROUTING_FP32:-} ]] || echo --bf16) ${ROUTING_ARGS---lr 3e-3 --describe_share 0.25 --simple_steps 500})
               # --bf16 unless ROUTING_FP32=1 (a step in half float32's time on an H100, 2026-12-05); ROUTING_ARGS: the
               # recipe's flags, the same in every call of a run (unset:
               # the recipe the CPU runs of 2026-12-04/05 found, 32,000 simple scenes first; set empty: none)
               [[ -f $dir/checkpoint.pt ]] && args+=(--resume)
               rc=0
               timeout $((570 - (SECONDS - t0))) python3 scripts/train_routing_model.py "${args[@]}" 2>&1 \
                 | tee -a "$OUT/routing_train.txt" || rc=$?
               case $rc in
                 0) ;;
                 3) echo "routing: training stopped at its time limit (checkpoint in $dir): run the stage again" ;;
                 124) echo "routing: cut by the call's limit (the last checkpoint in $dir): run the stage again" ;;
                 *) echo "routing: training failed (status $rc)" >&2; exit "$rc" ;;
               esac
             fi
             [[ -f $dir/training.json ]] && cp "$dir/training.json" "$OUT/"
             left=$((585 - (SECONDS - t0)))
             if [[ -f $dir/training.json && ! -f $dir/study/affinity_study.json && $left -ge 150 ]]; then
               timeout "$left" python3 -m benchmarks.affinity_study --task scenes --model "$dir" --device cuda \
                 --out "$dir/study" --prompts "${ROUTING_STUDY_PROMPTS:-8}" --train-prompts 8 --keeps 0.3,0.5,0.7 \
                 --depths 1,2,3,4 --keep-traces 2>&1 | tee "$OUT/affinity_study.txt" \
                 || echo "routing: the study did not finish (run the stage again)"
             elif [[ -f $dir/training.json && ! -f $dir/study/affinity_study.json ]]; then
               echo "routing: ${left} s left, too few for the study: run the stage again"
             fi
             if [[ -f $dir/study/affinity_study.json ]]; then
               cp "$dir"/study/affinity_study.{json,md} "$OUT/"
               # the traces without pruning and at keep 0.5 (about 60 kB a request compressed; all of them would
               # pass the 16 MiB a returned file may have)
               (cd "$dir/study" && tar czf "$OUT/affinity_traces.tar.gz" traces/none traces/train-none traces/*-0.5-*)
               ls -l "$OUT/affinity_traces.tar.gz"
             fi ;;
    routingprof) shift  # #46: where a training step of routing-12x64 goes, float32 against the BF16 experts
                 export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
                 for precision in fp32 bf16; do
                   rm -rf "/tmp/routing-profile-$precision"
                   timeout ${ROUTINGPROF_TIMEOUT:-150} python3 scripts/train_routing_model.py --device cuda --out "/tmp/routing-profile-$precision" \
                     --spec routing-12x64 --steps 7 --batch "${ROUTING_BATCH:-64}" --workers "${ROUTING_WORKERS:-14}" \
                     --no_progress --eval_per_type 0 --watch_per_type 0 --profile_steps 4 \
                     $([[ $precision == bf16 ]] && echo --bf16) 2>&1 | grep -v Warning \
                     | tee "$OUT/routing_profile_$precision.txt" || echo "routingprof: $precision failed"
                 done ;;
    fits) shift  # every decode expert resident: the offloaded step's own cost against the all-resident one
          python3 scripts/fitting_trace.py "$OUT/fits.safetensors" --working-set 32 >/dev/null
          timeout 500 python3 -m benchmarks.decode_bench --out "$OUT/fits" --layers 48 --reps 5 \
            --decode-tokens 32 --routing "trace:$OUT/fits.safetensors" \
            --configs "$RESIDENT" lru:expert_budget=32GiB offload:expert_budget=32GiB \
            | tee "$OUT/decode_fits.txt"
          timeout 200 python3 -m benchmarks.decode_bench --out "$OUT/resident448" --layers 48 --reps 5 \
            --decode-tokens 32 --configs hf "$RESIDENT" | tee "$OUT/decode_resident448.txt" ;;
    *) echo "unknown stage $1 (check, routing, compare DIR, tower [DIR], prefillk, prefillcompare DIR, hosttrace, kernel, decode [PX], predict PX BUDGET, kernels PX BUDGET, ktcpu [PX], ktquant [LAYERS], hybrid PX BUDGET, q8 PX BUDGET, stores, ggufwrite, gguf PX BUDGET, peer [PX], peerbatch [PX], qslabs PX BUDGET, batch PX N..., batchoff PX N..., kbatch, kqbatch, epdp PX N..., fits, smoke, family [PX], bench PART..., defaults PX..., prompts [PX], whatif [PX BUDGET STRENGTH], tilesab, timeline, realblayer, kqcompare DIR, ablation BUDGET, routingprof)" >&2; exit 2 ;;
  esac
done
