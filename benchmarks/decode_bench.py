"""Decode speed: transformers' generation vs our lean decode path, same run, same inputs.

    PYTHONPATH=. python3 -m benchmarks.decode_bench --out DIR [--model NAME] [--layers N] [--profile]
        [--configs hf offload:expert_budget=1TiB,graphs=cuda offload:expert_budget=16GiB lru:expert_budget=30%]
    PYTHONPATH=. python3 -m benchmarks.decode_bench --out DIR --model deepseek-ocr2 \
        --configs hf offload:expert_budget=1TiB,graphs=cuda lru:expert_budget=30% offload:expert_budget=30%
    PYTHONPATH=. python3 -m benchmarks.decode_bench --out DIR --device cpu --tiny tiny-6x64   # a CPU sanity run

A configuration is `NAME` or `NAME:key=value,key=value` (benchmarks/configurations.py): NAME is `hf` (stock
transformers, no rules: the reference whose greedy tokens the others are compared with), a placement
(vismmoe, gpu, offload, lru, hybrid, kt-cpu, realb, ep) resolved for the model's family to its generated rule
file exactly as `--placement` does (`vismmoe-kt rules list`), or a rule file's path; the kwargs are what
chat and serve take as `--set key=value`, applied the same way: any kwarg of the rule file, the engine's
decode=lean|hf and graphs=auto|cuda|replay|off, cpu_infer=N, and gguf_path=DIR (the weights from that GGUF
checkpoint, e.g. one `python -m benchmarks.models.synthetic_gguf DIR` wrote, instead of made in memory). A key
the rules do not have is refused before anything loads, with --set's message. The spec as given labels the row.

`--model` picks the synthetic model (qwen3-vl-30b-a3b, deepseek-ocr2, glm-4.5v, ...: benchmarks/models/synthetic.py;
`--narrow`: deepseek-ocr2's layout at CPU-sized widths) and so the family whose rule files the placements name.
An expert_budget is a size (16GiB) or a share of the model's routed experts (30%: the offload runtime resolves it).

Configurations used in scripts/device_session.sh (all greedy, batch 1, an image prompt):
  offload:expert_budget=1TiB,graphs=off     our decode path, every expert resident, no graphs
  offload:expert_budget=1TiB,graphs=cuda    the same with each step captured in a CUDA graph
  offload:expert_budget=16GiB               experts offloaded to the host beyond 16 GiB (graphs auto)
  lru:expert_budget=16GiB                   the same with the LRU cache policy (no pinned prefix, no prefetch)
  offload:...,store_dtype=q4_k              the host store in Q4_K blocks (q8_0, q4_0, q5_k): a half to a
                                            quarter of the PCIe bytes per fetched expert
  offload:...,slab_format=quantized         the slabs keep a quantized store's blocks, the decode GEMVs decode
                                            them (dequantized: the model's dtype; auto: quantized where it works)
  offload:...,pinned_layers=N               N pinned layers instead of the automatic depth (Eq. 10's range,
                                            then runtime/prefix_depth.py's predicted time per token)
  offload:...,predictor=PATH[,prefetch_min_probability=P,prefetch_topk=B,prefetch_stride=S]
                                            the lookahead predictor (prefetching inside the decode graph), a
                                            predictor.pt from `vismmoe-kt calibrate` (`calibrate synthetic` for
                                            synthetic routing)
  offload:...,batch_experts=expert-major    with --concurrency: a batched step's resident experts through the
                                            expert-major kernels (table, grouped-gemm; auto: table up to
                                            batch_table_pairs pairs, then expert-major)
  hybrid:expert_budget=16GiB,cpu_backend=kt-kernel,cpu_dtype=int8[,miss_policy=cpu]
                                            VisMMOE's hybrid mode: each layer's misses split between PCIe reads
                                            and kt-kernel's INT8 copy by the cost model, the CPU's calls inside
                                            the step's graph; miss_policy=cpu: every miss to the CPU
  kt-cpu:cpu_backend=kt-kernel[,cpu_infer=N,cpu_dtype=int4]
                                            every routed expert on the CPU through kt-kernel, N workers
                                            (default physical cores - 2), BF16 or quantized at load
  kt-cpu:...,gpu_prefill_tokens=64[,gpu_prefill_share=F|auto]
                                            KTransformers' dual prefill: prompts of 64 tokens or more run each
                                            layer's experts on the GPU from a host copy sent a layer ahead
  offload:...,gguf_path=DIR                 loaded from a GGUF checkpoint; with store_dtype auto its quantized
                                            experts stay in their format in the host store
The old spellings (lean:16GiB+q4k, hybrid:16GiB+cpu, kt-cpu:16+int4, ...) and their translations:
benchmarks/results/README.md.

Per configuration, after warm-up requests of the measured length (again while the last one captured a decode
graph, at most three: a trial of the default rules settling in the first request changes the decode step's
variant, and the spans that request had passed are captured in the next), so that no rep pays a capture:
load seconds (weights made or read, quantized, placed), prefill seconds, decode tokens/s (median and range over --reps;
from the tokens' arrivals; each rep's too, with its prompt's seconds and its longest gap between tokens), the gaps
between tokens (p50 and p95 over every rep), how many greedy
tokens agree with `hf` from the start, GPU peak and host RSS, and for offloaded ones the expert bytes
that crossed PCIe per decode token (copies, and misses the decode kernels read in place), the decode
hit rate, and the physical bound max(bytes per token / copy bandwidth measured in this run, the time per
token of the first configuration with every expert resident and every step graphed); for kt-cpu rows the
expert bytes the CPU reads per token and the host
bandwidth that implies (a floor: the step's GPU work is in the time too), and a prefill's split: the vision
tower's time, the CPU experts' calls and the GB/s of expert weights those read if they read them all.

Configurations whose CPU experts may be kt-kernel's (cpu_backend kt-kernel or auto) each run in a process of
their own when there are several: kt-kernel never frees an expert layer's weights, so a second one would start with the
first's host memory still taken (`--isolate` runs every configuration so). `--turns N` also times an
N-turn chat about one image (prompt seconds per turn: the lean path prefills only each turn's new
tokens). `--profile` adds one profiled request per lean configuration: seconds per step by piece
(embed, attention + router per layer, experts per layer, head), each piece timed to its end.

`--concurrency N [N...]` also decodes N requests together (engine/runner.py: steps in CUDA graphs per
power-of-two batch size where the configuration's decode is graphed), for each N: tokens per second
over the run and while all N decode, against the single request's rate, and for offloaded
configurations the expert bytes over PCIe per generated decode token (each request gets its own
routing table, request i of the source's seeds in turn).

Routing: `--routing synthetic` (the default for the full-size model: random weights route almost
uniformly, so their own routing would make hit rates and bytes per token meaningless), `model` or
`trace:PATH`.

`--peer llama.cpp --peer_gguf FILE [--llama_bench PATH]` (PATH also from $LLAMA_BENCH, else llama-bench
on PATH) then runs llama.cpp's llama-bench on that GGUF (e.g. the model-Q4_K.gguf
`python -m benchmarks.models.synthetic_gguf DIR` writes) at the `-ncmoe N` split matching each
configuration's expert_budget (the smallest N whose layers N..L-1's experts fit in it; kt-cpu: N = L;
no budget: N = 0) and at 0 and L, with our prompt's length as -p and as the decode depth -d, our timed
decode steps as -n (--peer_threads, --peer_reps, --peer_timeout), and prints and writes
peer_llama_cpp.json and peer_llama_cpp.md: per configuration our decode tok/s beside llama.cpp's tg at
that split and depth, the ratio, our prefill tokens/s beside its pp. llama.cpp's rows route by the random
weights' own router and place experts statically per layer; ours carry their routing source
(benchmarks/peers/llama_cpp.py).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


from vismmoe_kt import load
from benchmarks.bench.bandwidth import measure_copy_bandwidth
from benchmarks.bench.concurrency import concurrent_requests, decode_pcie_bytes, measure_concurrency, percentile
from benchmarks.bench.inputs import make_request, text_request
from benchmarks.bench.timing import profile_decode, timed_generate, warm_up
from benchmarks.kernel_timeline import profile_kernels, profile_run
from vismmoe_kt.engine.runner import PREFILL_BUDGET
from vismmoe_kt.engine.decoding import decode_engine
from vismmoe_kt.engine.generation import generate
from benchmarks.configurations import Configuration, parse_configuration
from benchmarks.peers.llama_cpp import PeerError, find_llama_bench, peer_report, read_expert_layout
from benchmarks.models.synthetic import DEFAULT_MODEL, SYNTHETIC_MODELS, load_synthetic, total_layers
from vismmoe_kt.demo.tiny import SPECS, save_tiny_model
from vismmoe_kt.errors import VismmoeError
from vismmoe_kt.operators.cpu_experts import CpuExperts
from vismmoe_kt.runtime.host_memory import empty_host_cache, host_resident_bytes
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

DEFAULT_CONFIGS = ["hf", "offload:expert_budget=1TiB,graphs=off", "offload:expert_budget=1TiB,graphs=cuda",
                   "offload:expert_budget=16GiB", "offload:expert_budget=32GiB"]


def runtime_of(model):
    return model.vismmoe.context.offload_runtime


def family_of(args) -> str:
    """The model type (`config.model_type`) whose placements the configurations name (gguf_path: that
    checkpoint's own)."""
    return SPECS[args.tiny].family if args.tiny else SYNTHETIC_MODELS[args.model]["family"]


def load_model(args, config: Configuration):
    """The configuration's model: its rules and settings as `--set` would apply them, the weights from its
    gguf_path (load()'s keyword), the tiny model or the synthetic one."""
    settings = {"generate_device": args.device, "prefill_device": args.device, **config.settings}
    rules = config.routed(args.routing, family_of(args))  # every configuration replays the same requests' routing
    if config.gguf_path:
        start = time.perf_counter()
        model, processor = load(config.gguf_path, rules, progress=False, **settings)
        model.vismmoe.load_seconds = time.perf_counter() - start
        model.generation_config.eos_token_id = None  # random weights: decode the requested number of tokens
    elif args.tiny_dir:
        model, processor = load(args.tiny_dir, rules, progress=False, **settings)
    else:
        model, processor = load_synthetic(args.model, rules, layers=args.layers, dtype=args.dtype,
                                          narrow=args.narrow, progress=False, **settings)
    return model, processor


def _decode_hit_rate(runtime) -> float | None:
    counters = [c for c in runtime.counters["decode"].values()]
    needed = sum(c.hits + c.late + c.misses for c in counters)
    return sum(c.hits + c.late for c in counters) / needed if needed else None


PLACEMENTS = ("hits", "late", "misses", "cpu", "cpu_seconds")  # LayerCounters' fields, summed over the layers


def _prefill_placements(runtime) -> dict[str, float]:
    """The prompts' offloaded experts so far, by how each was placed: resident (hits), landed from a copy the
    layer waited on (late: a streamed layer's), fetched after the routing read (misses), computed by the CPU
    (the hybrid mode's share, and the host's wait on it)."""
    counters = list(runtime.counters["prefill"].values())
    return {field: sum(getattr(c, field) for c in counters) for field in PLACEMENTS}


def _decode_cpu_share(runtime) -> float | None:
    """Hybrid mode: the share of offloaded layers' decode pairs the CPU computed."""
    counters = list(runtime.counters["decode"].values())
    pairs = sum(c.hits + c.late + c.misses + c.cpu for c in counters)
    return sum(c.cpu for c in counters) / pairs if pairs and runtime.cpu is not None else None


def agreeing_prefix(a: torch.Tensor, b: torch.Tensor | None) -> int | None:
    if b is None:
        return None
    same = (a[:len(b)] == b[:len(a)]).long()
    return int(same.cumprod(0).sum())


def conversation(model, processor, args) -> list[float]:
    """Seconds to the first token of each turn of a chat about one image (median over --reps chats)."""
    from vismmoe_kt.engine.chat import ChatSession

    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (args.image_size, args.image_size, 3),
                                                              dtype=np.uint8))
    per_turn: list[list[float]] = [[] for _ in range(args.turns)]
    engine = decode_engine(model)
    for _ in range(args.reps):
        if engine is not None:  # each chat starts cold (the previous one left the same first turn cached)
            engine.forget()
        session = ChatSession(model, processor, max_new_tokens=args.decode_tokens, greedy=True)
        for turn in range(args.turns):
            _, timings = session.ask(f"Question {turn}: what else is in the picture?", [image] if turn == 0 else [],
                                     out=io.StringIO())
            per_turn[turn].append(timings.prompt_seconds)
    return [statistics.median(t) for t in per_turn]


