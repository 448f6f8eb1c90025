"""Pinned-prefix depth: Eq. 10's valid range, each depth's predicted decode time, and the choice.

    python -m benchmarks.pinned_depth --budget 16GiB [32GiB ...] [--measured FILE ...]
        [--zero-copy-gbps X] [--copy-gbps X] [--layer-ms X] [--offload-overhead-us X]
        [--lookahead W] [--recall R] [--tolerance F] [--trace PATH] [--out DIR] [--write-curve PATH]

Prints, per budget and candidate depth, the cache it leaves (slabs, slabs per offloaded layer), the
predicted decode hit rate, experts and MiB read from the host per token and predicted ms per token,
then the depth `pinned_layers: auto` takes and why (the model: vismmoe_kt/runtime/prefix_depth.py).

Shape: Qwen3-VL-30B-A3B's by default (--layers 48 --experts 128 --top-k 8 --expert-bytes 9437184, an
expert of 3 x 2048 x 768 BF16). Hit rates: LRU per layer, replayed by vismmoe_kt/routing's simulator
over synthetic routing (--requests seeds, each a 236-token prompt with 200 visual tokens replayed first,
then --decode-tokens counted, first touches included), or over a recorded --trace (its prefill tokens
warm the cache, its decode tokens are counted). For the default shape and synthetic settings this is
the curve the runtime ships (runtime/decode_hit_rates_qwen3_vl_30b_a3b.json; --write-curve rewrites it).

Bandwidths and compute: flags, else --measured JSON files (decode_kernel_bench.json: `table host` is
the zero-copy rate, `copy engine` the copy rate; a bench.json: its copy bandwidth, and per-layer compute
from its all-pinned rows; or {"zero_copy_gbps", "copy_gbps", "layer_ms", "offload_overhead_us"}), else
the H200's figures, each labelled with where it came from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.results import print_table, save_json
from vismmoe_kt.routing import load_trace, simulate_cache
from benchmarks.eviction_study import PROMPT, VISUAL, synthetic_requests
from vismmoe_kt.runtime.budget import BudgetError, parse_bytes, pinned_depth_choice
from vismmoe_kt.runtime.prefix_depth import DepthModel, HitRateCurve, shipped_curve, with_measurements
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

LAYERS, EXPERTS, TOP_K, EXPERT_BYTES = 48, 128, 8, 3 * 2048 * 768 * 2
REQUESTS, DECODE_TOKENS = 3, 128


def curve_capacities(experts: int, top_k: int) -> list[int]:
    """Where the curve is measured: every 2 experts up to 4 k, then every 4 (every one for small E)."""
    step_small, step_large = (2, 4) if experts >= 64 else (1, 1)
    caps = list(range(top_k, min(4 * top_k, experts) + 1, step_small)) + list(range(4 * top_k, experts + 1, step_large))
    return sorted(set(caps) | {experts})


def trace_requests(path: str) -> list[tuple[Any, int]]:
    """(ids, tokens to warm up on) per request of a recorded trace: its leading prefill tokens warm up."""
    trace = load_trace(path)
    requests = trace.request_ids if trace.request_ids is not None else torch.zeros(trace.tokens, dtype=torch.int32)
    out = []
    for rid in torch.unique(requests).tolist():
        rows = (requests == rid).nonzero().flatten()
        warm = 0
        if trace.phase is not None:
            decode = (trace.phase[rows] != 0).nonzero().flatten()
            warm = int(decode[0]) if len(decode) else len(rows)
        if warm < len(rows):
            out.append((trace.ids[rows], warm))
    if not out:
        raise SystemExit(f"{path}: no decode tokens to count")
    return out


def lru_curve(requests: list[tuple[Any, int]], experts: int, expert_bytes: int, source: str,
              capacities: list[int] | None = None) -> HitRateCurve:
    """Per-layer LRU decode hit rate at each capacity (default: curve_capacities), over all the requests."""
    top_k = int(requests[0][0].shape[2])
    caps = capacities or curve_capacities(experts, top_k)
    rates = np.zeros((int(requests[0][0].shape[1]), len(caps)))
    for j, capacity in enumerate(caps):
        results = [simulate_cache(ids, capacity, "lru", start=warm) for ids, warm in requests]
        rates[:, j] = sum(r.hits for r in results) / np.maximum(sum(r.accesses for r in results), 1)
    return HitRateCurve(tuple(caps), tuple(tuple(float(round(r, 5)) for r in row) for row in rates), experts, top_k,
                        expert_bytes, source)


def synthetic_curve(layers: int = LAYERS, experts: int = EXPERTS, top_k: int = TOP_K, expert_bytes: int = EXPERT_BYTES,
                    requests: int = REQUESTS, decode_tokens: int = DECODE_TOKENS) -> HitRateCurve:
    source = (f"LRU per layer on synthetic routing (seeds 0-{requests - 1}, {PROMPT}-token prompt with {VISUAL} visual "
              f"replayed first, {decode_tokens} decode tokens counted, first touches included)")
    return lru_curve(synthetic_requests(layers, experts, top_k, requests, decode_tokens), experts, expert_bytes, source)


def curve_json(curve: HitRateCurve, command: str) -> str:
    """The curve as JSON, one line per layer's rates."""
    data = curve.as_dict()
    rates, capacities = data.pop("rates"), data.pop("capacities")
    head = json.dumps({**data, "command": command}, indent=1)[:-2]
    rows = ",\n".join("  " + json.dumps(row) for row in rates)
    return f"{head},\n \"capacities\": {json.dumps(capacities)},\n \"rates\": [\n{rows}\n ]\n}}\n"


