"""Accuracy cost of quantized CPU experts: kt-kernel INT8 / INT4 against its BF16 experts, at Qwen3-VL-30B-A3B's
expert shapes (2048 hidden, 768 intermediate, 128 experts, top 8); with `--store`, the offload
runtime's host store in Q8_0 / Q4_0 / Q4_K / Q5_K (`store_dtype`, dequantized into the GPU's slabs) against BF16.

    python3 -m benchmarks.cpu_quant_accuracy --out DIR [--layers 2] [--tokens 64] [--store]

With `--store` the model runs under optimize_rules/qwen3vl-lru.yaml (no pinned layer: every expert
comes from the store) with a 3 GiB budget, on the CPU.

The synthetic full-size model (random weights, `--layers` of its 48 decoder layers) under
optimize_rules/qwen3vl-kt-cpu.yaml, once per `cpu_dtype`, on the same text prompt of `--tokens`
random tokens: the relative L2 error of every position's logits against the BF16 experts, the share
of positions whose top-1 token agrees, and the relative error of the last MoE layer's output (its
input already carries the earlier layers' errors). Random weights give nearly flat logits, so top-1
flips far more easily than in a trained model. The trained demo model cannot be measured
this way: its sizes (hidden 96, intermediate 64) are below what kt-kernel's INT8 (multiples of 64)
and INT4 (multiples of 128) kernels take.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.models.synthetic import load_synthetic
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

RULES = "optimize_rules/qwen3vl-kt-cpu.yaml"
DTYPES = ("bf16", "int8", "int4")
STORE_RULES = "optimize_rules/qwen3vl-lru.yaml"
STORE_DTYPES = ("model", "q8_0", "q4_0", "q4_k", "q5_k")


def run(dtype: str, layers: int, ids: torch.Tensor, threads: int | None, store: bool = False) -> dict:
    if store:
        rules, operator = STORE_RULES, "VisExperts"
        extra = {"store_dtype": dtype, "expert_budget": "3GiB"}
    else:
        rules, operator = RULES, "CpuExperts"
        extra = {"cpu_backend": "kt-kernel", "cpu_dtype": dtype, **({"cpu_infer": threads} if threads else {})}
    start = time.perf_counter()
    model, _ = load_synthetic(rules=rules, layers=layers, progress=False, generate_device="cpu",
                              prefill_device="cpu", **extra)
    loaded = time.perf_counter() - start
    outputs: list[torch.Tensor] = []
    experts = [m for m in model.modules() if type(m).__name__ == operator][-1]
    hook = experts.register_forward_hook(lambda module, args, out: outputs.append(out.detach().float()))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    hook.remove()
    backend = f"store {dtype}" if store else model.vismmoe.context.cpu_backend.describe()
    runtime = model.vismmoe.context.offload_runtime
    if runtime is not None:
        runtime.close()
    del model
    return {"logits": logits, "layer_out": outputs[-1], "load_s": loaded, "backend": backend}


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True,
                        help="directory for cpu_quant_accuracy.json (store_quant_accuracy.json with --store)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept of the synthetic model's 48")
    parser.add_argument("--tokens", type=int, default=64, help="random prompt tokens compared")
    parser.add_argument("--threads", type=int, help="kt-kernel workers (default: physical cores - 2)")
    parser.add_argument("--store", action="store_true", help="the offload host store's formats instead of kt-kernel's")
    args = parser.parse_args(argv)
    ids = torch.randint(1000, 100000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    dtypes = STORE_DTYPES if args.store else DTYPES
    results = {dtype: run(dtype, args.layers, ids, args.threads, args.store) for dtype in dtypes}
    base = results[dtypes[0]]
    column = "store_dtype" if args.store else "cpu_dtype"
    rows = []
    for dtype in dtypes:
        r = results[dtype]
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        rows.append({column: dtype, "backend": r["backend"], "load_s": r["load_s"],
                     "logit_rel_error": rel(r["logits"], base["logits"]),
                     "top1_agreement": float((r["logits"].argmax(-1) == base["logits"].argmax(-1)).float().mean()),
                     "last_moe_layer_rel_error": rel(r["layer_out"], base["layer_out"])})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": f"qwen3-vl-30b-a3b shapes, {args.layers} layers, random weights", "tokens": args.tokens,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    name = "store_quant_accuracy.json" if args.store else "cpu_quant_accuracy.json"
    (out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"{meta}\n\n| {column} | logits: rel. L2 error vs BF16 | top-1 agreement | last MoE layer: rel. error | load s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[column]} | {row['logit_rel_error']:.4f} | {100 * row['top1_agreement']:.1f}% "
              f"| {row['last_moe_layer_rel_error']:.4f} | {row['load_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
