"""Eviction rankings against Belady on synthetic routing: one slab pool shared by the offloaded layers.

    python -m vismmoe_kt.apps.measure.eviction_study [--slabs 1692] [--requests 3] [--decode-tokens 32]
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
    belady          the one needed furthest in the future (offline optimum)
"""

from __future__ import annotations

import argparse
import heapq
from typing import Callable

import torch

from vismmoe_kt.apps.measure.results import print_table, save_json
from vismmoe_kt.routing.synthetic import SyntheticRouter

LAYERS, EXPERTS, TOP_K = 48, 128, 8
PROMPT, VISUAL = 236, 200
Key = tuple[int, int]


def synthetic_requests(layers: int, experts: int, top_k: int, requests: int, decode_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(ids [T, L, k], prompt tokens) per request: seed i's prompt, then its decode tokens."""
    out = []
    for seed in range(requests):
        router = SyntheticRouter(layers, experts, top_k, seed=seed)
        visual = torch.zeros(PROMPT, dtype=torch.bool)
        visual[10:10 + VISUAL] = True
        prompt = router.prefill(modality=visual)
        out.append((torch.cat([prompt, router.route(decode_tokens, None, "decode").ids]), PROMPT))
    return out


def access_sequence(requests: int, decode_tokens: int, pinned: int = 1) -> list[tuple[Key, bool]]:
    """(layer, expert) accesses in order, each with whether it is a decode access."""
    sequence = []
    for ids, prompt in synthetic_requests(LAYERS, EXPERTS, TOP_K, requests, decode_tokens):
        for layer in range(pinned, LAYERS):
            sequence += [((layer, e), False) for e in sorted(set(ids[:prompt, layer].flatten().tolist()))]
        for token in ids[prompt:]:
            for layer in range(pinned, LAYERS):
                sequence += [((layer, e), True) for e in token[layer].tolist()]
    return sequence


def _rankings(per_token: int) -> dict[str, Callable[[dict, int], tuple]]:
    return {
        "lru": lambda u, now: (u["uses"][-1],),
        "lru-2": lambda u, now: (u["uses"][-2] if len(u["uses"]) > 1 else -1, u["uses"][-1]),
        "decode-count": lambda u, now: (u["decode"], u["uses"][-1]),
        "decayed-count": lambda u, now: (sum(0.5 ** ((now - t) / (4 * per_token)) for t in u["uses"][-16:]),
                                         u["uses"][-1]),
        "prompt-first": lambda u, now: (u["decode"] > 0, u["uses"][-1]),
    }


def decode_hit_rate(sequence: list[tuple[Key, bool]], slabs: int, rank: Callable[[dict, int], tuple]) -> float:
    cache: dict[Key, dict] = {}
    hits = total = 0
    for now, (key, decode) in enumerate(sequence):
        entry = cache.get(key)
        total += decode
        if entry is not None:
            hits += decode
        else:
            if len(cache) >= slabs:
                del cache[min(cache, key=lambda k: rank(cache[k], now))]
            entry = cache[key] = {"uses": [], "decode": 0}
        entry["uses"].append(now)
        entry["decode"] += decode
    return hits / total


def belady_decode_hit_rate(sequence: list[tuple[Key, bool]], slabs: int) -> float:
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slabs", type=int, default=1692)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--out", help="also write eviction_study.json here")
    args = parser.parse_args()
    sequence = access_sequence(args.requests, args.decode_tokens)
    results = {"belady": belady_decode_hit_rate(sequence, args.slabs)}
    for name, rank in _rankings((LAYERS - 1) * TOP_K).items():
        results[name] = decode_hit_rate(sequence, args.slabs, rank)
    print_table(["ranking", "decode hit rate"], [[name, f"{100 * rate:.1f}%"] for name, rate in results.items()])
    save_json(args.out, "eviction_study.json", {"slabs": args.slabs, "requests": args.requests,
                                                "decode_tokens": args.decode_tokens, "decode_hit_rate": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
