"""Fit the synthetic router's per-layer knobs to the published Qwen3-30B-A3B routing statistics.

    python -m benchmarks.fit_routing                  # fit, write the package's calibration, print the table
    python -m benchmarks.fit_routing --check          # only measure the current calibration against the targets
    python -m benchmarks.fit_routing --out FILE.json  # write elsewhere

Layer by layer, front to back (layer l's hidden state feeds layer l+1), a few rounds of coordinate
bisection move one knob per target, each over a monotone relation:
    rho_l       -> consecutive-token overlap of layer l   (the coupling c_l is lowered from its default
                                                            only where rho alone cannot reach the target)
    hot_l       -> per-prompt normalised entropy           (how strongly a prompt keeps to its hot set)
    hot_size_l  -> per-prompt top-16 share                 (how many experts the hot set holds)
    skew_l      -> corpus hot ratio: hottest expert / uniform share, pooled over a corpus of many short
                   prompts of one corpus_seed
then one global vision strength -> mean vision-prefill max / mean. Targets between the published layers
are interpolated, and where the published figures leave room targets.py says what was chosen and why.
Every evaluation uses fixed seeds and one thread: the fit is deterministic. Last, the real generator
(SyntheticRouter) runs with the fitted table on the fit seeds and on held-out seeds, and the achieved
statistics are printed beside the targets (hot-set Jaccard across kinds of prompts: across corpus seeds).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch

from vismmoe_kt.routing import targets
from vismmoe_kt.routing.calibration import DEFAULT_CALIBRATION, DEFAULTS, resolve_knobs
from vismmoe_kt.routing.stats import (concentration, hot_set_jaccard, layer_overlap, reuse_shares,
                                      trace_stats)
from vismmoe_kt.routing.synthetic import (SyntheticRouter, ar_step, directions, hot_profile, noise,
                                          router_matrices)
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

LAYERS, EXPERTS, TOP_K = targets.LAYERS, targets.EXPERTS, targets.TOP_K
FITTED = ("rho", "coupling", "hot", "hot_size", "skew")
RANGES = {"rho": (-0.9, 0.98), "hot": (0.0, 10.0), "hot_size": (TOP_K / EXPERTS, 1.0), "skew": (0.0, 3.0),
          "vision": (0.0, 8.0)}
STEPS = {"rho": 10, "coupling": 8, "hot": 9, "hot_size": 7, "skew": 9, "vision": 10}  # bisection steps
ALL = ("overlap", "reuse_within8", "entropy", "top16_share", "corpus_hot_ratio")
FIT_SEEDS, CORPUS_SEEDS, VISION_SEEDS, HELD_OUT_SEEDS = 0, 1000, 2000, 10_000  # first seed of each group


class Prompts:
    """Requests evaluated together at one layer: their noise, hot-set orders and running hidden state.
    S requests, T tokens, L layers, E experts, D latent dim."""

    def __init__(self, seeds: list[int], tokens: int, dim: int, temperature: np.ndarray, jump: float):
        drawn = [noise(s, tokens, LAYERS, dim) for s in seeds]
        self.eps = np.stack([d[0] for d in drawn])                # [S, T, L, D]
        self.jumped = np.stack([d[1] for d in drawn]) < jump      # [S, T]
        dirs = [directions(LAYERS, EXPERTS, s, corpus_seed=0) for s in seeds]
        self.hot_rank = np.stack([d["hot_rank"] for d in dirs])   # [S, L, E]
        self.skew = dirs[0]["skew"]                               # [L, E], one corpus
        self.temperature = temperature                            # [L]
        self.h_prev: np.ndarray | None = None                     # [S, T, D]: layer l-1's hidden state
        self._cache: tuple | None = None

    def projected(self, layer: int, rho: float, coupling: float, weights: np.ndarray) -> np.ndarray:
        """W_l h_l / temperature_l [S, T, E] for this rho and coupling (cached: bias-only changes reuse it)."""
        key = (layer, rho, coupling)
        if self._cache is None or self._cache[0] != key:
            s, t = self.jumped.shape
            z, zs = None, np.empty((s, t, self.eps.shape[-1]))
            rho_c = np.sqrt(1.0 - rho ** 2)
            for i in range(t):  # the generator's AR(1) step, batched over requests
                z = ar_step(z, self.eps[:, i, layer], self.jumped[:, i, None], rho, rho_c)
                zs[:, i] = z
            h = zs if self.h_prev is None else np.sqrt(coupling) * self.h_prev + np.sqrt(1.0 - coupling) * zs
            self._cache = (key, h, h @ weights[layer].T / self.temperature[layer])
        return self._cache[2]

    def bias(self, layer: int, k: dict) -> np.ndarray:
        """[S, E] text bias of this layer (synthetic.biases, one layer)."""
        hot = hot_profile(np.array([k["hot_size"]]), self.hot_rank[:, layer])  # [S, E]
        return k["skew"] * self.skew[layer] + k["hot"] * hot

    def stats(self, layer: int, k: dict, weights: np.ndarray, keys: tuple[str, ...] = ALL) -> dict[str, float]:
        """Of `keys`: overlap, reuse within 8, entropy and top-16 share (each the mean over requests) and
        the pooled corpus hot ratio. Concentration needs only counts, so the mask is built only if asked."""
        logits = self.projected(layer, k["rho"], k["coupling"], weights) + self.bias(layer, k)[:, None, :]
        top = np.argpartition(-logits, TOP_K - 1, axis=-1)[..., :TOP_K]  # [S, T, k]: the set is all we need
        s = top.shape[0]
        counts = np.bincount((top + EXPERTS * np.arange(s)[:, None, None]).ravel(),
                             minlength=s * EXPERTS).reshape(s, EXPERTS)
        out = {}
        if {"entropy", "top16_share"} & set(keys):
            conc = concentration(counts)
            out.update(entropy=float(conc["entropy"].mean()), top16_share=float(conc["top16_share"].mean()))
        if "corpus_hot_ratio" in keys:
            out["corpus_hot_ratio"] = float(concentration(counts.sum(0)[None])["hot_ratio"][0])
        if {"overlap", "reuse_within8"} & set(keys):
            mask = np.zeros(logits.shape, dtype=bool)
            np.put_along_axis(mask, top, True, axis=-1)
            mask = mask.transpose(1, 0, 2)  # [T, S, E]: requests where stats.py has layers
            out["overlap"] = float(layer_overlap(mask, np.ones(mask.shape[0], bool)).mean())
            if "reuse_within8" in keys:
                out["reuse_within8"] = float(reuse_shares(mask, (8,))[8].mean())
        return out

    def advance(self) -> None:
        self.h_prev = self._cache[1]
        self._cache = None


def solve(f, target: float, lo: float, hi: float, steps: int) -> float:
    """Bisection for f(x) = target on [lo, hi], f monotone (either direction); a bound when out of reach."""
    f_lo, f_hi = f(lo), f(hi)
    increasing = f_hi >= f_lo
    if (target <= f_lo) == increasing:
        return lo
    if (target >= f_hi) == increasing:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_layer(layer: int, prompts: Prompts, corpus: Prompts, weights: np.ndarray, start: dict, goal: dict,
              rounds: int, coupling: float) -> tuple[dict, dict]:
    k = dict(start)

    def measure(key: str, group: Prompts = prompts, **change) -> float:
        kk = {**k, **change}
        group.projected(layer, kk["rho"], kk["coupling"], weights)
        return group.stats(layer, kk, weights, (key,))[key]

    def hot_for(size: float) -> float:  # the hot strength that gives the target entropy with this hot-set size
        return solve(lambda x: measure("entropy", hot=x, hot_size=size), goal["entropy"], *RANGES["hot"],
                     STEPS["hot"])

    for _ in range(rounds):
        k["coupling"] = coupling
        k["rho"] = solve(lambda x: measure("overlap", rho=x), goal["overlap"], *RANGES["rho"], STEPS["rho"])
        if layer > 0 and k["rho"] in RANGES["rho"] and abs(measure("overlap") - goal["overlap"]) > 0.01:
            # what layer l inherits pins the overlap: rho cannot reach it, so inherit less (lower c_l)
            k["coupling"] = solve(lambda c: measure("overlap", coupling=c), goal["overlap"], 0.0, coupling,
                                  STEPS["coupling"])
        # entropy and top-16 share both move with strength and size: nested, the size outside
        k["hot_size"] = solve(lambda x: measure("top16_share", hot=hot_for(x), hot_size=x), goal["top16_share"],
                              *RANGES["hot_size"], STEPS["hot_size"])
        k["hot"] = hot_for(k["hot_size"])
        k["skew"] = solve(lambda x: measure("corpus_hot_ratio", corpus, skew=x), goal["corpus_hot_ratio"],
                          *RANGES["skew"], STEPS["skew"])
    achieved = {**prompts.stats(layer, k, weights),
                "corpus_hot_ratio": measure("corpus_hot_ratio", corpus)}
    prompts.projected(layer, k["rho"], k["coupling"], weights)
    prompts.advance()
    corpus.advance()
    return k, achieved


def vision_ratio(table: dict, seeds: list[int], tokens: int) -> list[float]:
    """Per-layer vision-prefill max / mean, averaged over images of `tokens` vision tokens."""
    per_layer = []
    for seed in seeds:
        ids = SyntheticRouter(LAYERS, EXPERTS, TOP_K, seed=seed, calibration=table).route(
            tokens, modality=torch.ones(tokens, dtype=torch.uint8), phase="prefill").ids
        per_layer.append(trace_stats(ids, EXPERTS, modality=torch.ones(tokens), phase=torch.zeros(tokens))
                         ["per_layer"]["vision_max_mean"])
    return np.mean(per_layer, axis=0).tolist()


def _route(table: dict, seed: int, tokens: int, corpus_seed: int = 0) -> torch.Tensor:
    return SyntheticRouter(LAYERS, EXPERTS, TOP_K, seed=seed, corpus_seed=corpus_seed, calibration=table).route(
        tokens).ids


def measure_table(table: dict, seeds: list[int], tokens: int, corpus_seeds: list[int], corpus_tokens: int,
                  vision_seeds: list[int], vision_tokens: int) -> dict:
    """The real generator's statistics with `table`: what the fit reports and the tests check."""
    traces = [_route(table, s, tokens) for s in seeds]
    st = trace_stats(torch.cat(traces), EXPERTS, request_ids=torch.arange(len(seeds)).repeat_interleave(tokens))
    per_prompt_overlap = [float(np.mean(trace_stats(t, EXPERTS)["per_layer"]["overlap"])) for t in traces]
    corpus = trace_stats(torch.cat([_route(table, s, corpus_tokens) for s in corpus_seeds]), EXPERTS)
    # different kinds of prompts: each its own corpus (its own skew), as in the published comparison
    kinds = [_route(table, s, tokens, corpus_seed=1 + i) for i, s in enumerate(seeds)]
    vision = vision_ratio(table, vision_seeds, vision_tokens)
    pl = st["per_layer"]

    def jaccard(group: list[torch.Tensor], top: int) -> float:
        pairs = itertools.combinations(group, 2)
        return float(np.mean([hot_set_jaccard(a, b, EXPERTS, top)["mean"] for a, b in pairs]))

    overall = {**st["overall"], "corpus_hot_ratio": corpus["overall"]["corpus_hot_ratio"],
               "overlap_prompt_min": min(per_prompt_overlap), "overlap_prompt_max": max(per_prompt_overlap),
               "entropy_layer_min": min(pl["entropy"]), "entropy_layer_max": max(pl["entropy"]),
               "top16_layer_min": min(pl["top16_share"]), "top16_layer_max": max(pl["top16_share"]),
               "jaccard_kinds_top16": jaccard(kinds, 16), "jaccard_kinds_top8": jaccard(kinds, 8),
               "jaccard_same_corpus_top16": jaccard(traces, 16),
               "vision_max_mean": float(np.mean(vision)), "vision_max_mean_min": float(np.min(vision)),
               "vision_max_mean_max": float(np.max(vision))}
    return {"overall": overall, "per_layer": {**pl, "corpus_hot_ratio": corpus["per_layer"]["corpus_hot_ratio"],
                                              "vision_max_mean": vision}}


