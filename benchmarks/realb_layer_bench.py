"""ReaLB's MoE layer on expert-parallel ranks, compute only: each rank's expert time in BF16, FP8-All and
under ReaLB's plan, for a batched multimodal prefill (Qwen3-VL-30B-A3B shapes, synthetic routing).

    PYTHONPATH=. python3 -m benchmarks.realb_layer_bench --out DIR [--requests 16 --ranks 2]

The experts of a layer are split over `--ranks` expert-parallel ranks as the EP operator splits them
(contiguous blocks). Each rank's share of the pairs of `--requests` prompts (each `--visual` vision and
`--text` text tokens, routed by the synthetic router with its vision-heavy prefill; `--image-share` of them
with a picture, the rest text; `--affinity S`: the labelled what-if of each picture's own expert
preference, the imbalance ReaLB targets) is computed on one GPU,
rank after rank, the way the EP operator's rank computes it (runtime/expert_compute.precision_split_rows):
BF16 pairs by grouped GEMM over its experts, switched pairs by the FP8 grouped GEMM over the E4M3 copy
made at load (lb/fp8_experts.py). A layer's time on real ranks is its slowest rank's
(the combine waits for it), so each row gives the straggler's time, the ranks' mean, the imbalance
max/mean of pairs before and after the plan, the share of pairs in low precision, and the layer
output's error against BF16. What this leaves out: the all-to-all exchange (the same bytes in every
configuration but fixed-size padding) and the dispatch's own work.

Configurations: bf16, fp8-all (every pair in FP8), realb (the plan, M_d under AIMD, starting at 0.9),
fixed (M_d fixed at --fixed-threshold), eplb (BF16, hot experts copied: one extra copy per rank,
placed from the layer's own loads, which makes it an upper bound for EPLB, whose operator places from
past steps), and bf16 again last: the two BF16 rows differ by the noise. The controller sees `--layers` layers `--passes` times in a row
(AIMD moves M_d between calls); the timings are of the last pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from vismmoe_kt.lb.controller import RealbController
from vismmoe_kt.lb.fp8_experts import Fp8Experts
from vismmoe_kt.parallel.replication import holders_tensor, placement_table
from vismmoe_kt.routing import affinity_label, check_affinity_strength, synthetic_routing
from vismmoe_kt.runtime.expert_compute import precision_split_rows

from benchmarks.results import print_table, save_json
from benchmarks.timing import median_seconds
from vismmoe_kt.apps.arguments import FlagParser

CONFIGS = ("bf16", "fp8-all", "realb", "fixed", "eplb")


def routed_prefill(requests: int, visual: int, text: int, layers: int, experts: int, top_k: int,
                   seed: int = 0, affinity: float = 0.0,
                   image_share: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T, L, K], weights [T, L, K], is_visual [T]) of `requests` prompts, one after another; each
    prompt's image tokens after its first text tokens, as a chat template puts them. The first
    round(image_share * requests) prompts carry an image, the others are text of the same length (a mixed
    batch); `affinity`: the what-if strength of each image's own expert preference (routing/affinity.py),
    which makes every picture load its own experts, the per-rank imbalance ReaLB targets."""
    images = round(image_share * requests)
    ids, weights, masks = [], [], []
    for r in range(requests):
        mask = torch.zeros(visual + text, dtype=torch.bool)
        if r < images:
            mask[min(text, 8):min(text, 8) + visual] = True
        i, w = synthetic_routing(visual + text, layers, experts, top_k, phase="prefill", modality=mask, seed=seed + r,
                                 affinity=affinity)
        ids.append(i), weights.append(w), masks.append(mask)
    return torch.cat(ids), torch.cat(weights), torch.cat(masks)


