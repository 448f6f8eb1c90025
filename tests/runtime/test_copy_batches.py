"""Copies issued together (runtime/transfers.py): one batch, consecutive experts of a quantized layer into
consecutive slabs as one copy, the rest block by block; every slab of a batch holds exactly its expert's
bytes and is resident once the batch is done. A long prompt's next layer (`stream_layer`) is one such batch."""
import threading

import pytest
import torch

from vismmoe_kt.runtime.slab_cache import SlabCache, SlabState
from vismmoe_kt.runtime.store import ExpertStore
from vismmoe_kt.runtime.transfers import Transfers, copy_runs

E, H, I = 8, 32, 32


def test_copy_runs_join_consecutive_experts_into_consecutive_slabs_only():
    keys = [(0, 0), (0, 1), (0, 2), (0, 4), (1, 5), (1, 6), (2, 7), (3, 0)]
    slabs = [3, 4, 5, 6, 7, 9, 10, 11]
    # (0, 4) skips expert 3; (1, 6) skips slab 8; (3, 0) changes layer though its slab follows
    assert copy_runs(slabs, keys) == [(0, 0, 3, 3), (0, 4, 6, 1), (1, 5, 7, 1), (1, 6, 9, 1), (2, 7, 10, 1),
                                      (3, 0, 11, 1)]
    assert copy_runs([], []) == []


def quantized_transfers(slabs, extra_bytes=0, layers=(0, 1)):
    torch.manual_seed(0)
    store = ExpertStore(E, H, I, torch.float32, pin_memory=False, fmt="q8_0")
    for layer in layers:
        store.fill_layer(layer, torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    pool = torch.full((slabs, store.block_bytes + extra_bytes), 7, dtype=torch.uint8)  # 7: not yet written
    cache = SlabCache(slabs, list(layers), "lru")
    return Transfers(store, (pool,), cache, threading.RLock()), store, pool, cache


def assert_holds(transfers, store, pool, cache, keys, extra_bytes):
    for key in keys:
        slab = cache.where[key]
        assert cache.state[slab] is SlabState.RESIDENT
        assert torch.equal(pool[slab, :store.block_bytes], store.layers[key[0]][key[1]]), key
        assert bool((pool[slab, store.block_bytes:] == 7).all()) or extra_bytes == 0  # the row's tail untouched


def test_a_batch_copies_runs_whole_and_lands_every_slab():
    transfers, store, pool, cache = quantized_transfers(slabs=12)
    keys = [(0, e) for e in range(E)] + [(1, 3), (1, 1), (1, 2)]
    slabs = cache.assign_many(keys, urgent=True)
    assert slabs == list(range(11))  # free slabs in order: the first layer is one run
    copies = list(transfers._copies(slabs, keys))
    assert len(copies) == len(copy_runs(slabs, keys)) == 3  # layer 0 whole, (1, 3) alone, (1, 1)-(1, 2)
    assert copies[0][0].shape == (E, store.block_bytes)
    transfers._copy_batch(slabs, keys, urgent=True)
    assert_holds(transfers, store, pool, cache, keys, 0)
    assert transfers.counters.copies == len(keys) and transfers.counters.bytes_copied == len(keys) * store.block_bytes
    assert transfers.landed == slabs


def test_slabs_wider_than_a_block_are_written_block_by_block():
    transfers, store, pool, cache = quantized_transfers(slabs=10, extra_bytes=64)
    keys = [(1, e) for e in range(E)]
    slabs = cache.assign_many(keys, urgent=True)
    assert len(list(transfers._copies(slabs, keys))) == E  # a run's target rows are not contiguous
    transfers._copy_batch(slabs, keys, urgent=True)
    assert_holds(transfers, store, pool, cache, keys, 64)


def test_streaming_a_layer_copies_what_has_no_slab_and_drops_the_queued_guesses():
    transfers, store, pool, cache = quantized_transfers(slabs=12)
    transfers.fetch([(1, 2)])  # already resident: not copied again
    transfers.queue = [(0.5, (0, 7))]  # a policy's guess, waiting for the link
    issued = transfers.stream_layer([(1, e) for e in range(E)], priority=2.0)
    assert issued == E - 1 and not transfers.queue
    assert cache.counters.prefetches == E - 1 and cache.priority[(1, 0)] == 2.0
    assert_holds(transfers, store, pool, cache, [(1, e) for e in range(E)], 0)
    # a second layer with too few slabs left: what the cache admits is copied, the rest is not
    issued = transfers.stream_layer([(0, e) for e in range(E)], priority=2.0)
    assert issued == 12 - E
    assert sum(1 for e in range(E) if (0, e) in cache.where) == 12 - E


def test_a_batch_that_fails_part_way_leaves_no_slab_waiting_for_a_copy(monkeypatch):
    """An error while a batch is issued (out of memory dequantizing, an interrupt): none of its slabs may be taken
    for landed or in flight later (a layer would compute from bytes never written); they hold nothing."""
    transfers, store, pool, cache = quantized_transfers(slabs=12)
    keys = [(0, e) for e in range(4)]
    slabs = cache.assign_many(keys, urgent=True)
    real = transfers._copies

    def failing(slabs, keys, device=None):
        iterator = real(slabs, keys, device)
        yield next(iterator)
        raise MemoryError("out of memory (a test)")

    monkeypatch.setattr(transfers, "_copies", failing)
    with pytest.raises(MemoryError):
        transfers._copy_batch(slabs, keys, urgent=True)
    assert not any(key in cache.where for key in keys) and cache.free_slabs == 12 and not transfers.landed
    cache.check_invariants()
    monkeypatch.setattr(transfers, "_copies", real)
    transfers.fetch(keys)  # and they are fetched again, whole
    assert_holds(transfers, store, pool, cache, keys, 0)


def test_a_fetch_the_cache_cannot_serve_gives_back_the_slabs_it_took():
    transfers, store, pool, cache = quantized_transfers(slabs=3)
    cache.begin_layer(0, [])
    transfers.fetch([(0, 0), (0, 1)])  # both used by the running layer
    with pytest.raises(RuntimeError, match="no slab to give up"):
        transfers.fetch([(0, 2), (0, 3)])  # the free slab for the first, none for the second
    assert (0, 2) not in cache.where and cache.free_slabs == 1
    cache.check_invariants()


def test_a_priority_list_dropped_while_the_worker_reads_it_back_stays_dropped():
    transfers, store, pool, cache = quantized_transfers(slabs=4)

    class Ready:
        def synchronize(self):
            pass

    def to_items(values, index):
        transfers.drop_queue()  # a stream (or decode leaving) while the worker waited without the lock
        return [((0, 1), 0.9)]

    transfers._pending_list = (Ready(), torch.zeros(1), torch.zeros(1, dtype=torch.long), 1, to_items)
    with transfers.lock:
        transfers._take_pending_list()
    assert transfers.queue == []


def test_no_attribute_transfers_sets_hides_one_of_its_methods():
    """On CUDA `Transfers` keeps copy streams as attributes; one named like a method hid it (`self.stream` made
    `Transfers.stream(...)` a call of a torch Stream, on the GPU only, where the CPU tests never go). Every
    attribute any method assigns, on any device's branch, is read from the source."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(Transfers))
    assigned = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    methods = {name for name, value in vars(Transfers).items() if callable(value) or isinstance(value, property)}
    assert "stream" in assigned and "urgent_stream" in assigned  # the CUDA branch is read too
    assert not assigned & methods, f"attributes hiding methods: {sorted(assigned & methods)}"
