"""The affinity what-if on full-size shapes: how the working set, compression and ReaLB's imbalance
move with the synthetic router's visual-expert affinity strength (vismmoe_kt/routing/affinity.py).

    python -m benchmarks.affinity_whatif [--strengths 0,0.2,0.4,0.8] [--layers 8] [--requests 4]
        [--keeps 0.3,0.5,0.7] [--depths 1,2,4] [--ranks 2,8] [--fit-gain G | --fit-study FILE] [--out DIR]

Synthetic routing only, CPU, no model: each request is a prompt of --visual visual and --text text tokens
(Qwen3-VL-30B-A3B's 48 layers' depth profile over --layers layers, 128 experts, top-8; request i from
seed i, its image its own preference). Pruning is emulated as the VisDecoder does it: the prefix layers'
experts of each visual token and a saliency (a seeded draw: the synthetic router has no attention) go
to vismmoe_kt/vision/compression.select, and the layers from the pinned depth on see the kept tokens,
re-routed as the routing source re-routes them (their coherence raised by the share pruned).
Per strength, compression and keep it prints the mean over the layers after the prefix of distinct
experts, the top-(E/8) concentration and the experts covering 90% of assignments, then:

  * the concentration gain of affinity pruning over no pruning at each strength, and the strength whose
    gain matches the paper's +32% (--paper-gain) and, with --fit-gain or --fit-study, a trained model's
    (affinity_study.py's JSON holds its measured gain): what the sweep's figures should be read at;
  * ReaLB's scenario: a mixed batch (--image-share of the requests carry an image, the rest are text of
    the same length) split over --ranks expert-parallel ranks (contiguous expert blocks), per-rank
    imbalance max/mean of the pairs, mean over layers.

Every figure names the routing it used (synthetic:affinity=S). The default routing stays strength 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from benchmarks.affinity_metrics import Layer, concentration, cover, distinct
from benchmarks.results import print_table, save_json
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.routing import SyntheticRouter, affinity_label, check_affinity_strength
from vismmoe_kt.routing.affinity import Survivors
from vismmoe_kt.vision.compression import select

PAPER_GAIN = 0.32  # VisMMOE: +32% concentration on Qwen3-VL-30B-A3B
METHODS = ("random", "saliency", "affinity")


def prompt_mask(visual: int, text: int) -> torch.Tensor:
    """[T] bool: a few text tokens, the image's, then the rest of the text (as a chat template puts them)."""
    mask = torch.zeros(visual + text, dtype=torch.bool)
    mask[min(text, 8):min(text, 8) + visual] = True
    return mask


def route_prompt(seed: int, strength: float, layers: int, experts: int, top_k: int, visual: int,
                 text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, L, k], visual mask [T]) of request `seed`'s prompt."""
    mask = prompt_mask(visual, text)
    router = SyntheticRouter(layers, experts, top_k, seed=seed, affinity=strength)
    return router.prefill(modality=mask.to(torch.uint8)), mask


def survivors_of(seed: int, strength: float, layers: int, experts: int, top_k: int, visual: int, text: int):
    """(ids, mask, reroute) of request `seed`: reroute(layer, kept positions) gives the survivors' ids at
    that layer as the routing source gives them (their coherence raised by the share pruned)."""
    mask = prompt_mask(visual, text)
    router = SyntheticRouter(layers, experts, top_k, seed=seed, affinity=strength)
    routing = router.route(len(mask), mask.to(torch.uint8), "prefill")
    survivors = Survivors(router, routing.hidden, mask)

    def reroute(layer: int, kept: torch.Tensor) -> torch.Tensor:
        return survivors.rows(layer, kept)[0] if strength else routing.ids[kept, layer]
    return routing.ids, mask, reroute


def prune(ids: torch.Tensor, mask: torch.Tensor, method: str, keep: float, depth: int, experts: int,
          seed: int = 0, reroute=None) -> list[Layer]:
    """The prefill's layers as the VisDecoder leaves them: all positions before `depth`, the kept after
    (their ids from `reroute(layer, kept)` when given: `survivors_of`)."""
    positions = torch.arange(ids.shape[0])
    kept = positions
    if method != "none" and keep < 1:
        visual = torch.nonzero(mask, as_tuple=True)[0]
        masks = torch.zeros(len(visual), experts, dtype=torch.bool)
        for layer in range(depth):
            masks.scatter_(1, ids[visual, layer], True)
        saliency = torch.rand(len(visual), generator=torch.Generator().manual_seed(seed))
        chosen = select(method, saliency, masks, keep, 0.4 * keep, seed=seed)
        survive = ~mask
        survive[visual[chosen]] = True
        kept = positions[survive]
        if reroute is not None:
            return [(ids[:, layer], positions) if layer < depth else (reroute(layer, kept), kept)
                    for layer in range(ids.shape[1])]
    return [(ids[:, layer], positions) if layer < depth else (ids[kept, layer], kept) for layer in range(ids.shape[1])]


