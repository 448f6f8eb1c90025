"""SlabCache under random routings and priority lists, with copies that land late (property tests).

A small simulator drives the cache the way the runtime does: each layer starts with the experts its
tokens chose; misses are fetched urgently (waiting for in-flight copies when no slab may be taken);
experts still in flight are waited for; then a random priority list is prefetched; some copies land
at random times. Invariants are checked after every layer.
"""

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from vismmoe_kt.runtime.slab_cache import VICTIMS_HEAD, SlabCache, SlabState


class CopySimulator:
    def __init__(self, cache, rng):
        self.cache, self.rng, self.in_flight = cache, rng, []
        self.assigned = 0

    def land(self, slab):
        self.in_flight.remove(slab)
        self.cache.complete(slab)

    def land_some(self):
        for slab in list(self.in_flight):
            if self.rng.random() < 0.5:
                self.land(slab)

    def run_layer(self, layer, needed, prefetch):
        cache = self.cache
        placed = cache.begin_layer(layer, needed)
        assert sorted(placed["hit"] + placed["late"] + placed["miss"]) == sorted(needed)
        keys = [(layer, e) for e in placed["miss"]]
        slabs = cache.assign_many(keys, urgent=True)
        while None in slabs:
            assert self.in_flight, "an urgent fetch found no slab although nothing was in flight"
            self.land(self.in_flight[0])
            missing = [k for k, s in zip(keys, slabs) if s is None]
            got = iter(cache.assign_many(missing, urgent=True))
            slabs = [s if s is not None else next(got) for s in slabs]
        self.assigned += len(keys)
        for slab in slabs:
            self.in_flight.append(slab)
            cache.use(slab)
        for expert in needed:  # compute waits for the copies it needs
            slab = cache.where[(layer, expert)]
            if cache.state[slab] is SlabState.IN_FLIGHT:
                self.land(slab)
        in_use = {cache.where[(layer, e)] for e in needed}
        assert all(cache.state[s] is SlabState.RESIDENT and cache.owner[s][0] == layer for s in in_use)
        assert in_use == cache.in_use
        wanted = [(k, p) for k, p in sorted(prefetch, key=lambda kp: -kp[1]) if k not in cache.where]
        wanted = list(dict(wanted).items())
        issued = cache.assign_many([k for k, _ in wanted], [p for _, p in wanted])
        for slab in issued:
            if slab is not None:
                self.in_flight.append(slab)
                self.assigned += 1
        # the prefetch must not have taken anything this layer uses
        assert all(cache.owner[cache.where[(layer, e)]] == (layer, e) for e in needed)
        self.land_some()
        cache.end_layer(layer)
        cache.check_invariants()


routing = st.fixed_dictionaries({
    "layers": st.integers(2, 6), "experts": st.integers(4, 16), "extra_slabs": st.integers(0, 40),
    "policy": st.sampled_from(["vismmoe", "lru"]), "seed": st.integers(0, 2**31), "steps": st.integers(5, 25),
})


@settings(max_examples=150, deadline=None)
@given(routing)
def test_cache_invariants_over_random_steps(p):
    rng = random.Random(p["seed"])
    layers = list(range(p["layers"]))
    slabs = min(p["experts"] + p["extra_slabs"], p["layers"] * p["experts"])
    cache = SlabCache(slabs, layers, p["policy"])
    sim = CopySimulator(cache, rng)
    needed_total = 0
    for _ in range(p["steps"]):
        for layer in layers:
            needed = rng.sample(range(p["experts"]), rng.randint(1, p["experts"]))
            prefetch = [((rng.choice(layers), rng.randrange(p["experts"])), rng.random()) for _ in range(rng.randint(0, 2 * p["experts"]))]
            sim.run_layer(layer, needed, prefetch)
            needed_total += len(needed)
    c = cache.counters
    assert c.hits + c.late + c.misses == needed_total
    assert c.prefetches + c.fetches == sim.assigned
    assert c.prefetch_used + c.prefetch_wasted <= c.prefetches
    occupied = sum(owner is not None for owner in cache.owner)
    assert c.evictions == sim.assigned - occupied