ROWS = [  # statistic, published target, where to read it
    ("overlap, mean over layers", "0.43", "overlap"),
    ("overlap, per prompt (min..max)", "0.35..0.51", ("overlap_prompt_min", "overlap_prompt_max")),
    ("overlap, layer 0", "0.08", ("per_layer", "overlap", 0)),
    ("overlap, layers 6-7 (mean)", "0.55..0.60", ("per_layer", "overlap", slice(6, 8))),
    ("overlap, layers 18-31 (mean)", "0.55..0.60", ("per_layer", "overlap", slice(18, 32))),
    ("overlap, layer 47", "0.21", ("per_layer", "overlap", 47)),
    ("reuse distance, median (tokens)", "2", "reuse_median"),
    ("reuse at the next token", "0.45", "reuse_next"),
    ("reuse within 8 tokens", "0.80", "reuse_within8"),
    ("entropy / log E, mean", "0.62..0.81", "entropy"),
    ("entropy, layers (min..max)", "0.62..0.875", ("entropy_layer_min", "entropy_layer_max")),
    ("entropy, layer 0", "0.875", ("per_layer", "entropy", 0)),
    ("top-16 share, mean", "0.54..0.62", "top16_share"),
    ("top-16 share, layers (min..max)", "0.41..0.62", ("top16_layer_min", "top16_layer_max")),
    ("top-16 share, layer 0", "0.41", ("per_layer", "top16_share", 0)),
    ("corpus hottest / uniform", "2.7", "corpus_hot_ratio"),
    ("hot-set Jaccard, kinds, top-16", "0.03..0.07", "jaccard_kinds_top16"),
    ("hot-set Jaccard, kinds, top-8", "0.03..0.07", "jaccard_kinds_top8"),
    ("hot-set Jaccard, one corpus, top-16", "-", "jaccard_same_corpus_top16"),
    ("vision prefill max/mean, mean", "5..6", "vision_max_mean"),
    ("vision prefill max/mean, layers", "2..12", ("vision_max_mean_min", "vision_max_mean_max")),
]


