"""Expert-cache replay: Belady / MIN against an exhaustive optimum, LRU, the cold-miss convention."""

import itertools
from functools import lru_cache

import numpy as np
import pytest

from vismmoe_kt.routing import belady_hit_rate, lru_hit_rate, simulate_cache, synthetic_trace
from vismmoe_kt.routing.belady import next_use


def brute_force_hits(seq, capacity):
    """The most hits any policy gets: exhaustive search over every eviction choice (any subset of the
    resident experts this token does not need, not only the minimum), from an empty cache."""
    seq = [tuple(row) for row in seq]

    @lru_cache(maxsize=None)
    def best(t, cache):
        if t == len(seq):
            return 0
        need = frozenset(seq[t])
        hits = len(need & cache)
        spare = sorted(cache - need)
        options = []
        for r in range(len(spare) + 1):
            for evicted in itertools.combinations(spare, r):
                after = (cache - frozenset(evicted)) | need
                if len(after) <= capacity:
                    options.append(best(t + 1, after))
        return hits + max(options)

    return best(0, frozenset())


def random_sets(rng, tokens, experts, k):
    return np.stack([rng.choice(experts, size=k, replace=False) for _ in range(tokens)])


@pytest.mark.parametrize("k,capacity", [(1, 2), (1, 3), (2, 2), (2, 3)])
def test_belady_equals_the_exhaustive_optimum_on_tiny_traces(k, capacity):
    rng = np.random.default_rng(k * 10 + capacity)
    for _ in range(12):
        seq = random_sets(rng, 10, 5, k)
        result = simulate_cache(seq, capacity, "belady")
        assert int(result.hits[0]) == brute_force_hits(seq.tolist(), capacity)
        # LRU is a policy too: never better than the optimum
        assert int(simulate_cache(seq, capacity, "lru").hits[0]) <= int(result.hits[0])


def test_belady_by_hand_classic_sequence():
    # k=1, capacity 2, accesses 0 1 2 0 1 3 0 1. MIN: 0, 1 miss; 2 misses and evicts 1 (0 returns sooner);
    # 0 hits; 1 misses and evicts 2 (never used again); 3 misses and evicts 1 (0 returns sooner); 0 hits;
    # 1 misses. Two hits; LRU gets none (it always evicts what comes back next).
    seq = np.array([0, 1, 2, 0, 1, 3, 0, 1])[:, None]
    assert brute_force_hits(seq.tolist(), 2) == 2
    assert int(simulate_cache(seq, 2).hits[0]) == 2
    assert int(simulate_cache(seq, 2, "lru").hits[0]) == 0
    assert int(simulate_cache(seq, 2).cold[0]) == 4  # experts 0, 1, 2, 3 each miss once at first sight
    assert simulate_cache(seq, 2).hit_rate() == pytest.approx(2 / 4)  # 8 accesses, 4 of them cold


def test_belady_beats_or_ties_lru_on_random_and_synthetic_traces():
    rng = np.random.default_rng(0)
    uniform = np.stack([random_sets(rng, 300, 32, 4) for _ in range(3)], axis=1)  # [T, L, k]
    synthetic = synthetic_trace(300, layers=4, experts=64, top_k=4, seed=1)
    for ids, experts in ((uniform, 32), (synthetic, 64)):
        for capacity in (4, 8, 16, 24):
            b, lru = belady_hit_rate(ids, capacity), lru_hit_rate(ids, capacity)
            assert b >= lru - 1e-12
            assert 0.0 <= lru <= 1.0 and 0.0 <= b <= 1.0
    # on the realistic trace the optimum is clearly better than LRU at a small cache
    assert belady_hit_rate(synthetic, 8) > lru_hit_rate(synthetic, 8) + 0.02


def test_cold_miss_convention_and_full_capacity():
    ids = synthetic_trace(200, layers=3, experts=32, top_k=4, seed=5)
    distinct = sum(len(np.unique(ids[:, layer].numpy())) for layer in range(3))
    accesses = 200 * 3 * 4
    for policy in ("belady", "lru"):
        result = simulate_cache(ids, 32, policy)  # every expert fits: only first sightings miss
        assert result.hit_rate() == 1.0
        assert int(result.cold.sum()) == distinct == int(result.misses.sum())
        assert result.hit_rate(include_cold=True) == pytest.approx((accesses - distinct) / accesses)
    assert belady_hit_rate(ids, 32) == 1.0 and lru_hit_rate(ids, 40) == 1.0
    # a cache smaller than the working set misses more than the cold misses
    assert belady_hit_rate(ids, 8) < 1.0


def test_capacity_per_layer_and_errors():
    ids = synthetic_trace(100, layers=2, experts=32, top_k=4, seed=2)
    per_layer = simulate_cache(ids, [4, 32])
    assert per_layer.layer_hit_rates()[1] == 1.0 and per_layer.layer_hit_rates()[0] < 1.0
    assert list(per_layer.capacity) == [4, 32]
    with pytest.raises(ValueError, match="below top_k"):
        belady_hit_rate(ids, 3)
    with pytest.raises(ValueError, match="one value per layer"):
        simulate_cache(ids, [4, 4, 4])
    with pytest.raises(ValueError, match="policy"):
        simulate_cache(ids, 8, "fifo")
    with pytest.raises(ValueError, match="same expert twice"):
        simulate_cache(np.array([[[1, 1]]]), 2)
    # a layer given as [T, k]
    assert simulate_cache(ids[:, 0], 8).hits.shape == (1,)


def test_next_use_indices():
    seq = np.array([[0, 1], [2, 0], [1, 3], [0, 2]])
    # expert 0 at t=0 is next used at t=1, then t=3, then never (T = 4)
    assert next_use(seq).tolist() == [[1, 2], [3, 3], [4, 4], [4, 4]]


def test_a_warm_up_prefix_is_replayed_but_not_counted():
    # one layer, k=1, capacity 2: tokens 0-2 warm the cache with experts 0 and 1
    ids = np.array([0, 1, 0, 1, 0, 2]).reshape(6, 1, 1)
    warm = simulate_cache(ids, 2, "lru", start=3)
    assert warm.accesses.tolist() == [3] and warm.hits.tolist() == [2] and warm.cold.tolist() == [1]
    assert simulate_cache(ids, 2, "belady", start=3).hit_rate(include_cold=True) == 2 / 3
    cold = simulate_cache(ids, 2, "lru")
    assert cold.accesses.tolist() == [6] and cold.hits.tolist() == [3] and cold.cold.tolist() == [3]
