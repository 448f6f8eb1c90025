"""Streamed prefill (runtime/executors/placement.py): a long prompt's next offloaded layer is queued for the
copy stream as soon as a layer is placed, before its routing is known, so its placement finds the experts
landed (here, on the CPU, copies land at once). A short prompt, or decode, leaves the prefetch policy in
charge. Outputs equal the experts computed from the host store either way."""
import pytest
import torch

from vismmoe_kt.runtime.eviction import CycleRanking, RecencyRanking
from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.runtime.offload_settings import OffloadSettings
from vismmoe_kt.runtime.slab_cache import SlabCache
from vismmoe_kt.runtime.store import ExpertStore

E, H, I, K = 8, 16, 8, 2
LAYERS = [0, 1, 2, 3]


def make_runtime(slabs, miss_policy="wait", pinned=0):
    """`slabs` slabs for the offloaded layers, the first `pinned` layers pinned (VisMMOE's policy then: lru pins
    none)."""
    torch.manual_seed(0)
    block = 3 * I * H * 4
    settings = OffloadSettings(expert_budget=(pinned * E + slabs) * block, policy="vismmoe" if pinned else "lru",
                               pinned_layers=pinned, prefetch_window=1, miss_policy=miss_policy)
    runtime = OffloadRuntime(settings, LAYERS, E, H, I, torch.float32, "cpu", top_k=K)
    weights = {}
    for layer in LAYERS:
        gate_up, down = torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4
        runtime.load_layer(layer, gate_up, down)
        weights[layer] = (gate_up, down)
    return runtime, weights


def reference(weights, hidden, ids, w):
    gate_up, down = weights
    gate, up = torch.einsum("tkoh,th->tko", gate_up[ids], hidden).chunk(2, dim=-1)
    return torch.einsum("tk,tkh->th", w, torch.einsum("tkhi,tki->tkh", down[ids], torch.nn.functional.silu(gate) * up))


def prompt(runtime, weights, tokens, seed, h=H, atol=1e-5):
    generator = torch.Generator().manual_seed(seed)
    act = torch.nn.SiLU()
    for layer in LAYERS:
        hidden = torch.randn(tokens, h, generator=generator)
        ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])
        w = torch.rand(tokens, K, generator=generator)
        out = runtime.run_layer(layer, hidden, ids, w, act)
        torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-4, atol=atol)


def prefill_counts(runtime):
    """(misses, hits) of the prompts' calls of each layer."""
    counters = runtime.residency.counters["prefill"]
    return [(counters[layer].misses, counters[layer].hits) for layer in LAYERS]


def test_a_long_prompt_finds_every_offloaded_layer_already_copied():
    runtime, weights = make_runtime(slabs=3 * E)  # three layers' worth of slabs for four offloaded layers
    assert runtime.num_slabs == 3 * E and runtime.plan.pinned_depth == 0
    assert runtime.plan.prefill == "streamed" and "prefill: streamed" in " ".join(runtime.plan.describe())
    prompt(runtime, weights, tokens=32, seed=1)  # 32 tokens x 2 of 8 experts: every expert, nearly surely
    counts = prefill_counts(runtime)
    # the first layer was streamed as it started, and each layer placed queued the next one's: nothing missed
    assert [misses for misses, _ in counts] == [0, 0, 0, 0], counts
    assert all(hits == E for _, hits in counts), counts
    streamed = runtime.residency.cache_counters["prefill"].prefetches
    assert streamed == 4 * E  # every offloaded expert once (the slabs were empty)
    # the last layer's stream evicted the layer that had just run (layer 1: it runs again last), so the slabs
    # hold layers 0, 2 and 3
    cache = runtime.residency.cache
    assert sorted({layer for layer, _ in cache.where}) == [0, 2, 3]
    # a second prompt: layers 0 and 2 stay, 1 and 3 cycle through the third layer's slabs (by recency every
    # layer would be copied again: the first prompt's oldest, layer 0, would go first); the streamed priorities
    # of the first prompt, spent, do not block the copies
    copies = runtime.transfers.counters.copies
    prompt(runtime, weights, tokens=32, seed=2)
    assert [misses for misses, _ in prefill_counts(runtime)] == [0, 0, 0, 0]
    assert runtime.residency.counters["prefill"][0].hits == 2 * E  # layer 0 stayed
    assert runtime.transfers.counters.copies - copies == 2 * E
    # the same prompts with the cache's own ranking (recency) for the streams: every layer copied at every prompt
    runtime, weights = make_runtime(slabs=3 * E)
    runtime.transfers.stream_victims = RecencyRanking()
    prompt(runtime, weights, tokens=32, seed=1)
    copies = runtime.transfers.counters.copies
    prompt(runtime, weights, tokens=32, seed=2)
    assert runtime.transfers.counters.copies - copies == 4 * E


