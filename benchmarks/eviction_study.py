"""Eviction rankings against Belady on synthetic routing: one slab pool shared by the offloaded layers.

    python -m benchmarks.eviction_study [--slabs 1692] [--requests 3] [--decode-tokens 32]
        [--out DIR]

Each request is a prompt of 236 tokens (200 of them visual, as a 448 px image gives) and then
--decode-tokens decoded ones, routed by the synthetic router (Qwen3-VL-30B-A3B's 48 x 128 experts,
top-8; request i uses seed i). Layer 0 is pinned, like VisMMOE's one-layer prefix at 16 GiB; the
other 47 share --slabs slabs (1692 at 16 GiB). Prefill touches each layer's distinct experts once,
in layer order (the placement path); decode touches every routed expert, token by token, and a
miss takes a slab (landing). Decode hit rates per ranking of the victim (the smallest key goes):

    lru             last use
    lru-2           second-to-last use (never used twice: first)
    decode-count    uses in decode, then last use
    decayed-count   uses weighted by 0.5 ** (age / 4 tokens), then last use
    prompt-first    experts only the prompt used, then last use
    router-probability   an average over decode tokens (weight 0.8 per token) of the router's full
                    softmax probability for the expert, not only whether it was in the top-k; then
                    last use (what a router tells beyond its choice)
    next-token-oracle    the same average of the *next* token's router probabilities: the best any
                    predictor of the next token's routing can give this kind of ranking
    belady          the one needed furthest in the future (offline optimum)
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

import torch

from benchmarks.results import print_table, save_json
from vismmoe_kt.routing.synthetic import SyntheticRouter
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

LAYERS, EXPERTS, TOP_K = 48, 128, 8
PROMPT, VISUAL = 236, 200
Key = tuple[int, int]


def request_routing(seed: int, layers: int, experts: int, top_k: int, decode_tokens: int):
    """(router, prompt ids [PROMPT, L, k], decode Routing of `decode_tokens`) of request `seed`."""
    router = SyntheticRouter(layers, experts, top_k, seed=seed)
    visual = torch.zeros(PROMPT, dtype=torch.bool)
    visual[10:10 + VISUAL] = True
    prompt = router.route(PROMPT, visual.to(torch.uint8), "prefill").ids
    return router, prompt, router.route(decode_tokens, None, "decode")


def synthetic_requests(layers: int, experts: int, top_k: int, requests: int, decode_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(ids [T, L, k], prompt tokens) per request: seed i's prompt, then its decode tokens."""
    out = []
    for seed in range(requests):
        _, prompt, routing = request_routing(seed, layers, experts, top_k, decode_tokens)
        out.append((torch.cat([prompt, routing.ids]), PROMPT))
    return out


def access_sequence(requests: int, decode_tokens: int, pinned: int = 1, router_events: bool = False) -> list[tuple]:
    """(layer, expert) accesses in order, each with whether it is a decode access; with `router_events`,
    before each decode layer's accesses a ("router", layer, probabilities [E], next token's [E]) event."""
    sequence = []
    for seed in range(requests):  # one token more than counted: the last token's next
        router, prompt, routing = request_routing(seed, LAYERS, EXPERTS, TOP_K, decode_tokens + 1)
        for layer in range(pinned, LAYERS):
            sequence += [((layer, e), False) for e in sorted(set(prompt[:, layer].flatten().tolist()))]
        for token in range(decode_tokens):
            for layer in range(pinned, LAYERS):
                if router_events:
                    now, after = (torch.softmax(router.logits(layer, routing.hidden[t, layer]), -1).numpy()
                                  for t in (token, token + 1))
                    sequence.append(("router", layer, now, after))
                sequence += [((layer, e), True) for e in routing.ids[token, layer].tolist()]
    return sequence