def case_figures(strength: float, method: str, keep: float, depth: int, shape: dict, requests: int,
                 first: int = 0) -> dict:
    """Means over requests and the layers from `depth` on: distinct, concentration (all tokens and the
    visual ones: pruning acts on those), cover90."""
    experts, top = shape["experts"], max(1, shape["experts"] // 8)
    sums = {"distinct": 0.0, "concentration": 0.0, "concentration_visual": 0.0, "cover90": 0.0}
    for seed in range(first, first + requests):
        ids, mask, reroute = survivors_of(seed, strength, **shape)
        later = prune(ids, mask, method, keep, depth, experts, seed, reroute)[depth:]
        sums["distinct"] += sum(distinct(i, experts) for i, _ in later) / len(later)
        sums["concentration"] += sum(concentration(i, experts, top) for i, _ in later) / len(later)
        sums["concentration_visual"] += sum(concentration(i[mask[p]], experts, top) for i, p in later) / len(later)
        sums["cover90"] += sum(cover(i, experts) for i, _ in later) / len(later)
    return {k: v / requests for k, v in sums.items()}


def gain(strength: float, keep: float, depth: int, shape: dict, requests: int, first: int = 0) -> float:
    """The visual tokens' concentration under affinity pruning over no pruning, minus 1 (the paper's
    "+32%" is this for the kept tokens' expert demand), at this strength."""
    pruned = case_figures(strength, "affinity", keep, depth, shape, requests, first)["concentration_visual"]
    return pruned / case_figures(strength, "none", 1.0, depth, shape, requests, first)["concentration_visual"] - 1


def fit_strength(target: float, curve: list[tuple[float, float]]) -> float | None:
    """The smallest strength whose gain reaches `target`, linearly between the curve's (strength, gain)
    points (sorted by strength); None where the curve never reaches it."""
    points = sorted(curve)
    if points and points[0][1] >= target:
        return points[0][0]
    for (s0, g0), (s1, g1) in zip(points, points[1:]):
        if g0 < target <= g1:
            return s0 + (s1 - s0) * (target - g0) / (g1 - g0)
    return None


def gain_curve(strengths: list[float], keep: float, depth: int, shape: dict, requests: int) -> list[tuple[float, float]]:
    return [(s, gain(s, keep, depth, shape, requests)) for s in strengths]


def ep_imbalance(strength: float, shape: dict, requests: int, image_share: float, ranks: int) -> float:
    """Per-rank imbalance (max / mean pairs over ranks, contiguous expert blocks) of one mixed batch:
    the first round(image_share * requests) requests carry an image, the others are text only."""
    experts = shape["experts"]
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split evenly over {ranks} ranks")
    images = round(image_share * requests)
    ids = []
    for seed in range(requests):
        routed, mask = route_prompt(seed, strength, **shape)
        if seed >= images:  # the same length as text
            router = SyntheticRouter(shape["layers"], experts, shape["top_k"], seed=seed, affinity=strength)
            routed = router.prefill(len(mask))
        ids.append(routed)
    batch = torch.cat(ids)  # [T, L, k]
    values = []
    for layer in range(batch.shape[1]):
        loads = torch.bincount(batch[:, layer].reshape(-1), minlength=experts).float().view(ranks, -1).sum(1)
        values.append(float(loads.max() / loads.mean()))
    return sum(values) / len(values)


def numbers(text: str, name: str, kind=float) -> list:
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{name} {text!r}: expected comma-separated numbers") from None


def study_gain(path: str) -> float:
    """The trained model's measured gain, from an affinity_study.json."""
    try:
        return float(json.loads(Path(path).read_text())["fit"]["gain"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--fit-study {path}: not an affinity_study.json with a fit.gain ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--strengths", default="0,0.2,0.4,0.8", help="affinity strengths in [0, 1] to sweep")
    parser.add_argument("--layers", type=int, default=8, help="layers (the calibration's depth profile over them)")
    parser.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=8, help="experts each token is routed to")
    parser.add_argument("--visual", type=int, default=196, help="visual tokens per prompt (448 px: 196)")
    parser.add_argument("--text", type=int, default=40, help="text tokens per prompt")
    parser.add_argument("--requests", type=int, default=4, help="requests (seeds 0..N-1) per figure")
    parser.add_argument("--keeps", default="0.3,0.5,0.7", help="keep ratios of the compressed rows")
    parser.add_argument("--depths", default="1,2,4", help="pinned prefix depths (the pruning layer)")
    parser.add_argument("--ranks", default="2,8", help="expert-parallel rank counts of ReaLB's scenario")
    parser.add_argument("--image-share", type=float, default=0.5, help="share of the mixed batch's requests with an image")
    parser.add_argument("--paper-gain", type=float, default=PAPER_GAIN, help="the paper's concentration gain to fit")
    parser.add_argument("--fit-gain", type=float, help="also fit this measured gain (a trained model's)")
    parser.add_argument("--fit-study", help="also fit the gain an affinity_study.json measured")
    parser.add_argument("--out", help="also write affinity_whatif.json here")
    args = parser.parse_args(argv)
    try:
        strengths = [check_affinity_strength(s) for s in numbers(args.strengths, "--strengths")]
    except ValueError as exc:
        parser.error(f"--strengths: {exc}")
    keeps, depths = numbers(args.keeps, "--keeps"), numbers(args.depths, "--depths", int)
    ranks = numbers(args.ranks, "--ranks", int)
    if any(r < 1 or args.experts % r for r in ranks):
        parser.error(f"--ranks {args.ranks}: each must divide --experts {args.experts}")
    if any(not 0 < k <= 1 for k in keeps) or any(d < 1 for d in depths):
        parser.error("--keeps must lie in (0, 1] and --depths be at least 1")
    left_out, depths = [d for d in depths if d >= args.layers], [d for d in depths if d < args.layers]
    if not depths:
        parser.error(f"--depths: none below --layers {args.layers} (a depth needs a layer after it)")
    if left_out:
        print(f"depths {left_out} left out: {args.layers} layers leave no layer after them")
    shape = {"layers": args.layers, "experts": args.experts, "top_k": args.top_k, "visual": args.visual, "text": args.text}
    rows = []
    for strength in strengths:
        for depth in depths:
            cases = [("none", 1.0)] + [(m, k) for k in keeps for m in METHODS]
            for method, keep in cases:
                rows.append({"routing": affinity_label(strength), "strength": strength, "depth": depth,
                             "compression": method, "keep": keep,
                             **case_figures(strength, method, keep, depth, shape, args.requests)})
    top = max(1, args.experts // 8)
    print(f"## working set after the prefix ({args.layers} layers x {args.experts} experts, top-{args.top_k}; "
          f"{args.visual} visual + {args.text} text tokens; {args.requests} requests)")
    print_table(["routing", "depth", "compression", "keep", "distinct experts", f"top-{top} share",
                 f"visual top-{top} share", "experts for 90%"],
                [[r["routing"], r["depth"], r["compression"], r["keep"], f"{r['distinct']:.1f}",
                  f"{r['concentration']:.3f}", f"{r['concentration_visual']:.3f}", f"{r['cover90']:.1f}"] for r in rows])
    keep, depth = (0.5 if 0.5 in keeps else keeps[0]), depths[0]
    grid = sorted(set(strengths) | {0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0})
    curve = gain_curve(grid, keep, depth, shape, args.requests)
    targets = {"paper": args.paper_gain}
    if args.fit_study:
        targets["trained model"] = study_gain(args.fit_study)
    if args.fit_gain is not None:
        targets["given"] = args.fit_gain
    fits = {name: {"gain": g, "strength": fit_strength(g, curve)} for name, g in targets.items()}
    print(f"\n## concentration gain of affinity pruning (keep {keep}, depth {depth}) over none, by strength")
    print_table(["routing", "gain"], [[affinity_label(s), f"{g:+.1%}"] for s, g in curve])
    for name, fit in fits.items():
        found = "not reached in [0, 1]" if fit["strength"] is None else f"affinity={fit['strength']:.3f}"
        print(f"fitted to the {name} gain {fit['gain']:+.1%}: {found}")
    best = max(curve, key=lambda point: point[1])
    print(f"(the largest gain on this grid: {best[1]:+.1%} at affinity={best[0]:g})")
    ep = [{"routing": affinity_label(s), "strength": s, "ranks": r, "image_share": share,
           "imbalance": ep_imbalance(s, shape, args.requests, share, r)}
          for s in strengths for r in ranks for share in (args.image_share, 1.0)]
    print(f"\n## ReaLB's scenario: per-rank imbalance (max/mean pairs, mean over layers) of a batch of "
          f"{args.requests} requests, each image its own preference")
    print_table(["routing", "ranks", "requests with an image", "imbalance max/mean"],
                [[e["routing"], e["ranks"], f"{e['image_share']:.0%}", f"{e['imbalance']:.3f}"] for e in ep])
    save_json(args.out, "affinity_whatif.json", {
        "what": "synthetic routing with the labelled affinity what-if (vismmoe_kt/routing/affinity.py)",
        "shape": shape, "requests": args.requests, "rows": rows,
        "gain_curve": {"keep": keep, "depth": depth, "points": [{"strength": s, "gain": g} for s, g in curve]},
        "fits": fits, "ep": ep})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