def test_a_short_prompt_is_placed_layer_by_layer():
    runtime, weights = make_runtime(slabs=3 * E)
    prompt(runtime, weights, tokens=2, seed=3)  # 2 tokens x 2 of 8: about 44% of a layer's experts
    counts = prefill_counts(runtime)[1:]  # the first layer's hits are the slabs' first fill
    assert all(misses > 0 and hits == 0 for misses, hits in counts), counts
    assert runtime.residency.cache_counters["prefill"].prefetches == 0


def test_miss_policy_cpu_keeps_every_miss_for_the_cpu_and_auto_streams():
    runtime, _ = make_runtime(slabs=3 * E, miss_policy="cpu")
    assert runtime.plan.prefill == "placement" and "CPU" in runtime.plan.why["prefill"]
    runtime, weights = make_runtime(slabs=3 * E, miss_policy="auto")
    assert runtime.plan.hybrid and runtime.plan.prefill == "streamed"
    runtime.miss.on_cpu = lambda store, layer, missing, *args: set(missing)  # a cost model that takes every miss
    prompt(runtime, weights, tokens=32, seed=4)
    # the first layer too was streamed before its routing was read: no miss, so nothing for the CPU to hold the
    # host on while the link waits for the next layer's copies
    assert [misses for misses, _ in prefill_counts(runtime)] == [0, 0, 0, 0]
    assert sum(c.cpu for c in runtime.residency.counters["prefill"].values()) == 0


def test_a_streamed_layers_victims_are_the_slabs_whose_layer_runs_again_last():
    cache = SlabCache(8, LAYERS, "lru")
    for slab, key in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]):
        assert cache.assign(key, urgent=True) == slab
        cache.complete(slab)
    cache.begin_layer(1, [0])  # layer 1 runs, using its expert 0 (slab 2)
    order = list(cache.victims_by_cycle())
    # layer 1 itself runs again last (a whole cycle on): its unused slab first; then 0 and 3; never layer 2, the
    # next (what a stream from here brings in); slab 2 is in use
    assert [cache.owner[slab][0] for slab in order] == [1, 0, 0, 3, 3]
    assert 2 not in order
    # the admission rule still holds: a stream never evicts a slab worth as much as itself
    cache.priority[(1, 1)] = 2.0  # (say, streamed for a layer that has not run yet)
    assert cache.assign_many([(1, 2)], [2.0], ranking=CycleRanking()) == [None]
    cache.end_layer(1)  # with no layer running, from the last one run: 1 again last, then 0, 3 (2 runs next)
    assert [cache.owner[slab][0] for slab in cache.victims_by_cycle()] == [1, 1, 0, 0, 3, 3]


