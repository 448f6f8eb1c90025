"""Expert-cache hit rates of a routing trace: the offline optimum (Belady / MIN) and LRU.

A benchmark's expert cache can be judged against what is achievable: Belady's MIN policy, which knows
the future, is the best any policy of that capacity can do on that trace; LRU is the usual online
reference. Both replay a trace token by token, one cache per layer (experts of different layers are
different weights).

Model: at each token a layer needs the token's k experts resident at once (a set access). Experts
already resident are hits; each missing one is a miss and is loaded; when the cache is full, experts not
needed by this token are evicted: MIN evicts the one whose next use is furthest away (never used again
counts as furthest), LRU the least recently used. Each expert id access counts once: a token brings k
accesses. A capacity below k is an error (the token could not run).

Cold misses: the first access ever to an expert at a layer misses under any policy. Hit rates exclude
them from the denominator by default (hits / (accesses - cold)): a cache that holds every expert then
scores exactly 1.0, and a short trace is not penalised for warming up. `include_cold=True` gives
hits / accesses.

Warm-up: with `start=S` the first S tokens are replayed but not counted (e.g. a request's prompt
before its decode steps: the cache enters decode holding what the prompt left, chosen with knowledge
of the future under MIN).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

POLICIES = ("belady", "lru")


@dataclass(frozen=True)
class CacheResult:
    """Per-layer counts of one replay. L layers."""
    policy: str
    capacity: np.ndarray  # [L]
    accesses: np.ndarray  # [L] expert id accesses (tokens x k)
    hits: np.ndarray      # [L]
    cold: np.ndarray      # [L] first accesses (compulsory misses), a subset of the misses

    @property
    def misses(self) -> np.ndarray:
        return self.accesses - self.hits

    def hit_rate(self, include_cold: bool = False) -> float:
        """Overall hit rate (see the module docstring for the cold-miss convention); nan with no accesses."""
        total = self.accesses.sum() - (0 if include_cold else self.cold.sum())
        return float(self.hits.sum() / total) if total else float("nan")

    def layer_hit_rates(self, include_cold: bool = False) -> np.ndarray:
        total = self.accesses - (0 if include_cold else self.cold)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, self.hits / np.maximum(total, 1), np.nan)


def _ids(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.ndim == 2:  # one layer: [T, k]
        ids = ids[:, None, :]
    if ids.ndim != 3:
        raise ValueError(f"ids must be [tokens, layers, top_k] (or [tokens, top_k]), got shape {list(ids.shape)}")
    ids = ids.astype(np.int64)
    if ids.shape[2] > 1 and (np.diff(np.sort(ids, axis=-1), axis=-1) == 0).any():
        raise ValueError("a token lists the same expert twice at one layer: not a top-k routing")
    return ids


def _capacities(capacity: int | Sequence[int], layers: int, top_k: int) -> np.ndarray:
    caps = np.full(layers, capacity, dtype=np.int64) if np.ndim(capacity) == 0 else np.asarray(capacity, np.int64)
    if caps.shape != (layers,):
        raise ValueError(f"capacity must be an int or one value per layer ({layers}), got {len(caps)} values")
    if (caps < top_k).any():
        raise ValueError(f"capacity {int(caps.min())} is below top_k={top_k}: a token needs all its experts "
                         f"resident at once")
    return caps


def next_use(seq: np.ndarray) -> np.ndarray:
    """[T, k] ids of one layer -> [T, k] the next token index using the same expert (T: never again)."""
    # T tokens, k top-k. Sort all accesses by (expert, token): neighbours of one expert are consecutive uses.
    t_count, k = seq.shape
    tokens = np.repeat(np.arange(t_count), k)
    experts = seq.ravel()
    order = np.lexsort((tokens, experts))
    nxt = np.full(t_count * k, t_count, dtype=np.int64)
    same = experts[order[1:]] == experts[order[:-1]]
    nxt[order[:-1][same]] = tokens[order[1:][same]]
    return nxt.reshape(t_count, k)


def _belady_layer(seq: np.ndarray, capacity: int, start: int = 0) -> tuple[int, int]:
    """(hits, cold) of MIN on one layer. The cache maps expert -> its next use; a max-heap of
    (-next use, expert) finds the furthest, with lazy deletion of entries whose next use has moved on."""
    nxt = next_use(seq)
    rows, nrows = seq.tolist(), nxt.tolist()  # Python ints: the loop below is dict and heap work
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    seen: set[int] = set()
    hits = cold = 0
    push, pop = heapq.heappush, heapq.heappop
    for t, (row, nrow) in enumerate(zip(rows, nrows)):
        missing = [e for e in row if e not in cache]
        counted = t >= start
        hits += (len(row) - len(missing)) if counted else 0
        evict = len(cache) + len(missing) - capacity
        # Resident experts of this token have next use == now, every other resident one later, and there
        # are at least `evict` others (capacity >= k): the pops never take this token's experts.
        while evict > 0:
            negative, e = pop(heap)
            if cache.get(e) == -negative:
                del cache[e]
                evict -= 1
        for e, n in zip(row, nrow):
            cache[e] = n
            push(heap, (-n, e))
        for e in missing:
            if e not in seen:
                seen.add(e)
                cold += counted
    return hits, cold


def _lru_layer(seq: np.ndarray, capacity: int, start: int = 0) -> tuple[int, int]:
    cache: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    hits = cold = 0
    for t, row in enumerate(seq.tolist()):
        counted = t >= start
        missing = []
        for e in row:
            if e in cache:
                hits += counted
                cache.move_to_end(e)  # this token's hits go to the recent end: never evicted below
            else:
                missing.append(e)
        for e in missing:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[e] = None
            if e not in seen:
                seen.add(e)
                cold += counted
    return hits, cold


def simulate_cache(ids: Any, capacity: int | Sequence[int], policy: str = "belady", start: int = 0) -> CacheResult:
    """Replay ids [T, L, k] (or one layer [T, k]) through a per-layer expert cache of `capacity`
    experts (an int, or one per layer) under `policy` ("belady" or "lru"), counting tokens >= `start`."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    seqs = _ids(ids)
    t_count, layers, k = seqs.shape
    caps = _capacities(capacity, layers, k)
    run = _belady_layer if policy == "belady" else _lru_layer
    if not 0 <= start <= t_count:
        raise ValueError(f"start must be within the trace's {t_count} tokens, got {start}")
    counts = np.array([run(seqs[:, layer], int(caps[layer]), start) for layer in range(layers)], dtype=np.int64)
    counts = counts.reshape(layers, 2)
    accesses = np.full(layers, (t_count - start) * k, dtype=np.int64)
    return CacheResult(policy, caps, accesses, counts[:, 0], counts[:, 1])


def belady_hit_rate(ids: Any, capacity_per_layer: int | Sequence[int], include_cold: bool = False,
                    start: int = 0) -> float:
    """Optimal offline (Belady / MIN) hit rate of a per-layer expert cache; cold misses excluded by default."""
    return simulate_cache(ids, capacity_per_layer, "belady", start).hit_rate(include_cold)


def lru_hit_rate(ids: Any, capacity_per_layer: int | Sequence[int], include_cold: bool = False,
                 start: int = 0) -> float:
    """LRU hit rate of a per-layer expert cache, same conventions as `belady_hit_rate`."""
    return simulate_cache(ids, capacity_per_layer, "lru", start).hit_rate(include_cold)