def batched_run(model, processor, args, n: int, spec: str) -> dict:
    """--concurrency N: N requests, each with its own image of the same size, decoded together
    (benchmarks/bench/concurrency.py): aggregate and full-batch rates, TTFT and inter-token latency,
    PCIe bytes per generated token; the batched step's graph counters; how many of each request's
    tokens equal its tokens alone (with --kernels, one more run under torch.profiler: the batched
    steps' kernels)."""

    offload = runtime_of(model)
    requests = concurrent_requests(processor, n, args.image_size, args.device)
    trace = Path(args.out) / f"trace-batch{n}-{re.sub(r'[^A-Za-z0-9.=-]+', '_', spec)}.json.gz"
    source = model.vismmoe.context.routing
    timed = source.requests + n if source is not None else 0  # the timed run's first table: after the warm-up's

    def alone(i: int, request: dict, tokens: int) -> list[int]:
        if source is not None:
            source.requests = timed + i  # the table request i had in the timed run
        engine = decode_engine(model)
        if engine is not None:  # prefill cold: a prompt equal to the reps' would reuse their KV, routed by their tables
            engine.forget()
        with torch.inference_mode():
            out = generate(model, dict(request), tokens, min_new_tokens=tokens)
        return out[0, request["input_ids"].shape[1]:].tolist()

    with torch.inference_mode():  # as the single-request runs: the runtime's lazily made banks are inference tensors
        return measure_concurrency(model, requests, args.decode_tokens,
                                   (lambda: decode_pcie_bytes(offload)) if offload is not None else None,
                                   args.prefill_chunk or None, args.prefill_budget,
                                   (lambda run: profile_run(run, trace)) if args.kernels else None, alone)