def measured_figures(paths: list[str]) -> dict[str, tuple[float, str]]:
    """name -> (value, source) from measurement JSON files (later files win)."""
    found: dict[str, tuple[float, str]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows = {row.get("kernel"): row for row in data.get("rows", []) if isinstance(row, dict) and "kernel" in row}
        if "table host" in rows:
            found["zero_copy_bytes_per_s"] = (rows["table host"]["gb_s"] * 1e9, f"measured ({path}: table host)")
        if "copy engine" in rows:
            found["copy_bytes_per_s"] = (rows["copy engine"]["gb_s"] * 1e9, f"measured ({path}: copy engine)")
        metas = [data["meta"]] if isinstance(data.get("meta"), dict) else data.get("parts", [])
        copies = [m["copy_bandwidth"]["bytes_per_s"] for m in metas if "copy_bandwidth" in m]
        if copies:
            found["copy_bytes_per_s"] = (statistics.median(copies), f"measured ({path}: {metas[0]['copy_bandwidth']['kind']})")
        pinned = [r["decode_tok_s"]["median"] for r in data.get("rows", [])
                  if isinstance(r, dict) and r.get("config") == "all-pinned" and r.get("decode_tok_s")]
        if pinned and metas and metas[0].get("layers"):
            found["layer_seconds"] = (1 / statistics.median(pinned) / metas[0]["layers"],
                                      f"measured ({path}: all-pinned decode tok/s over {metas[0]['layers']} layers)")
        plain = {"zero_copy_gbps": ("zero_copy_bytes_per_s", 1e9), "copy_gbps": ("copy_bytes_per_s", 1e9),
                 "layer_ms": ("layer_seconds", 1e-3), "offload_overhead_us": ("offload_overhead_seconds", 1e-6)}
        for key, (name, scale) in plain.items():
            if key in data:
                found[name] = (float(data[key]) * scale, f"measured ({path}: {key})")
    return found


def flag_figures(args: argparse.Namespace) -> dict[str, tuple[float, str]]:
    flags = {"zero_copy_bytes_per_s": (args.zero_copy_gbps, 1e9, "--zero-copy-gbps"),
             "copy_bytes_per_s": (args.copy_gbps, 1e9, "--copy-gbps"),
             "layer_seconds": (args.layer_ms, 1e-3, "--layer-ms"),
             "offload_overhead_seconds": (args.offload_overhead_us, 1e-6, "--offload-overhead-us")}
    return {name: (value * scale, f"given ({flag})") for name, (value, scale, flag) in flags.items() if value is not None}


def report(choice, budget: int, layer_bytes: int) -> None:
    print(f"\n## expert budget {budget / 2**30:.1f} GiB ({budget} bytes), {layer_bytes / 2**30:.2f} GiB per layer")
    if choice.rows:
        print_table(["pinned", "slabs", "slabs / offloaded layer", "predicted hit rate", "experts read / token",
                     "MiB read / token", "predicted ms / token", ""],
                    [[r.depth, r.slabs, f"{r.per_layer:.1f}", f"{r.hit_rate:.1%}", f"{r.experts_read:.1f}",
                      f"{r.bytes_read / 2**20:.1f}", f"{r.seconds * 1e3:.2f}", "chosen" if r.depth == choice.depth else ""]
                     for r in choice.rows])
    print(f"\nchosen: {choice.depth} -- {choice.reason}")


def parser() -> argparse.ArgumentParser:
    p = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    p.add_argument("--budget", nargs="+", required=True, help="expert budgets, e.g. 16GiB 32GiB")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers with experts")
    p.add_argument("--experts", type=int, default=EXPERTS, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=TOP_K, help="experts each token is routed to")
    p.add_argument("--expert-bytes", type=int, default=EXPERT_BYTES, help="bytes of one expert's weights")
    p.add_argument("--min-pinned", type=int, default=1, help="L_semantic of Eq. 10 (the rule's min_pinned_layers)")
    p.add_argument("--c-safe", help="C_safe of Eq. 10 (default: one layer of experts, as the runtime)")
    p.add_argument("--measured", nargs="*", default=[], help="measurement JSON files (see above)")
    p.add_argument("--zero-copy-gbps", type=float,
                   help="GB/s of reading experts from host memory zero-copy (default: --measured, else the H200's)")
    p.add_argument("--copy-gbps", type=float,
                   help="GB/s of the copy engine, host to GPU (default: --measured, else the H200's)")
    p.add_argument("--layer-ms", type=float, help="compute per layer and decode token")
    p.add_argument("--offload-overhead-us", type=float, help="extra per offloaded layer and decode token")
    p.add_argument("--lookahead", type=int, default=0, help="0: misses read when their layer runs (today's decode); "
                                                             "W: prefetched W layers ahead")
    p.add_argument("--recall", type=float, default=1.0, help="with --lookahead: the fraction of misses known ahead")
    p.add_argument("--tolerance", type=float, default=DepthModel.tolerance,
                   help="depths predicted within this fraction of the fastest count as equal (the deepest wins; "
                        "default: the runtime's, 0, the fastest)")
    p.add_argument("--trace", help="a routing trace to take hit rates from instead of synthetic routing")
    p.add_argument("--requests", type=int, default=REQUESTS, help="synthetic requests (seeds) for the hit-rate curve")
    p.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS,
                   help="decode tokens counted per synthetic request")
    p.add_argument("--out", help="also write pinned_depth.json here")
    p.add_argument("--write-curve", help="write the hit-rate curve used to this JSON file")
    return p


