"""Offload runtime benchmark: all-on-GPU vs `lru` vs VisMMOE offload-only, same run, same inputs.

Builds Qwen3-VL-30B-A3B's shapes with random weights on the machine (no download, nothing written),
once per configuration, and measures prefill latency (image + short prompt, to the first token) and
decode tokens/s, plus the runtime's copy bandwidth and the share of copy time hidden behind compute.

    PYTHONPATH=. python3 bench/offload_bench.py --out DIR [--layers 48] \
        [--configs gpu pinned lru:16GiB vismmoe:16GiB lru:32GiB vismmoe:32GiB]

`gpu` is stock Hugging Face with everything on the GPU; `pinned` is our runtime with a budget that
pins every layer (our compute path, no transfers); `POLICY:BUDGET` are the offload runtimes.

Random weights route almost uniformly: hit rates and prefetch value are not a trained model's.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vismmoe_kt import stats as runtime_stats  # noqa: E402
from vismmoe_kt.chat_session import TimingStreamer  # noqa: E402
from vismmoe_kt.operators.vis_experts import VisExperts  # noqa: E402
from vismmoe_kt.synthetic import load_synthetic  # noqa: E402

RULES = {"gpu": "optimize_rules/qwen3vl-gpu.yaml", "vismmoe": "optimize_rules/qwen3vl-offload.yaml",
         "lru": "optimize_rules/qwen3vl-lru.yaml", "pinned": "optimize_rules/qwen3vl-offload.yaml",
         "hybrid": "optimize_rules/qwen3vl.yaml", "ktcpu": "optimize_rules/qwen3vl-kt-cpu.yaml"}
NAMES = {"gpu": "all-on-GPU (stock HF)", "pinned": "all pinned (our runtime, no transfers)",
         "lru": "lru", "vismmoe": "vismmoe offload-only", "hybrid": "vismmoe hybrid (miss_policy auto)",
         "ktcpu": "KTransformers-style: every routed expert on the CPU"}
RUNTIME_KEYS = ("bytes_copied", "copy_seconds", "stall_seconds", "evictions", "prefetches", "fetches",
                "prefill_hits", "prefill_late", "prefill_misses", "decode_hits", "decode_late", "decode_misses",
                "prefill_cpu_experts", "decode_cpu_experts", "prefill_cpu_wait_seconds", "decode_cpu_wait_seconds")


def make_inputs(processor, size: int):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[prompt], images=[image], return_tensors="pt").to("cuda:0")


class _NoText:
    """Stands in for the tokenizer: random-weight tokens are not worth decoding while timing."""

    @staticmethod
    def decode(*args, **kwargs) -> str:
        return ""


def timed_generate(model, inputs, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s over the rest)."""
    streamer = TimingStreamer(_NoText(), io.StringIO())
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=tokens, do_sample=False, streamer=streamer)
    torch.cuda.synchronize()
    end = time.perf_counter()
    first = streamer.token_times[0]
    return first - start, (tokens - 1) / (end - first)


def runtime_figures(model) -> dict:
    ops = runtime_stats(model)["operators"].get("VisExperts")
    return {k: ops.get(k, 0) for k in RUNTIME_KEYS} if ops else {}


def cpu_backend_of(model) -> str | None:
    for section in runtime_stats(model)["operators"].values():
        if "cpu_backend" in section:
            return section["cpu_backend"]
    return None


def close(model) -> None:
    """Stop the runtime's worker so nothing keeps the model alive; the caller drops its references."""
    for module in model.modules():
        if isinstance(module, VisExperts):
            module.runtime.close()
            break


def run_config(name: str, policy: str, budget: str | None, args) -> dict:
    overrides = {"expert_budget": budget} if budget else {}
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model, processor = load_synthetic(rules=RULES[policy], layers=args.layers, progress=False, **overrides)
    load_s = time.perf_counter() - start
    inputs = make_inputs(processor, args.image_size)
    timed_generate(model, inputs, 3)  # warm-up: kernels, allocator, first copies
    before = runtime_figures(model)
    prefill, decode = [], []
    for _ in range(args.reps):
        p, d = timed_generate(model, inputs, args.decode_tokens)
        prefill.append(p)
        decode.append(d)
    after = runtime_figures(model)
    delta = {k: after[k] - before[k] for k in after}
    row = {
        "config": name, "policy": policy, "expert_budget": budget, "load_s": round(load_s, 1),
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "prefill_s_median": statistics.median(prefill), "prefill_s_min": min(prefill), "prefill_s_max": max(prefill),
        "decode_tok_s_median": statistics.median(decode), "decode_tok_s_min": min(decode), "decode_tok_s_max": max(decode),
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "experts_impl": getattr(model.config.get_text_config(), "_experts_implementation", None),
        "cpu_backend": cpu_backend_of(model),
    }
    if delta:
        ops = runtime_stats(model)["operators"]["VisExperts"]
        row.update(pinned_layers=ops["pinned_layers"], slabs=ops["slabs"], **delta)
        copy_s = delta["copy_seconds"]
        row["copy_gb_s"] = delta["bytes_copied"] / copy_s / 1e9 if copy_s else None
        row["hidden_copy_fraction"] = 1 - delta["stall_seconds"] / copy_s if copy_s else None
    close(model)
    del model, processor, inputs  # host memory (store, kt-kernel's copy) must be free before the next load
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--configs", nargs="+",
                        default=["gpu", "pinned", "lru:16GiB", "vismmoe:16GiB", "lru:32GiB", "vismmoe:32GiB"])
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    configs = []
    for spec in args.configs:
        policy, _, budget = spec.partition(":")
        if policy not in RULES:
            parser.error(f"unknown config {spec!r}")
        if policy == "pinned":
            budget = "1TiB"  # more than every layer: Eq. 10 pins them all
        configs.append((NAMES[policy] + (f" @ {budget}" if policy in ("lru", "vismmoe", "hybrid") else ""), policy, budget or None))
    rows = [run_config(name, policy, budget, args) for name, policy, budget in configs]
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
            "image_size": args.image_size, "decode_tokens": args.decode_tokens, "reps": args.reps,
            "date": time.strftime("%Y-%m-%d"), "routing": "random weights (near-uniform routing)"}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tag = "-".join(c.replace(":", "") for c in args.configs)
    (Path(args.out) / f"offload_bench-{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\n{meta}\n")
    print("| config | prefill s (median, min-max) | decode tok/s (median, min-max) | copy GB/s | copy hidden | hits/late/misses (decode) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        copy = f"{r['copy_gb_s']:.1f}" if r.get("copy_gb_s") else "-"
        hidden = f"{100 * r['hidden_copy_fraction']:.0f}%" if r.get("hidden_copy_fraction") is not None else "-"
        hits = f"{r['decode_hits']}/{r['decode_late']}/{r['decode_misses']}" if "decode_hits" in r else "-"
        print(f"| {r['config']} | {r['prefill_s_median']:.3f} ({r['prefill_s_min']:.3f}-{r['prefill_s_max']:.3f}) | "
              f"{r['decode_tok_s_median']:.2f} ({r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f}) | {copy} | {hidden} | {hits} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