def quantized_runtime():
    """(runtime, the store's experts per layer, hidden size): Q8_0 store and slabs, three layers' worth of slabs
    for the four offloaded layers."""
    h = i = 256  # whole 256-weight tiles
    block = ExpertStore(E, h, i, torch.float32, False, "q8_0").block_bytes
    settings = OffloadSettings(expert_budget=3 * E * block, policy="lru", pinned_layers=0, prefetch_window=1,
                               store_dtype="q8_0", slab_format="quantized")
    runtime = OffloadRuntime(settings, LAYERS, E, h, i, torch.float32, "cpu", top_k=K)
    generator = torch.Generator().manual_seed(0)
    for layer in LAYERS:
        runtime.load_layer(layer, torch.randn(E, 2 * i, h, generator=generator) / 4,
                           torch.randn(E, h, i, generator=generator) / 4)
    store = runtime.store
    return runtime, {layer: store.dequantized(store.layers[layer], layer) for layer in LAYERS}, h


def test_quantized_slabs_compute_a_streamed_layer_without_reading_its_routing():
    """Q8_0 store and slabs: every offloaded layer of a long prompt is streamed whole (the first as it starts,
    each later one while the one before computes) and computes from its slabs through the row map, its routing
    unread, equal to the store's experts."""
    runtime, weights, h = quantized_runtime()
    assert runtime.plan.quantized_slabs and runtime.plan.prefill == "streamed" and runtime.num_slabs == 3 * E
    assert "unread" in runtime.plan.why["prefill"]
    res = runtime.residency
    for seed in (1, 2):
        reads = res.host_reads
        prompt(runtime, weights, tokens=32, seed=seed, h=h, atol=2e-4)  # sums of 256 products, in another order
        assert res.host_reads == reads  # the first offloaded layer too: streamed as it starts
    counters = res.counters["prefill"]
    assert all(counters[layer].hits + counters[layer].late == 2 * E for layer in LAYERS)  # all E, twice
    # a short prompt does not stream: each layer is placed after its read
    reads = res.host_reads
    prompt(runtime, weights, tokens=2, seed=3, h=h, atol=2e-4)
    assert res.host_reads - reads == len(LAYERS)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_layer_that_raises_leaves_the_cache_ready_for_the_next_prompt(quantized, monkeypatch):
    """The compute of a layer fails mid-prompt (say, out of memory): the error reaches the caller, the cache is in
    no layer, the prompt's streams are dropped with their priorities, and the next prompt runs and is right."""
    from vismmoe_kt.runtime.executors import placement

    if quantized:
        runtime, weights, h = quantized_runtime()
        target, name = placement, "experts_from_slabs"
    else:
        (runtime, weights), h = make_runtime(slabs=3 * E), H
        target, name = placement.PlacementExecutor, "_compute_on_gpu"
    real, calls = getattr(target, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second offloaded layer
            raise RuntimeError("CUDA out of memory (a test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        prompt(runtime, weights, tokens=32, seed=1, h=h, atol=2e-4)
    cache = runtime.residency.cache
    assert cache.executing is None and not cache.in_use
    assert not any(p >= 2.0 for p in cache.priority.values())  # no streamed priority left to block copies
    cache.check_invariants()
    prompt(runtime, weights, tokens=32, seed=2, h=h, atol=2e-4)  # the next prompt (the failure no longer fires)
    assert cache.executing is None


def test_streams_of_a_prompt_that_stopped_between_layers_do_not_block_the_next():
    """A prompt interrupted outside a layer call (say, at a routing read) leaves what it streamed for layers that
    never ran, at the streamed priority; the next prompt's first layer forgets them, so its streams are admitted."""
    runtime, weights = make_runtime(slabs=3 * E)
    prompt(runtime, weights, tokens=32, seed=1)
    executor, cache = runtime._placement, runtime.residency.cache
    stale = [(3, e) for e in range(E)]  # as if streamed for layer 3 by a prompt that then stopped
    executor._streamed[3] = stale
    cache.priority.update({key: 2.0 for key in stale if key in cache.where})
    # the next prompt's first layer: the stale streams are gone before it streams the layer after it
    generator = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(32)])
    runtime.run_layer(0, torch.randn(32, H, generator=generator), ids, torch.rand(32, K, generator=generator),
                      torch.nn.SiLU())
    assert 3 not in executor._streamed and not any(cache.priority.get(key, 0) >= 2.0 for key in stale)
    assert 1 in executor._streamed  # what the first layer streamed for the second


