"""The layerwise GPU prefill's pieces at a model's shapes, each timed alone and then together (GPU only).

    PYTHONPATH=. python3 -m benchmarks.layerwise_prefill_bench [--layers 8] [--tokens 236] [--format q4_k]

Per layer of Qwen3-VL-30B-A3B's experts (128 x (2048 x 768), BF16; random weights, random top-8 routing):
the copy of the layer's host blocks to the device, their dequantization into the bank, the grouped GEMM,
then `LayerwisePrefill.run` over `--layers` layers back to back (the copy a layer ahead), as a prefill
drives it. Prints one JSON object: milliseconds per piece and per layer, and the copy's GB/s.
"""

from __future__ import annotations

import json

import torch

from vismmoe_kt.apps.arguments import FlagParser
from benchmarks.timing import median_seconds


def timed(fn, reps: int = 5) -> float:
    """Median milliseconds of `fn` after one warm-up call (timing.median_seconds: CUDA events)."""
    fn()
    torch.cuda.synchronize()
    return median_seconds(fn, reps) * 1000


def main() -> None:
    from vismmoe_kt.runtime.kernels import dequantize
    from vismmoe_kt.runtime.expert_compute import bank_experts
    from vismmoe_kt.runtime.layerwise_prefill import LayerwisePrefill

    parser = FlagParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8, help="layers of experts in the host copy")
    parser.add_argument("--tokens", type=int, default=236, help="prompt tokens (a 448 px picture's prompt: 236)")
    parser.add_argument("--format", default="q4_k", help="the host copy's format (gpu_prefill_format)")
    parser.add_argument("--experts", type=int, default=128, help="experts per layer")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size")
    parser.add_argument("--inter", type=int, default=768, help="expert intermediate size")
    parser.add_argument("--top_k", type=int, default=8, help="experts per token")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layerwise_prefill_bench needs a CUDA device")
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    prefill = LayerwisePrefill(e, h, i, torch.bfloat16, device, args.format, min_tokens=2)
    for layer in range(args.layers):
        gate_up = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) * 0.02
        down = torch.randn(e, h, i, device=device, dtype=torch.bfloat16) * 0.02
        prefill.fill_layer(layer, gate_up, down)
    del gate_up, down
    hidden = torch.randn(args.tokens, h, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(args.tokens)])
    weights = torch.softmax(torch.randn(args.tokens, k, device=device), -1).to(torch.bfloat16)
    act = torch.nn.functional.silu
    store = prefill.store
    layer_bytes = store.layers[0].numel() * store.layers[0].element_size()
    staging = torch.empty(layer_bytes, dtype=torch.uint8, device=device)
    source = store.layers[0].view(torch.uint8).reshape(-1)
    copy_ms = timed(lambda: staging.copy_(source, non_blocking=True))
    bank = (torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=device),
            torch.empty(e, h, i, dtype=torch.bfloat16, device=device))
    rows = torch.arange(e, device=device)
    need = torch.ones(e, dtype=torch.int8, device=device)
    block = store.block_bytes_of(0)
    dequant_ms = timed(lambda: dequantize.fetch_q8(rows, need, rows, bank, staging.data_ptr(), block, i, h,
                                                   fmt=store.fmt, staged=True)) if store.quantized else 0.0
    gemm_ms = timed(lambda: bank_experts(hidden, ids, weights, rows, *bank, act))

    def prefill_pass():
        for layer in range(args.layers):
            prefill.run(layer, hidden, ids, weights, act)

    pass_ms = timed(prefill_pass, reps=3)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "format": store.fmt, "tokens": args.tokens,
                      "layer_mb": layer_bytes / 1e6, "copy_ms": copy_ms, "copy_gb_s": layer_bytes / copy_ms / 1e6,
                      "dequantize_ms": dequant_ms, "grouped_gemm_ms": gemm_ms,
                      "run_ms_per_layer": pass_ms / args.layers,
                      "bound_ms_per_layer": max(copy_ms, dequant_ms + gemm_ms)}, indent=1))


if __name__ == "__main__":
    main()