def test_eviction_order_expired_first_then_lowest_priority_speculative():
    cache = SlabCache(4, [0, 1, 2, 3], "vismmoe")
    for key in [(0, 0), (1, 0), (2, 0), (3, 0)]:
        cache.complete(cache.assign(key, priority=0.5))
    cache.set_priorities({(2, 0): 0.9, (3, 0): 0.1})
    cache.begin_layer(0, [0])
    cache.end_layer(0)
    cache.begin_layer(1, [0])
    # layer 0 ran this step: its expert is Expired; layer 1's is Required
    assert [cache.classify(s) for s in range(4)] == ["expired", "required", "speculative", "speculative"]
    assert cache.owner[cache.victim()] == (0, 0)
    cache.end_layer(1)
    cache.begin_layer(2, [0])
    # two expired now (layers 0 and 1): the least recently used goes first (layer 0's), not the one
    # the previous layer just used (ranking by layer distance evicted exactly that in decode)
    assert cache.owner[cache.victim()] == (0, 0)
    cache.end_layer(2)
    cache.begin_layer(3, [0])
    cache.end_layer(3)
    cache.begin_layer(0, [0])  # the next step: nothing has run yet, the others are Speculative again
    # and the one without a listed priority (layer 1's) ranks below every listed one
    assert cache.owner[cache.victim()] == (1, 0)
    cache.end_layer(0)


def test_prefetch_never_evicts_a_more_important_speculative_expert():
    cache = SlabCache(2, [0, 1, 2], "vismmoe")
    cache.complete(cache.assign((1, 0), priority=0.9))
    cache.complete(cache.assign((2, 0), priority=0.8))
    cache.begin_layer(0, [])
    assert cache.assign((1, 1), priority=0.5) is None  # both residents matter more
    slab = cache.assign((1, 2), priority=0.85)         # beats (2, 0)
    assert slab is not None and cache.where.get((2, 0)) is None
    cache.end_layer(0)


def test_lru_evicts_the_least_recently_used():
    cache = SlabCache(2, [0, 1], "lru")
    cache.begin_layer(0, [])
    for key in [(0, 0), (0, 1)]:
        slab = cache.assign(key, urgent=True)
        cache.complete(slab)
    cache.end_layer(0)
    cache.begin_layer(1, [])
    cache.end_layer(1)
    cache.begin_layer(0, [1])  # touch (0, 1)
    slab = cache.assign((0, 2), urgent=True)
    assert cache.where.get((0, 0)) is None and cache.owner[slab] == (0, 2)
    cache.end_layer(0)


def test_in_flight_and_in_use_are_never_victims():
    cache = SlabCache(2, [0, 1], "vismmoe")
    cache.begin_layer(0, [])
    a = cache.assign((0, 0), urgent=True)  # in flight
    b = cache.assign((0, 1), urgent=True)
    cache.complete(b)
    cache.use(b)                           # in use
    assert cache.victim() is None
    assert cache.assign((0, 2), urgent=True) is None
    cache.complete(a)
    cache.end_layer(0)


def test_prefetch_precision_counts_used_and_wasted_prefetches():
    cache = SlabCache(2, [0, 1], "lru")
    a, b = cache.assign_many([(1, 0), (1, 1)], [0.9, 0.8])  # two prefetches for layer 1
    cache.complete(a)
    cache.complete(b)
    cache.begin_layer(1, [0])  # one of them is used
    cache.end_layer(1)
    cache.begin_layer(0, [])
    cache.assign((0, 5), urgent=True)  # a fetch evicts the least recently used: the unused prefetch
    cache.end_layer(0)
    c = cache.counters
    assert (c.prefetches, c.prefetch_used, c.prefetch_wasted) == (2, 1, 1)
    assert cache.where.get((1, 1)) is None


