"""How well VisMMOE's lookahead predictor does on synthetic routing, given features that carry it.

    python -m benchmarks.predictor_study [--predictor FILE] [--train-requests 400]
        [--test-requests 24] [--tokens 48] [--epochs 3] [--ablations no-recent,...] [--out DIR]

The synthetic router (vismmoe_kt/routing) routes each token from a latent residual stream h_l; a
model with random weights (what the benchmarks run) has hidden states unrelated to it, so a
predictor fed those states can only learn from the routing history. This study trains the project's
LookaheadPredictor as `vismmoe-kt calibrate synthetic` trains it (same requests: Qwen3-VL-30B-A3B's
layout, a 236-token prompt with 200 vision tokens, then --tokens decode tokens; same settings), or
evaluates a predictor file it wrote (--predictor), and reports Hot Recall@B on the decode tokens of
held-out requests (seeds 500000 + i, which no calibration uses):

    calibrated             the router's latent h_l as the hidden state, the previous token's experts and
                           the request's recent expert usage (the predictor `calibrate synthetic` writes)
and, with --ablations, the same trained on the same requests without
    no-recent              the recent-usage feature (the predictor of 2026-11-30, at this size)
    paper                  the per-layer maps, the previous token and recent usage (the paper's model)
    history-only           any hidden or visual feature
    noise                  the latent: random vectors instead (what a random-weight model's states are)
and two references: the router's own lookahead (layer l+1's router applied to h_l, knowing the
request's hot set and the corpus skew: the best any predictor of h_l can do) and a random guess.
It also gives the calibrated predictor's Hot Recall@20 by decode position (the recent-usage feature
knows nothing at the first token) and its forward time at batch 1 on the CPU.
"""

from __future__ import annotations

import time

import torch

from vismmoe_kt.apps.calibrate import SYNTHETIC_DEFAULTS, synthetic_config, synthetic_request, synthetic_seeds
from benchmarks.results import print_table, save_json
from vismmoe_kt.errors import InputError
from vismmoe_kt.predictor.calibration import calibrate_requests, forward_seconds, phase_rows, samples_from_requests
from vismmoe_kt.predictor.model import LookaheadPredictor, Samples, hot_recall
from vismmoe_kt.routing.synthetic import SyntheticRouter
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

LAYERS, EXPERTS, TOP_K = 48, 128, 8
TEST_SEEDS = 500_000
PROMPT, VISUAL = 236, 200
ABLATIONS = {"no-recent": {"recent": False},
             "paper": {"layer_heads": 0, "previous_token": False, "recent": False},
             "history-only": {"use_features": False},
             "noise": {}}
BUDGETS = (10, 20, 30)


def requests(seeds: range, tokens: int):
    return (synthetic_request(s, LAYERS, EXPERTS, TOP_K, PROMPT, VISUAL, tokens) for s in seeds)


def router_lookahead(seeds: range, tokens: int, budget: int = 20) -> float:
    """Hot Recall@budget of layer l+1's router applied to the decode tokens' h_l (biases included)."""
    hits, total = 0.0, 0
    for seed in seeds:
        router = SyntheticRouter(LAYERS, EXPERTS, TOP_K, seed=seed)
        modality = torch.zeros(PROMPT, dtype=torch.bool)
        modality[10:10 + VISUAL] = True
        router.route(PROMPT, modality, "prefill")
        routing = router.route(tokens, None, "decode")
        for layer in range(LAYERS - 1):
            top = router.next_layer_logits(routing.hidden[:, layer], layer).topk(budget, dim=-1).indices  # (T, B)
            used = routing.ids[:, layer + 1]                                                              # (T, k)
            hits += float((used[:, :, None] == top[:, None, :]).any(-1).float().mean(-1).sum())
            total += tokens
    return hits / total


def with_noise(data: Samples, seed: int) -> Samples:
    generator = torch.Generator().manual_seed(seed)
    return Samples(*(torch.randn(data.hidden.shape, generator=generator) if f == "hidden" else getattr(data, f)
                     for f in Samples.FIELDS))


def recall_row(model, data: Samples) -> dict[str, float]:
    return {f"@{b}": round(hot_recall(model, data, b), 4) for b in BUDGETS}