class PrefillSplit:
    """Host time of a model's prefills spent in its vision tower (timed on the host, the device synchronized
    around it) and in CPU expert calls of more than one token (CpuExperts' `prefill_cpu_seconds`: a prefill's
    calls wait on the host), from creation until `per_prefill`."""

    def __init__(self, model):
        self.vision_s, self._start = 0.0, None
        self._experts = [m for m in model.modules() if isinstance(m, CpuExperts)]
        self._cpu_before = sum(m.counters.prefill_cpu_seconds for m in self._experts)
        tower = model.vismmoe.adapter.vision_tower(model)
        self._hooks = [tower.register_forward_pre_hook(lambda *_: self._begin()),
                       tower.register_forward_hook(lambda *_: self._end())]

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _begin(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _end(self) -> None:
        self._sync()
        self.vision_s += time.perf_counter() - self._start

    def per_prefill(self, prefills: int) -> dict:
        """The split per prefill; the timing hooks come off (later runs in this process go unsynchronized)."""
        for hook in self._hooks:
            hook.remove()
        out = {"prefill_vision_s": self.vision_s / prefills}
        if self._experts:
            out["prefill_cpu_expert_s"] = (sum(m.counters.prefill_cpu_seconds for m in self._experts) - self._cpu_before) / prefills
        return out


def _pruning(model) -> tuple[int, int, float] | None:
    """(prefills that pruned visual tokens, the tokens they kept, the host's seconds choosing them) so far, where
    the text model prunes; None where it cannot. From a prompt's host facts the choice waits for nothing on the
    device, so this is the host's own time; without them it includes waiting for the tower and the prefix."""
    text_forward = getattr(model.vismmoe.context, "text_forward", None)
    if text_forward is None:
        return None
    c = text_forward.counters
    return c.pruned_prefills, c.tokens_after, c.compression_seconds


def run_config(config: Configuration, args, reference: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    spec = config.label
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        model, processor = load_model(args, config)
    except VismmoeError as exc:  # a value the operators refuse: their message, no traceback
        raise SystemExit(f"--configs {spec}: {exc}") from None
    inputs = text_request(processor, args.text_tokens, args.device) if args.text_tokens \
        else make_request(processor, args.image_size, args.device)
    warm_ups = warm_up(model, inputs, args.decode_tokens - 1)  # one, and more while they capture graphs
    runtime = runtime_of(model)
    copied = decode_pcie_bytes(runtime) if runtime else 0
    # what the measured requests' prompts copied into slabs, the routing reads the placement path made, the
    # copies' seconds and the compute stream's waits on them
    before = runtime.summary() if runtime else None
    prompt_before = (before["bytes_copied_prefill"], runtime.host_reads, before["prefill_copy_seconds"],
                     before["prefill_stall_seconds"], _prefill_placements(runtime)) if runtime else None
    pruning_before = _pruning(model)
    split = PrefillSplit(model)  # where the measured prefills' time goes (vision tower, CPU experts)
    prefill, decode, gaps, longest, tokens = [], [], [], [], None
    for _ in range(args.reps):
        timed = timed_generate(model, inputs, args.decode_tokens - 1)  # the first token is the prefill's
        prefill.append(timed.prefill_s)
        decode.append(timed.decode_tok_s)
        gaps += timed.gaps_s
        longest.append(max(timed.gaps_s, default=0.0))
        tokens = timed.tokens
    row_split = split.per_prefill(args.reps)
    row = {"config": spec, "rules": config.rule_file, "settings": config.settings, "load_s": model.vismmoe.load_seconds,
           "prompt_tokens": int(inputs["input_ids"].shape[1]),
           "warm_ups": warm_ups, "decode_tok_s_reps": decode, "prefill_s_reps": prefill,
           # each rep's longest wait between tokens: a slow rep with one long gap stalled once (a capture, a
           # collection), one without it ran every step slower
           "token_gap_ms_max_reps": [1e3 * g for g in longest],
           "prefill_s_median": statistics.median(prefill), "prefill_s_min": min(prefill),
           "prefill_s_max": max(prefill), "decode_tok_s_median": statistics.median(decode),
           "decode_tok_s_min": min(decode), "decode_tok_s_max": max(decode),
           # inter-token latency over every rep's gaps: the median, and the tail a client notices
           "token_gap_ms_p50": 1e3 * statistics.median(gaps) if gaps else None,
           "token_gap_ms_p95": 1e3 * percentile(gaps, 0.95) if gaps else None,
           "tokens_agreeing_with_hf": agreeing_prefix(tokens, reference), **row_split}
    pruning_after = _pruning(model)
    if pruning_after is not None and pruning_after[0] > pruning_before[0]:  # visual tokens pruned: how many kept, at what cost
        pruned = pruning_after[0] - pruning_before[0]
        row.update(prompt_tokens_kept=(pruning_after[1] - pruning_before[1]) / pruned,
                   compression_ms=1e3 * (pruning_after[2] - pruning_before[2]) / pruned)
    if args.turns > 1:  # a conversation: later turns re-send the history (the lean path reuses its cache)
        row["turn_prompt_s"] = conversation(model, processor, args)
    backend = model.vismmoe.context.cpu_backend or (runtime.cpu if runtime is not None else None)
    if backend is not None:
        row["cpu_backend"] = backend.describe()
        if getattr(backend, "layers", None) and runtime is None:  # every routed expert on the CPU: the bytes read
            per_token = len(backend.layers) * backend.top_k * backend.host_bytes / len(backend.layers) / backend.num_experts
            row["cpu_expert_bytes_per_token"] = per_token
            row["cpu_expert_gb_s"] = per_token * row["decode_tok_s_median"] / 1e9  # a floor: the step has GPU work too
            if row.get("prefill_cpu_expert_s"):  # a prefill of hundreds of tokens reaches about every expert
                row["prefill_cpu_expert_gb_s"] = backend.host_bytes / row["prefill_cpu_expert_s"] / 1e9
    gpu_prefill = model.vismmoe.context.gpu_prefill
    if gpu_prefill is not None and gpu_prefill.counters.prefills:  # KTransformers' dual prefill (kt-cpu+gpuprefill)
        c = gpu_prefill.settle()  # the copies' and stalls' timings read back
        row.update(gpu_prefill_copy_s=c.copy_seconds / c.prefills, gpu_prefill_stall_s=c.stall_seconds / c.prefills,
                   gpu_prefill_host_between_s=c.host_seconds_between / c.prefills,
                   gpu_prefill=gpu_prefill.describe(), gpu_prefill_prefills=c.prefills,
                   gpu_prefill_gb_per_prefill=c.bytes_copied / c.prefills / 1e9,
                   gpu_prefill_gpu_share=c.gpu_experts / (c.gpu_experts + c.cpu_experts))
    if runtime is not None:
        summary = runtime.summary()
        used, wasted = summary["decode_prefetch_used"], summary["decode_prefetch_wasted"]
        row.update(prefill_gb_copied=(summary["bytes_copied_prefill"] - prompt_before[0]) / args.reps / 1e9,
                   routing_reads_per_request=(runtime.host_reads - prompt_before[1]) / args.reps)
        # the copies' own time and the compute stream's waits on them, a prompt (what a copy-bound prompt costs)
        row.update(prefill_copy_s=(summary["prefill_copy_seconds"] - prompt_before[2]) / args.reps,
                   prefill_stall_s=(summary["prefill_stall_seconds"] - prompt_before[3]) / args.reps)
        # a prompt's experts by placement: the default rules and lru copy alike, so a prompt slower than lru's
        # shows here whether it waited on the CPU's share or fetched what the stream did not cover
        row["prefill_placements"] = {field: (count - prompt_before[4][field]) / args.reps
                                     for field, count in _prefill_placements(runtime).items()}
        row.update(pinned_layers=summary["pinned_layers"], slabs=summary["slabs"], store=runtime.store.fmt,
                   decode_bytes_per_token=(decode_pcie_bytes(runtime) - copied) / (args.reps * (args.decode_tokens - 1)),
                   decode_hit_rate=_decode_hit_rate(runtime), decode_prefetches=summary["decode_prefetches"],
                   decode_prefetch_precision=used / (used + wasted) if used + wasted else None,
                   decode_cpu_share=_decode_cpu_share(runtime), eviction=summary["eviction"],
                   reservations=summary["reservations"])
        trial = getattr(runtime.miss, "trial", None)
        if trial is not None and trial.describe():  # hybrid auto: kept or dropped the CPU's share, measured
            row["cpu_quota_trial"] = trial.describe()
    engine = decode_engine(model)
    if engine is not None:
        row["lean"] = engine.stats()
        if args.profile:
            row["profile"] = profile_decode(model, inputs, args.decode_tokens - 1)
    if any(n > 1 for n in args.concurrency):
        row["batched"] = [batched_run(model, processor, args, n, spec) for n in args.concurrency if n > 1]
    if args.kernels:
        trace = Path(args.out) / f"trace-{re.sub(r'[^A-Za-z0-9.=-]+', '_', spec)}.json.gz"
        trace.parent.mkdir(parents=True, exist_ok=True)
        row["kernels"] = profile_kernels(model, inputs, args.decode_tokens - 1, trace)
    if args.device.startswith("cuda"):
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["host_rss_gib"] = host_resident_bytes() / 2**30
    if runtime is not None:
        runtime.close()
    del model, processor, inputs
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        empty_host_cache()
    print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    return row, tokens


def run_isolated(config: Configuration, args, reference: torch.Tensor | None) -> tuple[dict | None, torch.Tensor | None]:
    """`run_config` in a child process (this module again, one configuration): whatever host memory
    the configuration's native libraries keep goes with the process. The child writes its row and
    greedy tokens under OUT/isolated/<config>. A child that fails is reported and its row left out
    (the other configurations still run and are written)."""
    spec = config.label
    out = Path(args.out) / "isolated" / re.sub(r"[^A-Za-z0-9.=-]+", "_", spec)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out), "--configs", spec,
               "--model", args.model, "--dtype", args.dtype, "--device", args.device, "--image_size", str(args.image_size),
               "--decode_tokens", str(args.decode_tokens), "--reps", str(args.reps), "--turns", str(args.turns),
               "--routing", args.routing, "--child"]
    command += ["--tiny", args.tiny] if args.tiny else []
    command += ["--text_tokens", str(args.text_tokens)] if args.text_tokens else []
    command += ["--layers", str(args.layers)] if args.layers is not None else []
    command += ["--narrow"] if args.narrow else []
    command += ["--concurrency", *map(str, args.concurrency)]
    command += ["--prefill_chunk", str(args.prefill_chunk), "--prefill_budget", str(args.prefill_budget)]
    command += [flag for flag, on in (("--profile", args.profile), ("--kernels", args.kernels)) if on]
    if reference is not None:
        torch.save(reference, out / "reference.pt")
        command += ["--reference", str(out / "reference.pt")]
    done = subprocess.run(command)
    if done.returncode:
        print(f"--configs {spec}: its process exited with status {done.returncode} (output above); "
              "left out of the table", file=sys.stderr, flush=True)
        return None, None
    row = json.loads((out / "decode_bench.json").read_text())["rows"][0]
    return row, torch.load(out / "tokens.pt")