def report(fit: dict, held: dict, table: dict) -> str:
    def value(stats: dict, key) -> str:
        if isinstance(key, str):
            return f"{stats['overall'][key]:.3f}"
        if key[0] == "per_layer":
            return f"{np.mean(np.asarray(stats['per_layer'][key[1]])[key[2]]):.3f}"
        return f"{stats['overall'][key[0]]:.3f}..{stats['overall'][key[1]]:.3f}"

    lines = [f"{'statistic':36s} {'target':>11s} {'fit seeds':>13s} {'held-out':>13s}", "-" * 76]
    lines += [f"{name:36s} {target:>11s} {value(fit, key):>13s} {value(held, key):>13s}" for name, target, key in ROWS]
    goal = {"overlap": targets.overlap_profile(), "entropy": targets.entropy_profile(),
            "top16_share": targets.top16_profile()}
    pl, kn = fit["per_layer"], table["per_layer"]
    lines += ["", "per layer (fit seeds): target/achieved; within 8, corpus hot ratio, vision max/mean; fitted knobs",
              f"{'layer':>5s} {'overlap':>11s} {'entropy':>11s} {'top16':>11s} {'win8':>5s} {'corpus':>6s} "
              f"{'vision':>6s} {'rho':>6s} {'c':>5s} {'hot':>5s} {'size':>5s} {'skew':>5s}"]
    for layer in range(LAYERS):
        lines.append(
            f"{layer:5d} {goal['overlap'][layer]:.3f}/{pl['overlap'][layer]:.3f} "
            f"{goal['entropy'][layer]:.3f}/{pl['entropy'][layer]:.3f} "
            f"{goal['top16_share'][layer]:.3f}/{pl['top16_share'][layer]:.3f} {pl['reuse_within8'][layer]:5.3f} "
            f"{pl['corpus_hot_ratio'][layer]:6.2f} {pl['vision_max_mean'][layer]:6.2f} {kn['rho'][layer]:6.3f} "
            f"{kn['coupling'][layer]:5.3f} {kn['hot'][layer]:5.2f} {kn['hot_size'][layer]:5.3f} "
            f"{kn['skew'][layer]:5.3f}")
    return "\n".join(lines)