def test_a_stream_that_raises_before_its_layer_starts_leaves_no_layer_open(monkeypatch):
    runtime, weights, h = quantized_runtime()
    calls = []
    real = runtime.transfers.stream_layer

    def failing(keys, priority):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user stops the prompt while a stream is issued
        return real(keys, priority)

    monkeypatch.setattr(runtime.transfers, "stream_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        prompt(runtime, weights, tokens=32, seed=1, h=h, atol=2e-4)
    cache = runtime.residency.cache
    assert cache.executing is None and not runtime._placement._streamed
    cache.check_invariants()
    prompt(runtime, weights, tokens=32, seed=2, h=h, atol=2e-4)


@pytest.mark.parametrize("pinned", [0, 1])
def test_a_begun_prompt_streams_its_first_offloaded_layer_before_any_layer_runs(pinned):
    """The engine says a prompt begins before its vision tower runs: the first offloaded layer's experts are
    copied from then on, and the prompt's layers find every expert copied, the first offloaded one's streamed
    once (not again when its layer, or the pinned one before it, starts)."""
    runtime, weights = make_runtime(slabs=(3 - pinned) * E, pinned=pinned)  # a layer fewer than offloaded
    assert runtime.plan.pinned_depth == pinned and runtime.plan.prefill == "streamed"
    first = LAYERS[pinned]
    cache, copies = runtime.residency.cache, runtime.transfers.counters.copies
    runtime.begin_prompt(32)
    assert sorted(e for layer, e in cache.where if layer == first) == list(range(E))
    assert runtime.transfers.counters.copies - copies == E and set(runtime._placement._streamed) == {first}
    prompt(runtime, weights, tokens=32, seed=1)
    offloaded = LAYERS[pinned:]
    counters = runtime.residency.counters["prefill"]
    assert [counters[layer].misses for layer in offloaded] == [0] * len(offloaded)
    assert runtime.residency.cache_counters["prefill"].prefetches == len(offloaded) * E  # each expert once
    # a second prompt begun after a decode step: its first offloaded layer is streamed again where it is missing
    generator = torch.Generator().manual_seed(5)
    for layer in LAYERS:
        runtime.run_layer(layer, torch.randn(1, H, generator=generator), torch.randperm(E, generator=generator)[:K][None],
                          torch.rand(1, K, generator=generator), torch.nn.SiLU())
    assert runtime.residency.phase == "decode"
    runtime.begin_prompt(32)
    assert runtime.residency.phase == "prefill"
    assert all((first, e) in cache.where for e in range(E))
    prompt(runtime, weights, tokens=32, seed=2)
    assert sum(counters[layer].misses for layer in offloaded) == 0
    cache.check_invariants()


def test_a_begun_short_prompt_streams_nothing_and_a_begun_prompt_forgets_stale_streams():
    runtime, weights = make_runtime(slabs=3 * E)
    copies = runtime.transfers.counters.copies
    runtime.begin_prompt(2)  # 2 tokens x 2 of 8: about 44% of a layer's experts, placed after its read instead
    assert runtime.transfers.counters.copies == copies and not runtime._placement._streamed
    prompt(runtime, weights, tokens=2, seed=3)
    executor, cache = runtime._placement, runtime.residency.cache
    stale = [(3, e) for e in range(E)]  # as if streamed for layer 3 by a prompt that stopped
    executor._streamed[3] = stale
    cache.priority.update({key: 2.0 for key in stale if key in cache.where})
    runtime.begin_prompt(32)
    assert set(executor._streamed) == {0} and not any(cache.priority.get(key, 0) >= 2.0 for key in stale)
    before = prefill_counts(runtime)
    prompt(runtime, weights, tokens=32, seed=4)
    assert [after[0] - earlier[0] for after, earlier in zip(prefill_counts(runtime), before)] == [0, 0, 0, 0]


@pytest.mark.parametrize("together", [1, 2])
def test_the_runner_begins_a_picture_prompts_copies_before_its_vision_tower(tmp_path_factory, together):
    """Through the engine, a prompt alone and two prefilled together (one vision-tower call): when the vision tower
    first starts, the first offloaded layer's experts already have slabs (their copies issued), and the requests'
    tokens equal those of the same rules with everything resident."""
    from conftest import layer_bytes, make_image, tiny_case
    from vismmoe_kt import load
    from vismmoe_kt.core.context import context_of_model
    from vismmoe_kt.demo.tiny import SPECS
    from vismmoe_kt.engine.inputs import build_inputs, user_turn
    from vismmoe_kt.engine.runner import BatchRequest, ModelRunner
    from vismmoe_kt.engine.sampling import Sampling
    from vismmoe_kt.models import adapter_for

    model_dir, _, _ = tiny_case(tmp_path_factory, "tiny-4x16", 1, "Describe the image.", (160, 128), 2)
    cpu = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
    tokens = {}
    for layers in (4, 2):  # every layer pinned; two layers' worth (the others offloaded, streamed)
        model, processor = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", graphs="off",
                                expert_budget=int(layer_bytes(SPECS["tiny-4x16"]) * layers), **cpu)
        runtime = context_of_model(model).offload_runtime
        offloaded = runtime.offloaded_layers()
        seen = []
        if offloaded:
            assert runtime.plan.prefill == "streamed"
            cache = runtime.residency.cache
            tower = adapter_for(model.config.model_type).vision_tower(model)
            tower.register_forward_pre_hook(lambda *_: seen.append(
                {e for layer, e in cache.where if layer == offloaded[0]}))
        requests = [BatchRequest(build_inputs(processor, [user_turn(question, 1)], [make_image(*size, seed=seed)]), 6,
                                 Sampling(), min_new_tokens=6)
                    for question, size, seed in (("Describe the image.", (160, 128), 1), ("Two shapes?", (128, 128), 3))]
        runner = ModelRunner(model, max_batch=together, capacity=512, max_queue=2)
        for request in requests:
            runner.add(request)
        with torch.no_grad():
            while not runner.idle:
                runner.step()
        tokens[layers] = [request.sequence.generated for request in requests]
        assert (runner.prefill_groups == 1) == (together == 2)
        if offloaded:
            assert seen and seen[0] == set(range(SPECS["tiny-4x16"].experts)), seen
    assert tokens[2] == tokens[4]


@pytest.mark.parametrize("in_slab_order", [False, True])
def test_a_streamed_layer_takes_its_slabs_in_slab_order_so_its_copies_are_runs(in_slab_order):
    """Victims come in the ranking's order (here the least recent first: slabs 7 down to 0); a layer's stream pairs its
    experts with them in slab order, so consecutive experts going into consecutive slabs copy as one run."""
    from vismmoe_kt.runtime.transfers import copy_runs

    cache = SlabCache(8, LAYERS, "lru")
    for e in range(8):
        assert cache.assign((0, e), urgent=True) == e
        cache.complete(e)
    cache.begin_layer(0, list(range(7, -1, -1)))  # used 7 first: slab 7 is the least recent
    cache.end_layer(0)
    keys = [(1, e) for e in range(8)]
    slabs = cache.assign_in_slab_order(keys, 1.0) if in_slab_order else cache.assign_many(keys, [1.0] * 8)
    assert sorted(slabs) == list(range(8))
    assert [cache.where[key] for key in keys] == slabs
    assert len(copy_runs(slabs, keys)) == (1 if in_slab_order else 8)
    cache.check_invariants()