def is_resident_graphed(row: dict) -> bool:
    """A row on our runtime whose decode moved no expert bytes, every step in a CUDA graph (e.g.
    offload:expert_budget=1TiB,graphs=cuda): its time per token is the decode step's own, without transfers."""
    lean = row.get("lean") or {}
    return row.get("decode_bytes_per_token") == 0 and lean.get("steps", 0) > 0 and lean["graphed_steps"] == lean["steps"]


def kernel_report(rows: list[dict]) -> str:
    """Per configuration (and its --concurrency runs, "config xN"): wall, busy, idle and overlapped
    device time per decode step, then its top kernels."""
    profiled = [(r["config"], r.get("kernels") or {}) for r in rows]
    profiled += [(f"{r['config']} x{b['requests']}", b.get("kernels") or {}) for r in rows for b in r.get("batched", [])]
    profiled = [(label, k) for label, k in profiled if k.get("kernels")]
    lines = ["| config | wall ms/step | device busy | idle | of it, gaps of the host (> 20 us) | overlapped | per stream |",
             "|---|---|---|---|---|---|---|"]
    for label, k in profiled:
        streams = ", ".join(f"{s}: {ms:.2f}" for s, ms in k["streams_ms_per_step"].items())
        wall = f"{k['wall_ms_per_step']:.2f}" if "wall_ms_per_step" in k else "-"
        host = f"{k['long_gaps_ms_per_step']:.2f} ({k['long_gaps_per_step']:.1f} a step)" if "long_gaps_ms_per_step" in k else "-"
        lines.append(f"| {label} | {wall} | {k['busy_ms_per_step']:.2f} "
                     f"| {k['idle_ms_per_step']:.2f} | {host} | {k['overlap_ms_per_step']:.2f} | {streams} |")
    for label, k in profiled:
        if k.get("kernels"):
            lines += ["", f"{label} ({k['window']}), top kernels:", "", "| kernel | ms/step | calls/step |",
                      "|---|---|---|"]
            lines += [f"| `{t['name']}` | {t['ms_per_step']:.3f} | {t['calls_per_step']:.1f} |" for t in k["top_kernels"]]
        prefill = k.get("prefill") or {}
        if prefill.get("kernels"):
            lines += ["", f"{label}, the prefill before it: {prefill['window_ms_per_step']:.2f} ms from its first kernel "
                      f"to its last, {prefill['busy_ms_per_step']:.2f} busy, {prefill['kernels']} kernels; top kernels:",
                      "", "| kernel | ms | calls |", "|---|---|---|"]
            lines += [f"| `{t['name']}` | {t['ms_per_step']:.3f} | {t['calls_per_step']:.0f} |"
                      for t in prefill["top_kernels"][:15]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the results (decode.json, the table, profiles)")
    parser.add_argument("--configs", nargs="+", metavar="NAME[:KEY=VALUE,...]", default=DEFAULT_CONFIGS,
                        help="configurations to time: hf, a placement or a rule file, each with --set's "
                             f"key=value settings (the docstring above; default: {' '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                        help=f"the synthetic model ({', '.join(SYNTHETIC_MODELS)}; default %(default)s): its published "
                             "shapes with random weights, and its family's rule files")
    parser.add_argument("--layers", type=int, help="synthetic model: keep the first N decoder layers (default: all)")
    parser.add_argument("--narrow", action="store_true",
                        help="synthetic model: the family's layout at CPU-sized widths (deepseek-ocr2), for sanity runs")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="synthetic model: the weights' dtype (default %(default)s; float32 is faster on a CPU)")
    parser.add_argument("--tiny", help="a tiny random model (e.g. tiny-6x64) instead of the synthetic full-size one")
    parser.add_argument("--device", default="cuda:0", help="where the model runs")
    parser.add_argument("--image_size", type=int, default=448, help="square image size of each request, in pixels")
    parser.add_argument("--text_tokens", type=int, default=0,
                        help="a text-only prompt of this many tokens instead of the picture (--image_size): what "
                             "llama.cpp's pp N measures; batch 1 only")
    parser.add_argument("--decode_tokens", type=int, default=32, help="decoded tokens timed per request")
    parser.add_argument("--reps", type=int, default=3, help="timed requests per configuration (median reported)")
    parser.add_argument("--profile", action="store_true", help="also time each lean decode piece per layer")
    parser.add_argument("--kernels", action="store_true",
                        help="one more request per configuration under torch.profiler: decode kernels by name and "
                             "stream, busy and idle device time per step (kernels.md and a trace-*.json.gz each)")
    parser.add_argument("--turns", type=int, default=1, help="also time a chat of this many turns (prompt seconds per turn)")
    parser.add_argument("--routing", help="model | synthetic[:SEED][:affinity=A] | trace:PATH (default: synthetic for the synthetic "
                                          "model, model for --tiny)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1],
                        help="also decode N requests together, for each N given (batched generation): aggregate "
                             "tokens/s, the rate while all N run, PCIe bytes per generated token")
    parser.add_argument("--prefill_chunk", type=int, default=0,
                        help="with --concurrency: prompt tokens prefilled per step beside the others' decode (0: whole)")
    parser.add_argument("--prefill_budget", type=int, default=PREFILL_BUDGET,
                        help="with --concurrency and whole prompts: prompt tokens prefilled together in one forward "
                             "(default: %(default)s; 0: one prompt per step)")
    parser.add_argument("--isolate", action="store_true",
                        help="every configuration in a process of its own (kt-kernel ones always are)")
    parser.add_argument("--peer", choices=["llama.cpp"],
                        help="after the configurations, run that program's benchmark on --peer_gguf at the matching "
                             "expert splits and write the side-by-side table (peer_llama_cpp.json, .md)")
    parser.add_argument("--peer_gguf", metavar="FILE", help="with --peer: the GGUF model file llama-bench loads")
    parser.add_argument("--llama_bench", metavar="PATH", help="with --peer llama.cpp: the llama-bench binary "
                                                             "(default: $LLAMA_BENCH, else llama-bench on PATH)")
    parser.add_argument("--peer_threads", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="with --peer: llama-bench's -t (CPU threads for the CPU's experts)")
    parser.add_argument("--peer_reps", type=int, default=3, help="with --peer: llama-bench's -r")
    parser.add_argument("--peer_timeout", type=float, default=300, help="with --peer: seconds llama-bench may run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one configuration of --isolate
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # hf's greedy tokens, for a child's agreement
    args = parser.parse_args()
    if args.model not in SYNTHETIC_MODELS:
        parser.error(f"--model {args.model!r}: unknown synthetic model; choose one of {', '.join(SYNTHETIC_MODELS)}")
    if args.layers is not None and not 1 <= args.layers <= total_layers(args.model):
        parser.error(f"--layers must be in 1..{total_layers(args.model)} for {args.model}, got {args.layers}")
    if args.narrow and "narrow" not in SYNTHETIC_MODELS[args.model]:
        parser.error(f"--narrow: {args.model} has no narrow variant")
    if args.tiny and args.tiny not in SPECS:
        parser.error(f"--tiny {args.tiny!r}: unknown tiny model; choose one of {', '.join(SPECS)}")
    if args.text_tokens < 0 or (args.text_tokens and (args.concurrency != [1] or args.turns > 1)):
        parser.error("--text_tokens must be a count >= 0, and goes with batch-1 requests only (no --concurrency, "
                     "no --turns)")
    try:  # every configuration checked before the first loads
        configs = [parse_configuration(spec, family_of(args)) for spec in args.configs]
    except VismmoeError as exc:
        parser.error(str(exc))
    peer = None
    if (args.peer_gguf or args.llama_bench) and not args.peer:
        parser.error("--peer_gguf and --llama_bench go with --peer llama.cpp")
    if args.peer:  # the model file and the binary checked before the first configuration loads
        if not args.peer_gguf:
            parser.error("--peer llama.cpp needs --peer_gguf FILE (the GGUF llama-bench loads)")
        try:
            layout = read_expert_layout(args.peer_gguf)
        except PeerError as exc:
            parser.error(f"--peer_gguf {exc}")
        try:
            peer = layout, find_llama_bench(args.llama_bench)
        except PeerError as exc:
            parser.error(str(exc))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (use --device cpu with --tiny for a sanity run)")
    graphed = [c.label for c in configs if c.settings.get("graphs") == "cuda"]
    if graphed and not args.device.startswith("cuda"):
        parser.error(f"--configs {graphed[0]}: graphs=cuda captures CUDA graphs: it needs --device cuda")
    args.routing = args.routing or ("model" if args.tiny else "synthetic")
    args.tiny_dir = None
    if args.tiny:
        root = tempfile.mkdtemp(prefix="decode-bench-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        args.tiny_dir = save_tiny_model(root, args.tiny, seed=0)
    torch.manual_seed(0)
    rows, reference = [], torch.load(args.reference) if args.reference else None
    several = len(args.configs) > 1 and not args.child
    for config in configs:
        isolate = several and (args.isolate or config.uses_kt_kernel())
        row, tokens = (run_isolated if isolate else run_config)(config, args, reference)
        if row is None:
            continue
        if args.child:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            torch.save(tokens, Path(args.out) / "tokens.pt")
        if config.is_reference and reference is None:
            reference = tokens
        rows.append(row)
    cuda = args.device.startswith("cuda") and not args.child  # a page-locked host -> device copy, what a slab fetch gets
    bandwidth = measure_copy_bandwidth(torch.device(args.device))["bytes_per_s"] / 1e9 if cuda else None
    resident = next((r for r in rows if is_resident_graphed(r)), None)  # the compute floor of a decode step
    for r in rows:
        if "decode_bytes_per_token" in r and bandwidth:
            bound = r["decode_bytes_per_token"] / (bandwidth * 1e9)
            if resident:
                bound = max(bound, 1 / resident["decode_tok_s_median"])
            r["bound_s_per_token"] = bound
            r["ratio_to_bound"] = (1 / r["decode_tok_s_median"]) / bound if bound else None
    meta = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "model": args.tiny or (f"{args.model} shapes{' at narrow widths' if args.narrow else ''}, "
                                   f"{args.layers or total_layers(args.model)} of {total_layers(args.model)} layers, "
                                   f"{args.dtype}"),
            "family": family_of(args),
            "image_size": None if args.text_tokens else args.image_size, "text_tokens": args.text_tokens or None,
            "decode_tokens": args.decode_tokens, "reps": args.reps,
            "copy_gb_s": bandwidth, "date": time.strftime("%Y-%m-%d"),
            "routing": args.routing + (" (the random weights' own, near-uniform routing)" if args.routing == "model" else "")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\n{meta}\n")
    print("| config | load s | prefill s (median) | decode tok/s (median, min-max) | token gap ms (p50, p95) "
          "| x hf | tokens = hf | PCIe bytes/token | decode hits | prefetch precision | CPU share | vs bound | graphed steps | GPU peak "
          "| host RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    hf = next((r for r in rows if r["config"] in {c.label for c in configs if c.is_reference}), None)
    for r in rows:
        speedup = f"{r['decode_tok_s_median'] / hf['decode_tok_s_median']:.2f}" if hf else "-"
        per_token = f"{r['decode_bytes_per_token'] / 1e6:.1f} MB" if "decode_bytes_per_token" in r else "-"
        bound = f"{r['ratio_to_bound']:.2f}x" if r.get("ratio_to_bound") else "-"
        agree = "-" if r["tokens_agreeing_with_hf"] is None else f"{r['tokens_agreeing_with_hf']}/{args.decode_tokens}"
        hits = f"{100 * r['decode_hit_rate']:.0f}%" if r.get("decode_hit_rate") is not None else "-"
        precision = f"{100 * r['decode_prefetch_precision']:.0f}%" if r.get("decode_prefetch_precision") is not None else "-"
        cpu_share = f"{100 * r['decode_cpu_share']:.0f}%" if r.get("decode_cpu_share") is not None else "-"
        lean = r.get("lean") or {}
        graphed = f"{lean['graphed_steps']}/{lean['steps']}" if lean else "-"
        peak = f"{r['peak_gib']:.1f} GiB" if "peak_gib" in r else "-"
        load_s = f"{r['load_s']:.1f}" if r.get("load_s") is not None else "-"
        gap = f"{r['token_gap_ms_p50']:.1f}, {r['token_gap_ms_p95']:.1f}" if r.get("token_gap_ms_p50") else "-"
        print(f"| {r['config']} | {load_s} | {r['prefill_s_median']:.3f} | {r['decode_tok_s_median']:.2f} "
              f"({r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f}) | {gap} | {speedup} | {agree} | {per_token} | {hits} "
              f"| {precision} | {cpu_share} | {bound} | {graphed} | {peak} | {r['host_rss_gib']:.1f} GiB |")
    for r in rows:
        if r.get("prefill_gb_copied") is not None:
            vision = r.get("lean", {})
            replayed = f", the vision tower replayed {vision['vision_graph_replays']} times" \
                if "vision_graph_replays" in vision else ""
            pruned = f"; {r['prompt_tokens_kept']:.0f} of {r['prompt_tokens']} prompt tokens kept past the prefix, " \
                f"chosen in {r['compression_ms']:.2f} ms" if "prompt_tokens_kept" in r else ""
            counts = r.get("prefill_placements")
            placed = f"; its experts {counts['hits']:.0f} resident, {counts['late']:.0f} landed late, " \
                f"{counts['misses']:.0f} fetched, {counts['cpu']:.0f} on the CPU ({counts['cpu_seconds']:.3f} s " \
                f"waiting on it)" if counts else ""
            print(f"{r['config']}: a prompt copied {r['prefill_gb_copied']:.2f} GB into slabs (copies "
                  f"{r['prefill_copy_s']:.3f} s, the layers waiting on them {r['prefill_stall_s']:.3f} s); "
                  f"{r['routing_reads_per_request']:.0f} routing reads a request{replayed}{pruned}{placed}")
        if r.get("prefill_cpu_expert_s"):
            print(f"{r['config']}: a prefill's {r['prefill_s_median']:.3f} s: vision tower {r['prefill_vision_s']:.3f} s, "
                  f"CPU experts {r['prefill_cpu_expert_s']:.3f} s ({r.get('prefill_cpu_expert_gb_s', 0):.1f} GB/s of "
                  f"expert weights if it reads them all), the rest (the GPU's layers, copies) "
                  f"{r['prefill_s_median'] - r['prefill_vision_s'] - r['prefill_cpu_expert_s']:.3f} s")
        if r.get("gpu_prefill"):
            print(f"{r['config']}: {r['gpu_prefill']}; {r['gpu_prefill_gb_per_prefill']:.2f} GB over PCIe per prefill, "
                  f"{100 * r['gpu_prefill_gpu_share']:.0f}% of the prefill layers' experts on the GPU; per prefill the "
                  f"copies took {r['gpu_prefill_copy_s']:.3f} s, the compute stream waited on them {r['gpu_prefill_stall_s']:.3f} s, "
                  f"the host spent {r['gpu_prefill_host_between_s']:.3f} s between the layers' calls")
    for r in rows:
        if r.get("cpu_quota_trial"):
            print(f"{r['config']}: {r['cpu_quota_trial']}")
    for r in rows:
        for b in r.get("batched") or []:
            full = b["full_batch_decode_tok_s"]
            ratio = f" ({full / r['decode_tok_s_median']:.2f}x one request)" if full else ""
            pcie = b.get("decode_bytes_per_token")
            bytes_note = "" if pcie is None or not r.get("decode_bytes_per_token") else \
                f"; {pcie / 1e6:.1f} MB over PCIe per token ({pcie / r['decode_bytes_per_token']:.2f}x one request)"
            itl = "" if b.get("itl_p95_s") is None else \
                f"; inter-token p95 {b['itl_p95_s'] * 1e3:.1f} ms ({b['itl_p95_s'] * r['decode_tok_s_median']:.2f}x one request's)"
            print(f"{r['config']}: {b['requests']} requests together: {b['aggregate_tok_s']:.2f} tok/s over the run, "
                  f"{f'{full:.2f}' if full else '-'} tok/s while all {b['requests']} decode{ratio}; "
                  f"{b['graphed_steps']}/{b['steps']} steps graphed{itl}{bytes_note}; tokens equal to each request "
                  f"alone: {100 * float(np.mean(b['tokens_agreeing_alone'])):.0f}%")
    if args.kernels:
        report = kernel_report(rows)
        (out / "kernels.md").write_text(report)
        print("\n" + report)
    if args.turns > 1:
        print("\n| config | " + " | ".join(f"turn {t + 1} prompt s" for t in range(args.turns)) + " |")
        print("|---" * (args.turns + 1) + "|")
        for r in rows:
            print(f"| {r['config']} | " + " | ".join(f"{t:.3f}" for t in r["turn_prompt_s"]) + " |")
    if peer is not None and rows:
        try:
            peer_report(configs, rows, *peer, out, routing=args.routing.split(":")[0], decode_tokens=args.decode_tokens,
                        threads=args.peer_threads, reps=args.peer_reps, timeout=args.peer_timeout)
        except PeerError as exc:  # our rows are written already; llama.cpp's failure in its own words
            print(f"--peer llama.cpp: {exc}", file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