def timed(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of `run` after one untimed run (eager: the split reads one number on the host)."""
    run()
    return median_seconds(run, repeats, device)


class RankExperts:
    """The experts one rank holds (a contiguous block, or EPLB's copies), in BF16 and, where they may
    switch, in E4M3 (made once)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, fp8: bool = True):
        contiguous = bool((experts.diff() == 1).all()) if experts.numel() > 1 else True
        first = int(experts[0])
        pick = slice(first, first + experts.numel()) if contiguous else experts.to(gate_up.device)
        self.gate_up, self.down = gate_up[pick], down[pick]  # views for a block, copies for EPLB's sets
        self.local = torch.full((gate_up.shape[0],), -1, dtype=torch.long, device=gate_up.device)
        self.local[experts.to(gate_up.device)] = torch.arange(experts.numel(), device=gate_up.device)
        self.fp8 = Fp8Experts(self.gate_up, self.down) if fp8 else None

    def run(self, hidden: torch.Tensor, experts: torch.Tensor, lowprec: torch.Tensor, act: Any) -> torch.Tensor:
        """(P, H) outputs of the pairs (hidden[p], experts[p]) (layer-wide expert ids): the `lowprec` ones
        from the E4M3 copy, the rest by BF16 grouped GEMM, as the EP operator computes a rank's pairs."""
        return precision_split_rows(hidden, None, self.local[experts], lowprec, self.gate_up, self.down, act,
                                    None if self.fp8 is None else self.fp8.grouped_rows)


def eplb_layer(gate_up: torch.Tensor, down: torch.Tensor, load: torch.Tensor, index: torch.Tensor,
               ranks: int) -> tuple[list[RankExperts], torch.Tensor]:
    """EPLB's ranks for one layer, placed from this step's own loads (an oracle: the operator places
    from a window of past steps), one extra copy per rank, and each pair's rank (T, K): an expert's
    pairs spread over its copies in turn, as ep_forward spreads them."""
    holders = placement_table(load.double(), ranks, ranks)
    table = holders_tensor(holders).to(index.device)
    copies = (table >= 0).sum(dim=1)
    flat = index.reshape(-1)
    owner = table[flat, torch.arange(flat.numel(), device=index.device) % copies[flat]].view_as(index)
    held = [sorted({e for e, h in enumerate(holders) if r in h}) for r in range(ranks)]
    return [RankExperts(gate_up, down, torch.tensor(h), fp8=False) for h in held], owner


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    dtype = torch.bfloat16
    gate_up = (torch.randn(E, 2 * I, H, device=device) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, I, device=device) * I ** -0.5).to(dtype)
    per_rank = E // args.ranks
    ranks = [RankExperts(gate_up, down, torch.arange(r * per_rank, (r + 1) * per_rank)) for r in range(args.ranks)]
    expert_rank = torch.arange(E) // per_rank
    act = torch.nn.functional.silu
    ids, weights, visual = routed_prefill(args.requests, args.visual, args.text, args.layers, E, K,
                                          affinity=args.affinity, image_share=args.image_share)
    tokens = ids.shape[0]
    hidden = torch.randn(tokens, H, device=device).to(dtype)
    visual_d = visual.to(device)
    rows, layers_out = [], []
    _warm_up(device)
    for config in CONFIGS + ("bf16 (again)",):  # BF16 timed twice: the spread between the two is noise
        mode = {"fp8-all": "all", "bf16": "bf16", "bf16 (again)": "bf16", "eplb": "bf16"}.get(config, config)
        controller = RealbController(mode=mode, fixed_threshold=args.fixed_threshold, gate_tokens=args.gate_tokens)
        per_layer = []
        for p in range(args.passes):
            for layer in range(args.layers):
                index = ids[:, layer].to(device)
                load = torch.bincount(ids[:, layer].reshape(-1), minlength=E).float()
                vision = torch.bincount(ids[visual, layer].reshape(-1), minlength=E).float()
                switched, plan = controller.decide(load, vision, expert_rank, args.ranks, tokens)
                if p < args.passes - 1:
                    continue
                lowprec = switched.to(device)[index]
                if config != "fp8-all":  # ReaLB's scope: a switched expert's text rows stay BF16
                    lowprec &= visual_d[:, None]
                layer_ranks, owner = ranks, expert_rank.to(device)[index]
                if config == "eplb":
                    layer_ranks, owner = eplb_layer(gate_up, down, load, index, args.ranks)
                per_layer.append(_layer(layer_ranks, hidden, index, lowprec, owner, expert_rank.to(device)[index],
                                        device, args.repeats, plan, act))
        row = {"config": config, "tokens": tokens,
               "straggler_ms": statistics.mean(x["straggler_s"] for x in per_layer) * 1e3,
               "rank_mean_ms": statistics.mean(x["mean_s"] for x in per_layer) * 1e3,
               "imbalance_before": statistics.mean(x["imbalance_before"] for x in per_layer),
               "imbalance_after": statistics.mean(x["imbalance_after"] for x in per_layer),
               "lowprec_share": statistics.mean(x["lowprec_share"] for x in per_layer),
               "m_d": controller.aimd.threshold if config == "realb" else
               (args.fixed_threshold if config == "fixed" else None)}
        rows.append(row)
        layers_out.append({"config": config, "layers": per_layer})
    reference = _outputs(ranks, hidden, ids, weights, visual_d, expert_rank, act, device, args.layers, None)
    for row in rows:  # output error against BF16, from the last pass's plans
        plans = next(x["layers"] for x in layers_out if x["config"] == row["config"])
        got = _outputs(ranks, hidden, ids, weights, visual_d, expert_rank, act, device, args.layers,
                       [x["lowprec_mask"] for x in plans])
        row["relative_error_vs_bf16"] = max(float((g.float() - r.float()).norm() / r.float().norm())
                                            for g, r in zip(got, reference))
    base = rows[0]["straggler_ms"]
    for row in rows:
        row["speedup_vs_bf16"] = base / row["straggler_ms"]
    for x in layers_out:
        for layer in x["layers"]:
            layer.pop("lowprec_mask")
    result = {"rows": rows, "layers": layers_out}
    if args.profile and device.type == "cuda":
        result["profile"] = _profile(ranks[0], hidden, ids[:, 0].to(device), expert_rank, act)
    return result


