"""How well VisMMOE's lookahead predictor can do on synthetic routing, given features that carry it.

    python -m vismmoe_kt.apps.measure.predictor_study [--train-requests 24] [--test-requests 6]
        [--tokens 48] [--out DIR]

The synthetic router (vismmoe_kt/routing) routes each token from a latent residual stream h_l; a
model with random weights (what the benchmarks run) has hidden states unrelated to it, so a
predictor fed those states can only learn from the routing history. This study trains the project's
LookaheadPredictor (predictor/model.py, window 5) on synthetic decode tokens of Qwen3-VL-30B-A3B's
layout with three kinds of hidden-state feature, and reports Hot Recall@B on held-out requests:

    latent         the router's own h_l (what a trained model's hidden state is to its routing)
    history only   the predictor's history-only ablation (no hidden or visual feature)
    noise          random vectors of the same size (the random-weight model's case)
and two references: the router's own lookahead (layer l+1's router applied to h_l, the best any
predictor of h_l can do) and a random guess.
"""

from __future__ import annotations

import argparse

import torch

from vismmoe_kt.apps.measure.results import print_table, save_json
from vismmoe_kt.predictor.model import PredictorConfig, hot_recall, samples_from_steps, train
from vismmoe_kt.routing.synthetic import SyntheticRouter

LAYERS, EXPERTS, TOP_K = 48, 128, 8


def steps_of(seeds: range, tokens: int, feature: str) -> tuple[list[dict], float]:
    """Predictor steps (one per decode token) and the router's own lookahead Hot Recall@20."""
    steps, hits, total = [], 0.0, 0
    for seed in seeds:
        router = SyntheticRouter(LAYERS, EXPERTS, TOP_K, seed=seed)
        router.route(64, phase="prefill")
        routing = router.route(tokens, phase="decode")
        generator = torch.Generator().manual_seed(seed)
        for t in range(tokens):
            active = torch.zeros(LAYERS, EXPERTS, dtype=torch.bool)
            active.scatter_(1, routing.ids[t], True)
            hidden = routing.hidden[t].float()
            if feature == "noise":
                hidden = torch.randn(hidden.shape, generator=generator)
            steps.append({"active": active, "hidden": hidden, "visual": torch.zeros(1), "phase": "decode",
                          "new_request": t == 0})
            for layer in range(LAYERS - 1):
                top = router.logits(layer + 1, routing.hidden[t, layer]).topk(20).indices
                hits += float(torch.isin(routing.ids[t, layer + 1], top).float().mean())
                total += 1
    return steps, hits / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-requests", type=int, default=24)
    parser.add_argument("--test-requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48, help="decode tokens per request")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--out", help="also write predictor_study.json here")
    args = parser.parse_args()
    train_seeds = range(args.train_requests)
    test_seeds = range(1000, 1000 + args.test_requests)
    results: dict[str, dict[str, float]] = {}
    oracle = None
    for name, feature, extra in (("latent", "latent", {}),
                                 ("latent, the paper's model", "latent", {"layer_heads": 0, "previous_token": False}),
                                 ("history only", "latent", {"use_features": False}),
                                 ("noise", "noise", {})):
        train_steps, _ = steps_of(train_seeds, args.tokens, feature)
        test_steps, oracle = steps_of(test_seeds, args.tokens, feature)
        config = PredictorConfig(num_layers=LAYERS, num_experts=EXPERTS, hidden_size=train_steps[0]["hidden"].shape[1],
                                 visual_size=1, **extra)
        train_data, test_data = samples_from_steps(train_steps, config), samples_from_steps(test_steps, config)
        model, log = train(config, train_data, test_data, epochs=args.epochs)
        results[name] = {f"@{b}": round(hot_recall(model, test_data, b), 4) for b in (10, 20, 30)}
        results[name]["epochs"] = len(log)
        if name == "latent":
            results["random guess"] = {f"@{b}": round(hot_recall(None, test_data, b), 4) for b in (10, 20, 30)}
        print(name, results[name], flush=True)
    results["router's own lookahead"] = {"@20": round(oracle, 4)}
    print_table(["predictor", "Hot Recall@10", "@20", "@30"],
                [[name, r.get("@10", "-"), r["@20"], r.get("@30", "-")] for name, r in results.items()])
    save_json(args.out, "predictor_study.json", {"train_requests": args.train_requests, "test_requests":
                                                 args.test_requests, "tokens": args.tokens, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
