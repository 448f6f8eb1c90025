"""The eviction study's cache simulations on hand-made access sequences."""

from benchmarks.eviction_study import _rankings, belady_decode_hit_rate, decode_hit_rate

# two slabs; decode accesses A B C A B C ... : LRU always misses, Belady keeps one of them
A, B, C = (1, 0), (1, 1), (1, 2)
CYCLE = [(key, True) for key in (A, B, C) * 4]


def test_lru_misses_a_cycle_longer_than_the_cache_and_belady_does_not():
    lru = _rankings(8)["lru"]
    assert decode_hit_rate(CYCLE, 2, lru) == 0.0
    belady = belady_decode_hit_rate(CYCLE, 2)
    assert 0.4 < belady < 0.6  # after the two cold misses, every other access hits


def test_prompt_accesses_are_not_counted_but_fill_the_cache():
    sequence = [(A, False), (B, False), (A, True), (B, True)]
    assert decode_hit_rate(sequence, 2, _rankings(8)["lru"]) == 1.0
    assert belady_decode_hit_rate(sequence, 2) == 1.0
    assert decode_hit_rate([(A, False), (B, False), (C, False), (A, True)], 2, _rankings(8)["lru"]) == 0.0


def test_router_probability_ranking_keeps_what_the_router_favours():
    """Two slabs, A and B cached, C needed: recency evicts A (used first), the router-probability
    ranking evicts B (the router gave it the least probability), and the router events themselves
    are not accesses."""
    import numpy as np

    from benchmarks.eviction_study import router_ranking

    favour_a = np.zeros(128)
    favour_a[0] = 1.0
    sequence = [("router", 1, favour_a, favour_a), (A, True), (B, True), (C, True), (A, True)]
    assert decode_hit_rate(sequence, 2, _rankings(8)["lru"]) == 0.0
    assert decode_hit_rate(sequence, 2, *router_ranking(oracle=False)) == 0.25
    assert belady_decode_hit_rate(sequence, 2) == 0.25