def _profile(rank: RankExperts, hidden, index, expert_rank, act) -> dict[str, str]:
    """Rank 0's pairs of the first layer all in BF16, all in FP8, and mixed, under torch.profiler: where
    each way's time goes, kernel by kernel."""
    token, slot = torch.nonzero(expert_rank.to(index.device)[index] == 0, as_tuple=True)
    x, experts = hidden[token], index[token, slot]
    tables = {}
    busiest = torch.bincount(experts).argsort(descending=True)[:2]  # a plan's kind of switch: the two busiest
    for name, low in (("bf16", torch.zeros_like(experts, dtype=torch.bool)),
                      ("fp8", torch.ones_like(experts, dtype=torch.bool)),
                      ("mixed (the 2 busiest experts in FP8)", torch.isin(experts, busiest))):
        rank.run(x, experts, low, act)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                rank.run(x, experts, low, act)
            torch.cuda.synchronize()
        tables[name] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
        print(f"--- {name}: rank 0's {experts.numel()} pairs of one layer, 5 runs")
        print(tables[name])
    return tables


def _warm_up(device: torch.device, seconds: float = 1.0) -> None:
    """Matrix products for about `seconds`, so the first configuration is not timed at idle clocks."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _layer(ranks: list[RankExperts], hidden, index, lowprec, owner, home, device, repeats, plan,
           act) -> dict[str, Any]:
    """One layer's pairs split by rank (`owner` (T, K); `home`: the contiguous placement's), each rank's
    compute timed alone."""
    times, pairs = [], []
    for r, rank in enumerate(ranks):
        token, slot = torch.nonzero(owner == r, as_tuple=True)
        x, experts, low = hidden[token], index[token, slot], lowprec[token, slot]
        times.append(timed(lambda: rank.run(x, experts, low, act), device, repeats))
        pairs.append(int(token.numel()))
    before = torch.bincount(home.reshape(-1).cpu(), minlength=len(ranks)).double()
    after = torch.tensor(pairs, dtype=torch.float64)
    imbalance = float(plan.imbalance()) if plan is not None and not plan.gated else float(after.max() / after.mean())
    return {"straggler_s": max(times), "mean_s": statistics.mean(times), "rank_s": times,
            "imbalance_before": float(before.max() / before.mean()), "imbalance_after": imbalance,
            "lowprec_share": float(lowprec.float().mean()), "lowprec_mask": lowprec.cpu()}


def _outputs(ranks, hidden, ids, weights, visual, expert_rank, act, device, layers, masks) -> list[torch.Tensor]:
    """Each layer's (T, H) output with the pairs in `masks[layer]` in FP8 (None: all BF16)."""
    outs = []
    for layer in range(layers):
        index = ids[:, layer].to(device)
        low = torch.zeros_like(index, dtype=torch.bool) if masks is None else masks[layer].to(device)
        pairs = torch.empty(*index.shape, hidden.shape[1], dtype=hidden.dtype, device=device)
        owner = expert_rank.to(device)[index]
        for r, rank in enumerate(ranks):
            token, slot = torch.nonzero(owner == r, as_tuple=True)
            pairs[token, slot] = rank.run(hidden[token], index[token, slot], low[token, slot], act)
        outs.append((pairs.float() * weights[:, layer].to(device)[..., None]).sum(dim=1))
    return outs


