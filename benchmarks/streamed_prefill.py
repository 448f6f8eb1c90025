"""What a streamed prompt copies over the link, on the CPU proxy of Qwen3-VL-30B-A3B (48 layers x 128 experts,
top-8, toy widths: `proxy-48x128`), routing synthetic (request i from seed i), for each choice of the streams'
victims:

    cycle     the slab whose layer runs again last (eviction.CycleRanking: the runtime's)
    cache     the cache's own ranking, as the streams took their victims before (lru: least recently used;
              vismmoe: Expired slabs by recency, then Speculative ones)

    python -m benchmarks.streamed_prefill [--rules optimize_rules/qwen3vl-lru.yaml ...] [--slabs 2427]
        [--prompts 5] [--image_size 448] [--out DIR]

Each run loads the proxy with the rule file at `--slabs` experts' worth of slabs (2427: what 6 GiB of Q4_K slabs
hold for the real model, 40% of its 6016 experts), then prefills `--prompts` image prompts one after another
(each its own picture and routing, so nothing of one is reused by the next) and counts, per prompt, the
experts copied into slabs and the routing reads. The copies are the real model's as well (the same layers,
experts, routing and slab count: the widths change only the bytes), so each count is also given as the bytes
of Qwen3-VL-30B-A3B's Q4_K experts and as the time those bytes take at the H200's measured 53 GB/s of
host-to-device copies (BENCHMARKS.md, Machines): the link's floor for that prompt, by arithmetic, not a
measurement on the GPU.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from benchmarks import proxy
from benchmarks.results import print_table, save_json
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

VICTIMS = ("cycle", "cache")
LINK_BYTES_PER_S = 53e9  # the H200 machine's page-locked host-to-device copies (BENCHMARKS.md, Machines)


def q4k_expert_bytes() -> int:
    """One Qwen3-VL-30B-A3B expert's Q4_K block (gate, up and down: hidden 2048, expert width 768)."""
    from vismmoe_kt.runtime.store import ExpertStore

    return ExpertStore(128, 2048, 768, torch.bfloat16, False, fmt="q4_k").block_bytes


def measure(model_dir: Path, rules: str, slabs: int, victims: str, prompts: int, image_size: int,
            expert_bytes: int) -> dict:
    from vismmoe_kt import load
    from vismmoe_kt.demo.pictures import make_image
    from vismmoe_kt.engine.generation import generate
    from vismmoe_kt.engine.inputs import build_inputs, user_turn
    from vismmoe_kt.operators.source_router import install_routing
    from vismmoe_kt.runtime.eviction import CycleRanking

    model, processor = load(str(model_dir), rules, expert_budget=slabs * expert_bytes, generate_device="cpu",
                            prefill_device="cpu", progress=False)
    install_routing(model, "synthetic:0")
    runtime = model.vismmoe.context.offload_runtime
    runtime.transfers.stream_victims = CycleRanking() if victims == "cycle" else None  # None: the cache's ranking
    copies, reads = [], []
    for index in range(prompts):
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)],
                              [make_image(image_size, seed=index + 1)], "cpu")
        before = (runtime.transfers.counters.copies, runtime.host_reads)
        with torch.no_grad():
            generate(model, inputs, 1)  # the prompt alone: its first token comes from the prefill
        copies.append(runtime.transfers.counters.copies - before[0])
        reads.append(runtime.host_reads - before[1])
    runtime.close()
    later = copies[1:] or copies  # the first prompt fills empty slabs
    return {"rules": rules, "victims": victims, "slabs": runtime.num_slabs, "pinned_layers": len(runtime.pinned),
            "offloaded_layers": len(runtime.offloaded_layers()), "prefill": runtime.plan.prefill,
            "copies_per_prompt": copies, "routing_reads_per_prompt": reads,
            "copies_after_the_first": statistics.mean(later)}


def parse_args(argv=None):
    p = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    proxy.add_arguments(p, "each with both choices of victims", "streamed_prefill.json")
    p.add_argument("--prompts", type=int, default=5, help="image prompts per run, one after another")
    p.add_argument("--image_size", type=int, default=448, help="the pictures' side in pixels")
    args = p.parse_args(argv)
    if args.slabs < 128 or args.prompts < 2:
        p.error("--slabs must be at least one layer's 128 experts and --prompts at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    q4k = q4k_expert_bytes()
    rows = []
    with proxy.saved_proxy(args.threads) as (model_dir, expert_bytes):
        for rules in args.rules:
            for victims in VICTIMS:
                row = measure(model_dir, rules, args.slabs, victims, args.prompts, args.image_size, expert_bytes)
                row["q4k_gb_after_the_first"] = round(row["copies_after_the_first"] * q4k / 1e9, 2)
                row["link_floor_s"] = round(row["copies_after_the_first"] * q4k / LINK_BYTES_PER_S, 3)
                rows.append(row)
    print_table(["rules", "victims", "slabs", "pinned", "prefill", "experts copied per prompt",
                 "after the first (mean)", "as Q4_K GB", "link floor s at 53 GB/s", "routing reads per prompt"],
                [[Path(r["rules"]).stem, r["victims"], r["slabs"], r["pinned_layers"], r["prefill"],
                  " ".join(map(str, r["copies_per_prompt"])), f"{r['copies_after_the_first']:.0f}",
                  r["q4k_gb_after_the_first"], r["link_floor_s"], " ".join(map(str, r["routing_reads_per_prompt"]))]
                 for r in rows])
    save_json(args.out, "streamed_prefill.json", {"args": vars(args), "q4k_expert_bytes": q4k, "rows": rows,
                                                  "routing": "synthetic:0 (request i from seed i)"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