def router_ranking(oracle: bool, keep: float = 0.8) -> tuple[Callable[[dict, int], tuple], Callable[[tuple], None]]:
    """(rank, observe) of the router-probability ranking (the next token's with `oracle`)."""
    scores = np.zeros((LAYERS, EXPERTS))

    def observe(event: tuple) -> None:
        _, layer, now, after = event
        scores[layer] = keep * scores[layer] + (1 - keep) * (after if oracle else now)

    return (lambda u, now: (scores[u["key"]], u["uses"][-1])), observe


def _rankings(per_token: int) -> dict[str, Callable[[dict, int], tuple]]:
    return {
        "lru": lambda u, now: (u["uses"][-1],),
        "lru-2": lambda u, now: (u["uses"][-2] if len(u["uses"]) > 1 else -1, u["uses"][-1]),
        "decode-count": lambda u, now: (u["decode"], u["uses"][-1]),
        "decayed-count": lambda u, now: (sum(0.5 ** ((now - t) / (4 * per_token)) for t in u["uses"][-16:]),
                                         u["uses"][-1]),
        "prompt-first": lambda u, now: (u["decode"] > 0, u["uses"][-1]),
    }


def decode_hit_rate(sequence: list[tuple], slabs: int, rank: Callable[[dict, int], tuple],
                    observe: Callable[[tuple], None] | None = None) -> float:
    cache: dict[Key, dict] = {}
    hits = total = 0
    for now, item in enumerate(sequence):
        if item[0] == "router":
            if observe is not None:
                observe(item)
            continue
        key, decode = item
        entry = cache.get(key)
        total += decode
        if entry is not None:
            hits += decode
        else:
            if len(cache) >= slabs:
                del cache[min(cache, key=lambda k: rank(cache[k], now))]
            entry = cache[key] = {"uses": [], "decode": 0, "key": key}
        entry["uses"].append(now)
        entry["decode"] += decode
    return hits / total


def belady_decode_hit_rate(sequence: list[tuple], slabs: int) -> float:
    sequence = [item for item in sequence if item[0] != "router"]
    following, seen = [0] * len(sequence), {}
    for i in range(len(sequence) - 1, -1, -1):
        key = sequence[i][0]
        following[i], seen[key] = seen.get(key, len(sequence) + 1), i
    cache: dict[Key, int] = {}
    heap: list[tuple[int, Key]] = []
    hits = total = 0
    for i, (key, decode) in enumerate(sequence):
        total += decode
        if key in cache:
            hits += decode
        elif len(cache) >= slabs:
            while True:  # lazy deletion: skip heap entries whose key was used again since
                negative, victim = heapq.heappop(heap)
                if cache.get(victim) == -negative:
                    break
            del cache[victim]
        cache[key] = following[i]
        heapq.heappush(heap, (-following[i], key))
    return hits / total


def main() -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--slabs", type=int, default=1692,
                        help="slabs shared by the 47 offloaded layers (1692: a 16 GiB budget)")
    parser.add_argument("--requests", type=int, default=3, help="synthetic requests (request i routes with seed i)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decoded tokens per request")
    parser.add_argument("--out", help="also write eviction_study.json here")
    args = parser.parse_args()
    sequence = access_sequence(args.requests, args.decode_tokens, router_events=True)
    results = {"belady": belady_decode_hit_rate(sequence, args.slabs)}
    for name, rank in _rankings((LAYERS - 1) * TOP_K).items():
        results[name] = decode_hit_rate(sequence, args.slabs, rank)
    for name, oracle in (("router-probability", False), ("next-token-oracle", True)):
        results[name] = decode_hit_rate(sequence, args.slabs, *router_ranking(oracle))
    print_table(["ranking", "decode hit rate"], [[name, f"{100 * rate:.1f}%"] for name, rate in results.items()])
    save_json(args.out, "eviction_study.json", {"slabs": args.slabs, "requests": args.requests,
                                                "decode_tokens": args.decode_tokens, "decode_hit_rate": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