def build_curve(args: argparse.Namespace) -> HitRateCurve:
    if args.trace:
        source = f"LRU per layer on the trace {args.trace} (prefill warms the cache, decode tokens counted)"
        curve = lru_curve(trace_requests(args.trace), args.experts, args.expert_bytes, source)
        if curve.layers != args.layers or curve.top_k != args.top_k:
            raise SystemExit(f"{args.trace}: {curve.layers} layers, top-{curve.top_k}; give --layers and --top-k to match")
        return curve
    shipped = shipped_curve()
    default = (args.layers, args.experts, args.top_k, args.expert_bytes, args.requests, args.decode_tokens) == \
        (LAYERS, EXPERTS, TOP_K, EXPERT_BYTES, REQUESTS, DECODE_TOKENS)
    if default and shipped is not None and not args.write_curve:
        return shipped  # the same simulation, already run
    return synthetic_curve(args.layers, args.experts, args.top_k, args.expert_bytes, args.requests, args.decode_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    curve = build_curve(args)
    if args.write_curve:
        command = "python -m benchmarks.pinned_depth " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.write_curve).write_text(curve_json(curve, command))
    try:
        model = DepthModel(curve, args.expert_bytes, lookahead=args.lookahead, recall=args.recall,
                           tolerance=args.tolerance)
    except ValueError as exc:
        raise SystemExit(f"pinned_depth: {exc}") from None
    model = with_measurements(model, **{**measured_figures(args.measured), **flag_figures(args)})
    layer_bytes = args.experts * args.expert_bytes
    c_safe = parse_bytes(args.c_safe) if args.c_safe else layer_bytes
    print(f"model: {model.describe()}")
    results = []
    for text in args.budget:
        budget = parse_bytes(text)
        try:
            choice = pinned_depth_choice(budget, layer_bytes, c_safe, args.min_pinned, args.layers, None, model)
        except BudgetError as exc:
            print(f"\n## expert budget {text}: {exc}")
            results.append({"budget": text, "budget_bytes": budget, "error": str(exc)})
            continue
        report(choice, budget, layer_bytes)
        results.append({"budget": text, "budget_bytes": budget, **choice.as_dict()})
    save_json(args.out, "pinned_depth.json", {
        "shape": {"layers": args.layers, "experts": args.experts, "top_k": args.top_k, "expert_bytes": args.expert_bytes},
        "l_semantic": args.min_pinned, "c_safe_bytes": c_safe, "model": model.describe(),
        "inputs": {name: [getattr(model, name), model.source(name)] for name in
                   ("zero_copy_bytes_per_s", "copy_bytes_per_s", "layer_seconds", "offload_overhead_seconds")},
        "lookahead": model.lookahead, "recall": model.recall, "tolerance": model.tolerance, "budgets": results})
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