def test_vismmoe_evicts_what_the_router_favours_least_when_usage_is_known():
    """With the router-probability average (table decode), an Expired expert the router still favours
    stays although it was used longest ago; without it, recency decides (the lru order); the lru
    policy ignores it."""
    def filled(policy):
        cache = SlabCache(3, [0, 1], policy)
        cache.begin_layer(0, [])
        for key in [(0, 0), (0, 1), (0, 2)]:  # (0, 0) least recent
            cache.complete(cache.assign(key, urgent=True))
        cache.end_layer(0)
        cache.begin_layer(1, [])
        cache.end_layer(1)
        return cache

    favoured = [0.9, 0.0, 0.1] + [0.0] * 5  # the router still favours expert 0, not expert 1
    cache = filled("vismmoe")
    assert cache.owner[cache.victim()] == (0, 0)
    cache.usage = {0: favoured, 1: [0.0] * 8}
    assert cache.owner[cache.victim()] == (0, 1)
    cache.usage = {0: [0.0] * 8, 1: [0.0] * 8}  # ties: recency
    assert cache.owner[cache.victim()] == (0, 0)
    cache = filled("lru")
    cache.usage = {0: favoured, 1: [0.0] * 8}
    assert cache.owner[cache.victim()] == (0, 0)
    cache.check_invariants()


@pytest.mark.parametrize("seed,num_slabs,levels", [(seed, 40, None) for seed in range(5)]
                         + [(seed, 400, levels) for seed in range(3) for levels in (None, 4)])
def test_vectorised_usage_ranking_equals_the_plain_python_one(seed, num_slabs, levels):
    """The numpy ranking (every Expired slab by (router average, recency), then Speculative by
    priority) against the rule written out in Python, on random caches with slabs in flight, in use,
    in layers that ran and that did not, and usage rows of lists and arrays with missing layers. At
    400 slabs the first victims come from a partition (VICTIMS_HEAD); `levels` rounds the averages to
    that many values, so ties at the partition's bound must keep their recency order."""
    import numpy as np

    rng = random.Random(seed)
    layers = list(range(6))
    experts = num_slabs // 4 + 2
    cache = SlabCache(num_slabs, layers, policy="vismmoe")
    keys = rng.sample([(layer, expert) for layer in layers for expert in range(experts)], num_slabs)
    slabs = cache.assign_many(keys, urgent=True)
    resident = num_slabs * 17 // 20
    for slab in slabs[:resident]:  # the rest stay in flight (Required)
        cache.complete(slab)
    for layer in layers[:4]:
        cache.begin_layer(layer, [])
        cache.end_layer(layer)
    cache.begin_layer(4, [e for (layer, e) in keys if layer == 4][:2])  # its experts in use
    for _ in range(num_slabs * 3 // 8):
        cache._touch(rng.choice(slabs[:resident]))

    def average() -> float:
        return round(rng.random() * (levels - 1)) / (levels - 1) if levels else rng.random()

    cache.usage = {layer: (np.array if layer % 2 else list)([average() for _ in range(experts - 2)])
                   for layer in layers[:3]}
    cache.set_priorities({key: rng.random() for key in keys[::3]})

    def value(slab):
        layer, expert = cache.owner[slab]
        row = cache.usage.get(layer)
        return float(row[expert]) if row is not None and expert < len(row) else 0.0

    recency = list(cache._recency)
    expired = [s for s in recency if cache.classify(s) == "expired"]
    speculative = [s for s in recency if cache.classify(s) == "speculative"]
    want = sorted(expired, key=lambda s: (value(s), recency.index(s))) + sorted(speculative, key=cache._priority_of)
    assert list(cache._victims()) == want
    # a prefetch's admission weighs one slab at a time (a scalar lookup): the same values as the ranking's arrays
    assert [cache.worth(s) for s in expired] == [value(s) for s in expired] == \
        cache._usage_values(*np.array([cache.owner[s] for s in expired]).T).tolist()
    assert [cache.worth(s) for s in speculative] == [cache._priority_of(s) for s in speculative]
    assert expired and speculative  # both kinds were there to rank
    if num_slabs > 40:
        assert len(expired) > VICTIMS_HEAD  # the partition's path ran
    # the decode boundary's way in: one array of every listed layer's averages, the same ranking
    cache.set_usage(layers[:3], np.array([list(cache.usage[layer]) for layer in layers[:3]]))
    assert list(cache._victims()) == want
