"""Pinned layers on quantized slabs hold the store's blocks: priced as E slabs, computed as the slabs are."""

import pytest
import torch

from vismmoe_kt.runtime.executors.batch_step import BatchStepExecutor
from vismmoe_kt.runtime.executors.placement import PlacementExecutor
from vismmoe_kt.runtime.executors.table_step import TableStepExecutor
from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.runtime.offload_plan import PlanFacts, resolve_plan
from vismmoe_kt.runtime.offload_settings import OffloadSettings
from vismmoe_kt.runtime.store import ExpertStore

GIB = 2**30
QWEN = PlanFacts(48, 128, 2048, 768, 8, torch.bfloat16, checkpoint_format="q4_k")


def test_a_pinned_layer_on_quantized_slabs_costs_its_experts_slabs_not_a_bank_in_the_models_dtype():
    """At Qwen3-VL-30B-A3B's shapes and 6 GiB of Q4_K: one pinned layer costs 128 slabs (its blocks), where a
    BF16 bank took the room of 455; dequantized slabs keep the bank in the model's dtype."""
    quantized = resolve_plan(OffloadSettings(expert_budget=6 * GIB, store_dtype="q4_k", slab_format="quantized",
                                             pinned_layers=1), QWEN, "cpu")
    bf16_layer = 128 * 3 * 2048 * 768 * 2
    assert quantized.pinned_blocks and quantized.layer_bytes == 128 * quantized.slab_bytes < bf16_layer / 3
    assert quantized.num_slabs == (6 * GIB - quantized.layer_bytes) // quantized.slab_bytes
    assert quantized.num_slabs - (6 * GIB - bf16_layer) // quantized.slab_bytes == 455 - 128  # 2299 against 1972
    assert "pinned: 1 layer(s) as quantized blocks" in "\n".join(quantized.describe())
    dequantized = resolve_plan(OffloadSettings(expert_budget=16 * GIB, store_dtype="q4_k", slab_format="dequantized",
                                               pinned_layers=1), QWEN, "cpu")
    assert not dequantized.pinned_blocks and dequantized.layer_bytes == bf16_layer


def test_the_auto_depth_on_quantized_slabs_is_priced_and_a_budget_of_every_layers_blocks_pins_them_all():
    """The shipped hit rates price depths in experts held, so they price quantized slabs too (the depth was
    taken unpriced while a pinned layer was a BF16 bank); 16 GiB holds all 48 layers' Q4_K blocks."""
    tight = resolve_plan(OffloadSettings(expert_budget=6 * GIB, store_dtype="q4_k", slab_format="quantized"),
                         QWEN, "cpu")
    assert "predicted" in tight.why["pinned"] and tight.depth.rows  # candidates were priced
    assert all(row.slabs == min((6 * GIB - row.depth * tight.layer_bytes) // tight.slab_bytes,
                                (48 - row.depth) * 128) for row in tight.depth.rows)
    roomy = resolve_plan(OffloadSettings(expert_budget=16 * GIB, store_dtype="q4_k", slab_format="quantized"),
                         QWEN, "cpu")
    assert roomy.pinned_depth == 48 and roomy.num_slabs == 0 and 48 * roomy.layer_bytes <= 16 * GIB


