"""A prompt on the placement path streams the next offloaded layer's experts in while a layer computes
(runtime/executors/placement.py): on the CPU copies land at once, so the next layer finds every expert
resident; a prompt too short to route to most of a layer's experts gets the policy's guess instead."""

import torch

from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.runtime.offload_settings import OffloadSettings

E, H, I, K = 8, 16, 8, 2
LAYERS = [0, 1, 2, 3]


def make_runtime(slabs: int) -> tuple[OffloadRuntime, dict]:
    torch.manual_seed(0)
    settings = OffloadSettings(expert_budget=slabs * 3 * I * H * 4, policy="lru", pinned_layers=0)
    runtime = OffloadRuntime(settings, LAYERS, E, H, I, torch.float32, "cpu", top_k=K)
    weights = {}
    for layer in LAYERS:
        gate_up, down = torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4
        runtime.load_layer(layer, gate_up, down)
        weights[layer] = (gate_up, down)
    return runtime, weights


def reference(weights, hidden, ids, w):
    gate_up, down = weights
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (gate_up[ids[t, k]] @ hidden[t]).chunk(2)
            out[t] += w[t, k] * (down[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    return out


def prompt(runtime, weights, tokens, seed):
    """One prompt of `tokens` through every layer; each layer's experts resident before it ran."""
    generator = torch.Generator().manual_seed(seed)
    resident_before = {}
    for layer in LAYERS:
        resident_before[layer] = sum((layer, e) in runtime.cache.where for e in range(E))
        hidden = torch.randn(tokens, H, generator=generator)
        ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])
        w = torch.rand(tokens, K, generator=generator)
        out = runtime.run_layer(layer, hidden, ids, w, torch.nn.SiLU())
        torch.testing.assert_close(out, reference(weights[layer], hidden, ids, w), rtol=1e-5, atol=1e-5)
    return resident_before


def test_a_long_prompt_finds_each_next_layer_streamed_in():
    runtime, weights = make_runtime(slabs=2 * E)  # two layers' worth: each layer's experts must cross the link
    assert runtime._serve.__self__._stream_tokens == 9  # 8 (1 - 2/8)^9 < 0.8: under a tenth unused
    before = prompt(runtime, weights, tokens=12, seed=1)
    assert before[0] == 0 and all(before[layer] == E for layer in LAYERS[1:])
    prefill = runtime.counters["prefill"]
    assert prefill[0].misses > 0 and sum(prefill[layer].misses for layer in LAYERS[1:]) == 0
    assert runtime.summary()["prefill_prefetches"] == 3 * E  # every expert of layers 1-3, once
    runtime.close()


def test_a_short_prompt_fetches_what_it_routes_to():
    runtime, weights = make_runtime(slabs=2 * E)
    before = prompt(runtime, weights, tokens=3, seed=2)
    assert all(count == 0 for count in before.values())  # nothing streamed: 3 tokens route to a few experts
    assert runtime.summary()["prefill_prefetches"] == 0
    assert all(runtime.counters["prefill"][layer].misses > 0 for layer in LAYERS)
    runtime.close()