def fit(args, seeds: list[int], corpus_seeds: list[int], vision_seeds: list[int], started: float) -> dict:
    base = resolve_knobs(LAYERS, calibration={})  # the built-in defaults, never an older fit
    weights = router_matrices(LAYERS, EXPERTS, base.dim)
    prompts = Prompts(seeds, args.tokens, base.dim, base.temperature, base.jump)
    corpus = Prompts(corpus_seeds, args.corpus_tokens, base.dim, base.temperature, base.jump)
    goal = {"overlap": targets.overlap_profile(), "entropy": targets.entropy_profile(),
            "top16_share": targets.top16_profile(), "reuse_within8": np.full(LAYERS, targets.REUSE_WITHIN8),
            "corpus_hot_ratio": np.full(LAYERS, targets.CORPUS_HOT_RATIO)}
    knobs = {"rho": 0.5, "coupling": args.coupling, "hot": 3.0, "hot_size": 0.6, "skew": 0.3}
    fitted = {name: [] for name in FITTED}
    print(f"fitting {LAYERS} layers: {args.requests} prompts x {args.tokens} decode tokens, corpus "
          f"{args.corpus_requests} x {args.corpus_tokens}, {args.rounds} rounds", flush=True)
    for layer in range(LAYERS):
        layer_goal = {key: float(goal[key][layer]) for key in goal}
        knobs, a = fit_layer(layer, prompts, corpus, weights, knobs, layer_goal, args.rounds, args.coupling)
        for name in FITTED:
            fitted[name].append(round(knobs[name], 4))
        print(f"[{layer + 1:2d}/{LAYERS}] {time.perf_counter() - started:5.1f}s  overlap {a['overlap']:.3f}/"
              f"{layer_goal['overlap']:.3f} win8 {a['reuse_within8']:.3f} entropy {a['entropy']:.3f}/"
              f"{layer_goal['entropy']:.3f} top16 "
              f"{a['top16_share']:.3f}/{layer_goal['top16_share']:.3f} corpus {a['corpus_hot_ratio']:.2f} | rho "
              f"{knobs['rho']:.3f} c {knobs['coupling']:.3f} hot {knobs['hot']:.2f} size {knobs['hot_size']:.3f} "
              f"skew {knobs['skew']:.3f}", flush=True)
    table = {"per_layer": {**fitted, "temperature": base.temperature.tolist()},
             "scalars": {"jump": base.jump, "dim": base.dim, "logit_scale": base.logit_scale}}

    def vision_at(v: float) -> float:
        table["per_layer"]["vision"] = [v]
        return float(np.mean(vision_ratio(table, vision_seeds, args.vision_tokens)))
    vision = round(solve(vision_at, targets.VISION_MAX_MEAN, *RANGES["vision"], STEPS["vision"]), 4)
    table["per_layer"]["vision"] = [vision] * LAYERS
    print(f"vision strength {vision:.4f}  ({time.perf_counter() - started:.1f}s)", flush=True)
    return table