def _reference(store: ExpertStore, layer: int, hidden, top_k_index, top_k_weights):
    """The layer's experts as the store's blocks decode to, token by token."""
    blocks = store.layers[layer]
    gate_up, down = store.dequantized(blocks, layer)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for e, w in zip(top_k_index[t].tolist(), top_k_weights[t].tolist()):
            gate, up = (gate_up[e].float() @ hidden[t].float()).chunk(2)
            out[t] += w * (down[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("raw", [False, True])
def test_a_pinned_layer_held_as_blocks_computes_what_its_blocks_decode_to(raw):
    """A pinned layer's Q4_K blocks go to a bank of their own (none stay in the host store) and every path
    that computes a pinned layer (a prompt, a decode token, a batched step) gives the experts its blocks
    decode to; loaded as a file stores them (`raw`) or quantized at load."""
    from vismmoe_kt.runtime import q4k

    experts, hidden_size, inter, layers = 8, 256, 256, [0, 1, 2]
    settings = OffloadSettings(expert_budget=10**8, store_dtype="q4_k", slab_format="quantized", pinned_layers=1)
    runtime = OffloadRuntime(settings, layers, experts, hidden_size, inter, torch.float32, "cpu", top_k=2)
    assert runtime.plan.pinned_blocks and runtime.pinned == {0}
    reference = ExpertStore(experts, hidden_size, inter, torch.float32, pin_memory=False, fmt="q4_k")
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        gate_up = torch.randn(experts, 2 * inter, hidden_size, generator=gen) * 0.05
        down = torch.randn(experts, hidden_size, inter, generator=gen) * 0.05
        reference.fill_layer(layer, gate_up, down)
        if raw:
            gate, up = (q4k.quantize(part) for part in gate_up.chunk(2, dim=1))
            assert runtime.raw_down_format(layer, 12, 12, 12) == "q4_k"  # Q4_K's GGML type, pinned or not
            runtime.load_layer_raw(layer, gate, up, q4k.quantize(down))
        else:
            runtime.load_layer(layer, gate_up, down)
    bank = runtime.banks[0]
    assert len(bank) == 1 and bank[0].dtype == torch.uint8 and bank[0].shape == (experts, runtime.store.block_bytes)
    assert 0 not in runtime.store.layers and set(runtime.store.layers) == {1, 2}
    assert torch.equal(bank[0], reference.layers[0])
    act = torch.nn.functional.silu
    res = runtime.residency
    placement = PlacementExecutor(res, runtime, runtime.boundary, runtime.miss)
    executors = {"placement": placement.run_layer,  # a prompt, and decode outside the table
                 "table": TableStepExecutor(res, "quantized-slabs", False, placement).token,
                 "batched": BatchStepExecutor(res, runtime.plan, placement).run_layer}
    for name, tokens in (("placement", 5), ("placement", 1), ("table", 1), ("batched", 1), ("batched", 3),
                         ("batched", 80)):  # 3 tokens' 6 pairs pair by pair, 80 tokens' 160 expert-major
        hidden = torch.randn(tokens, hidden_size, generator=gen)
        top_k_index = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
        top_k_weights = torch.rand(tokens, 2, generator=gen)
        out = executors[name](0, hidden, top_k_index, top_k_weights, act)
        torch.testing.assert_close(out.float(), _reference(reference, 0, hidden, top_k_index, top_k_weights),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}, {tokens} token(s): {m}")


@pytest.mark.parametrize("mode, tuned, tokens, major", [
    ("auto", 32, 16, False), ("auto", 32, 17, True), ("auto", 128, 40, False), ("table", 8, 40, False),
    ("expert-major", 128, 2, True), ("expert-major", 128, 1, False), ("grouped-gemm", 128, 2, True)])
def test_a_batched_step_on_pinned_blocks_goes_pair_by_pair_up_to_the_devices_crossover(mode, tuned, tokens, major,
                                                                                       monkeypatch):
    """Under auto, pair by pair (one launch of the GEMVs) up to the device's tuned quantized_batch_gemv_pairs
    pairs, resolved into the plan at load; always under table; one token always; else each routed expert
    decoded once per block of its tokens."""
    from vismmoe_kt.runtime.executors import batch_step
    from vismmoe_kt.runtime.kernels import tuning

    experts, size, layers = 8, 256, [0, 1]
    settings = OffloadSettings(expert_budget=10**8, store_dtype="q4_k", slab_format="quantized", pinned_layers=1,
                               batch_experts=mode)
    with tuning.overridden(quantized_batch_gemv_pairs=tuned):
        runtime = OffloadRuntime(settings, layers, experts, size, size, torch.float32, "cpu", top_k=2)
    assert ("pair by pair up to 32 pairs" in runtime.plan.why["batch"]) == (mode == "auto" and tuned == 32)
    gen = torch.Generator().manual_seed(1)
    for layer in layers:
        runtime.load_layer(layer, torch.randn(experts, 2 * size, size, generator=gen) * 0.05,
                           torch.randn(experts, size, size, generator=gen) * 0.05)
    ways = []
    for name in ("block_bank_outputs", "block_experts"):
        real = getattr(batch_step, name)
        monkeypatch.setattr(batch_step, name, lambda *a, _real=real, _name=name, **k: ways.append(_name) or _real(*a, **k))
    placement = PlacementExecutor(runtime.residency, runtime, runtime.boundary, runtime.miss)
    executor = BatchStepExecutor(runtime.residency, runtime.plan, placement)
    top_k_index = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    out = executor.run_layer(0, torch.randn(tokens, size, generator=gen), top_k_index, torch.rand(tokens, 2),
                             torch.nn.functional.silu)
    assert out.shape == (tokens, size) and torch.isfinite(out).all()
    assert ways == ["block_experts" if major else "block_bank_outputs"]