def by_position(model, data: Samples, tokens: int, buckets=((0, 1), (1, 8), (8, 24), (24, None))) -> dict[str, float]:
    """Hot Recall@20 over decode positions [a, b) (rows ordered request, token, layer)."""
    position = torch.arange(len(data.layer)) // (LAYERS - 1) % tokens
    out = {}
    for start, end in buckets:
        end = tokens if end is None else min(end, tokens)
        if start < end:
            out[f"tokens {start + 1}-{end}"] = round(hot_recall(model, data.subset((position >= start) & (position < end)),
                                                                20), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--predictor", help="evaluate this predictor file (calibrate synthetic's) instead of training one")
    parser.add_argument("--train-requests", type=int, default=SYNTHETIC_DEFAULTS["requests"], help="training requests")
    parser.add_argument("--valid-requests", type=int, default=SYNTHETIC_DEFAULTS["valid_requests"],
                        help="validation requests (early stopping)")
    parser.add_argument("--test-requests", type=int, default=24, help="held-out requests the Hot Recall is measured on")
    parser.add_argument("--tokens", type=int, default=SYNTHETIC_DEFAULTS["tokens"], help="decode tokens per request")
    parser.add_argument("--epochs", type=int, default=SYNTHETIC_DEFAULTS["epochs"], help="at most this many training epochs")
    parser.add_argument("--device", default="cpu", help="where to train")
    parser.add_argument("--ablations", default="", help=f"comma-separated, of: {', '.join(ABLATIONS)}")
    parser.add_argument("--out", help="also write predictor_study.json here")
    args = parser.parse_args(argv)
    ablations = [a for a in args.ablations.split(",") if a]
    unknown = sorted(set(ablations) - set(ABLATIONS))
    if unknown:
        parser.error(f"--ablations: unknown {unknown}; known: {', '.join(ABLATIONS)}")
    start = time.perf_counter()
    say = lambda line: print(line, flush=True)  # noqa: E731

    config = synthetic_config(LAYERS, EXPERTS)
    if args.predictor:
        try:
            model = LookaheadPredictor.load(args.predictor, expect={"num_layers": LAYERS, "num_experts": EXPERTS,
                                                                    "hidden_source": "synthetic"})
        except ValueError as exc:
            raise InputError(str(exc)) from None
        config = model.config
    test = phase_rows(samples_from_requests(requests(range(TEST_SEEDS, TEST_SEEDS + args.test_requests), args.tokens),
                                            config), "decode")
    results: dict[str, dict] = {}
    details: dict[str, dict] = {}
    need_training = not args.predictor or ablations
    if need_training:
        say(f"routing {args.train_requests} training and {args.valid_requests} validation requests")
        train_seeds, valid_seeds = synthetic_seeds(0, args.train_requests, args.valid_requests)  # calibrate's
        train_data = samples_from_requests(requests(train_seeds, args.tokens), config)
        valid_data = samples_from_requests(requests(valid_seeds, args.tokens), config)

    def fit(name: str, options: dict, noise: bool = False):
        size = {k: getattr(config, k) for k in ("width", "layer_heads", "history_dim")}
        cfg = synthetic_config(LAYERS, EXPERTS, config.window, config.gamma, config.recent_decay, **{**size, **options})
        say(f"training: {name}")
        train_rows, valid_rows = (with_noise(train_data, 1), with_noise(valid_data, 2)) if noise \
            else (train_data, valid_data)
        trained, report = calibrate_requests(cfg, train_rows, valid_rows, epochs=args.epochs, device=args.device,
                                             lr=SYNTHETIC_DEFAULTS["lr"], batch=SYNTHETIC_DEFAULTS["batch"],
                                             progress=lambda line: say("  " + line))
        details[name] = {"epochs_run": report["epochs_run"], "train_seconds": report["train_seconds"]}
        return trained

    if not args.predictor:
        model = fit("calibrated", {})
    results["calibrated"] = recall_row(model, test)
    details.setdefault("calibrated", {}).update(
        source=args.predictor or "trained here", by_position=by_position(model, test, args.tokens),
        forward_ms_cpu_batch1=round(1000 * forward_seconds(model), 3),
        parameters=sum(p.numel() for p in model.parameters()), config=dict(vars(model.config)))
    say(f"calibrated: {results['calibrated']}, by position {details['calibrated']['by_position']}")
    for name in ablations:
        noise = name == "noise"
        trained = fit(name, ABLATIONS[name], noise)
        results[name] = recall_row(trained, with_noise(test, 3) if noise else test)
        say(f"{name}: {results[name]}")
    results["router's own lookahead"] = {"@20": round(router_lookahead(range(TEST_SEEDS, TEST_SEEDS + args.test_requests),
                                                                       args.tokens), 4)}
    results["random guess"] = recall_row(None, test)
    print_table(["predictor", "Hot Recall@10", "@20", "@30"],
                [[name, r.get("@10", "-"), r["@20"], r.get("@30", "-")] for name, r in results.items()])
    print(f"calibrated predictor: {details['calibrated']['parameters']} parameters, forward at batch 1 on the CPU "
          f"{details['calibrated']['forward_ms_cpu_batch1']} ms; study {time.perf_counter() - start:.0f} s")
    save_json(args.out, "predictor_study.json", {
        "train_requests": args.train_requests if need_training else None, "valid_requests": args.valid_requests,
        "test_requests": args.test_requests, "test_seeds": f"{TEST_SEEDS}..", "tokens": args.tokens,
        "prompt_tokens": PROMPT, "visual_tokens": VISUAL, "epochs": args.epochs, "results": results,
        "details": details, "seconds": round(time.perf_counter() - start, 1)})
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except InputError as exc:
        print(f"error: {exc}", file=__import__("sys").stderr)
        raise SystemExit(2)