def main() -> None:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_CALIBRATION, help="calibration JSON to write (or --check)")
    parser.add_argument("--check", action="store_true", help="measure the existing --out file; fit nothing")
    parser.add_argument("--requests", type=int, default=16, help="fit prompts (default 16)")
    parser.add_argument("--tokens", type=int, default=512, help="decode tokens per fit prompt (default 512)")
    parser.add_argument("--corpus-requests", type=int, default=64, help="prompts pooled as the corpus (default 64)")
    parser.add_argument("--corpus-tokens", type=int, default=128, help="tokens per corpus prompt (default 128)")
    parser.add_argument("--vision-requests", type=int, default=4, help="images for the vision prefill ratio")
    parser.add_argument("--vision-tokens", type=int, default=1024, help="vision tokens per image (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="coordinate-bisection rounds per layer (default 3)")
    parser.add_argument("--coupling", type=float, default=DEFAULTS["coupling"],
                        help=f"default layer-to-layer coupling c_l, lowered only where needed "
                             f"(default {DEFAULTS['coupling']})")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: the same float sums everywhere, so the same table
    seeds = list(range(FIT_SEEDS, FIT_SEEDS + args.requests))
    corpus_seeds = list(range(CORPUS_SEEDS, CORPUS_SEEDS + args.corpus_requests))
    vision_seeds = list(range(VISION_SEEDS, VISION_SEEDS + args.vision_requests))
    started = time.perf_counter()
    table = (json.loads(args.out.read_text()) if args.check
             else fit(args, seeds, corpus_seeds, vision_seeds, started))

    print("measuring the generator with the table (fit seeds, then held-out seeds)...", flush=True)
    fit_stats = measure_table(table, seeds, args.tokens, corpus_seeds, args.corpus_tokens, vision_seeds,
                              args.vision_tokens)
    held = [[HELD_OUT_SEEDS + s for s in group] for group in (seeds, corpus_seeds, vision_seeds)]
    held_stats = measure_table(table, held[0], args.tokens, held[1], args.corpus_tokens, held[2], args.vision_tokens)
    print(report(fit_stats, held_stats, table))
    if not args.check:
        table = {
            "model": "Qwen3-30B-A3B (the text MoE of Qwen3-VL-30B-A3B)", "layers": LAYERS, "experts": EXPERTS,
            "top_k": TOP_K, "written_by": "benchmarks/fit_routing.py", **table,
            "fit": {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "check")},
                    "first_seed": {"fit": seeds[0], "corpus": corpus_seeds[0], "vision": vision_seeds[0],
                                   "held_out": HELD_OUT_SEEDS},
                    "achieved": {k: round(v, 4) for k, v in fit_stats["overall"].items()},
                    "held_out": {k: round(v, 4) for k, v in held_stats["overall"].items()}},
        }
        args.out.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.out}")
    print(f"done in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
