"""Streamed prefill (runtime/executors/placement.py): a long prompt's next offloaded layer is queued for the
copy stream as soon as a layer is placed, before its routing is known, so its placement finds the experts
landed (here, on the CPU, copies land at once). A short prompt, or decode, leaves the prefetch policy in
charge. Outputs equal the experts computed from the host store either way."""
import torch

from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.runtime.offload_settings import OffloadSettings

E, H, I, K = 8, 16, 8, 2
LAYERS = [0, 1, 2, 3]


def make_runtime(slabs, miss_policy="wait"):
    torch.manual_seed(0)
    block = 3 * I * H * 4
    settings = OffloadSettings(expert_budget=slabs * block, policy="lru", pinned_layers=0, prefetch_window=1,
                               miss_policy=miss_policy)
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


def prompt(runtime, weights, tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    act = torch.nn.SiLU()
    for layer in LAYERS:
        hidden = torch.randn(tokens, H, generator=generator)
        ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])
        w = torch.rand(tokens, K, generator=generator)
        out = runtime.run_layer(layer, hidden, ids, w, act)
        torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-4, atol=1e-5)


def prefill_counts(runtime):
    """(misses, hits) of the prompts' calls of each layer after the first."""
    counters = runtime.residency.counters["prefill"]
    return [(counters[layer].misses, counters[layer].hits) for layer in LAYERS[1:]]


def test_a_long_prompt_finds_every_offloaded_layer_but_the_first_already_copied():
    runtime, weights = make_runtime(slabs=3 * E)  # three layers' worth of slabs for four offloaded layers
    assert runtime.num_slabs == 3 * E and runtime.plan.pinned_depth == 0
    assert runtime.plan.prefill == "streamed" and "prefill: streamed" in " ".join(runtime.plan.describe())
    prompt(runtime, weights, tokens=32, seed=1)  # 32 tokens x 2 of 8 experts: every expert, nearly surely
    counts = prefill_counts(runtime)
    # the first layer missed its experts and queued the next layer's, and so on: after it, nothing missed
    assert [misses for misses, _ in counts] == [0, 0, 0], counts
    assert all(hits == E for _, hits in counts), counts
    streamed = runtime.residency.cache_counters["prefill"].prefetches
    assert streamed == 3 * E  # every offloaded expert once (the slabs were empty)
    # a second prompt: the slabs hold the last three layers, the first layer's copies evict the second's, which
    # come back ahead of it (the streamed priorities of the first prompt, spent, do not block them)
    prompt(runtime, weights, tokens=32, seed=2)
    assert [misses for misses, _ in prefill_counts(runtime)] == [0, 0, 0]


def test_a_short_prompt_is_placed_layer_by_layer():
    runtime, weights = make_runtime(slabs=3 * E)
    prompt(runtime, weights, tokens=2, seed=3)  # 2 tokens x 2 of 8: about 44% of a layer's experts
    counts = prefill_counts(runtime)
    assert all(misses > 0 and hits == 0 for misses, hits in counts), counts
    assert runtime.residency.cache_counters["prefill"].prefetches == 0


def test_miss_policy_cpu_keeps_every_miss_for_the_cpu_and_auto_streams():
    runtime, _ = make_runtime(slabs=3 * E, miss_policy="cpu")
    assert runtime.plan.prefill == "placement" and "CPU" in runtime.plan.why["prefill"]
    runtime, weights = make_runtime(slabs=3 * E, miss_policy="auto")
    assert runtime.plan.hybrid and runtime.plan.prefill == "streamed"
    prompt(runtime, weights, tokens=32, seed=4)
    assert [misses for misses, _ in prefill_counts(runtime)] == [0, 0, 0]