def main(argv: list[str] | None = None) -> None:
    parser = FlagParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write realb_layer_bench.json here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the ranks' experts run, one rank after another (default: cuda when there is a GPU)")
    parser.add_argument("--requests", type=int, default=16, help="prompts in the batched prefill")
    parser.add_argument("--visual", type=int, default=196, help="vision tokens per prompt (448 px: 196)")
    parser.add_argument("--text", type=int, default=40, help="text tokens per prompt")
    parser.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks the experts are split over")
    parser.add_argument("--layers", type=int, default=8, help="MoE layers the controller sees per pass")
    parser.add_argument("--passes", type=int, default=3, help="passes over the layers (AIMD moves M_d; the last is timed)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per rank and layer (median)")
    parser.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=768, help="expert intermediate size")
    parser.add_argument("--top-k", type=int, default=8, help="experts each token is routed to")
    parser.add_argument("--gate-tokens", type=int, default=2048, help="ReaLB's gate: below this many tokens per step all stays BF16")
    parser.add_argument("--fixed-threshold", type=float, default=0.7, help="M_d of the `fixed` configuration")
    parser.add_argument("--profile", action="store_true", help="rank 0 in BF16 and in FP8 under torch.profiler")
    parser.add_argument("--affinity", default="0",
                        help="the labelled what-if: each image's own expert preference at this strength in [0, 1] "
                             "(0.283: the paper's +32%% concentration; default 0, the calibrated router)")
    parser.add_argument("--image-share", type=float, default=1.0,
                        help="the share of the prompts that carry an image; the rest are text (a mixed batch)")
    args = parser.parse_args(argv)
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must split evenly over --ranks {args.ranks}")
    try:
        args.affinity = check_affinity_strength(args.affinity)
    except ValueError as exc:
        parser.error(f"--affinity: {exc}")
    if not 0.0 <= args.image_share <= 1.0:
        parser.error(f"--image-share {args.image_share}: a share must be in [0, 1]")
    result = measure(args)
    meta = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "routing": affinity_label(args.affinity),
            **{k: v for k, v in vars(args).items() if k != "out"}}
    print(meta)
    print_table(["config", "tokens", "straggler ms / layer", "rank mean ms", "x bf16", "imbalance before",
                 "after", "low-precision pairs", "M_d", "output error vs bf16"],
                [[r["config"], r["tokens"], f"{r['straggler_ms']:.3f}", f"{r['rank_mean_ms']:.3f}",
                  f"{r['speedup_vs_bf16']:.2f}x", f"{r['imbalance_before']:.3f}", f"{r['imbalance_after']:.3f}",
                  f"{r['lowprec_share']:.1%}", "-" if r["m_d"] is None else f"{r['m_d']:.2f}",
                  f"{r['relative_error_vs_bf16']:.2e}"] for r in result["rows"]])
    save_json(args.out, "realb_layer_bench.json", {"meta": meta, **result})


if __name__ == "__main__":
    main()
