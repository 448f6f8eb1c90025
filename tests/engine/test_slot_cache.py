"""SlotKVCache (engine/slot_cache.py): several sequences' keys and values at once, one slot each. A
decoder layer's attention run for B sequences in one call, each row at its own length, gives what it
gives for each sequence alone in a cache of one slot."""

import pytest
import torch

from vismmoe_kt.demo.tiny import build_tiny_model
from vismmoe_kt.engine.slot_cache import CacheFullError, SlotKVCache
from vismmoe_kt.engine.text_forward import causal_mask
from vismmoe_kt.models import adapter_for


@pytest.fixture(scope="module")
def attention():
    model, _ = build_tiny_model("tiny-4x16", seed=0)
    adapter = adapter_for("qwen3_vl_moe")
    text = adapter.text_model(model)
    layer = adapter.layers_of(text)[1]  # layer_idx 1: the caches' other layers stay untouched
    attn = adapter.attention(layer)
    config = text.config

    def rotary(hidden, positions):  # text tokens: the same position on all three M-RoPE axes
        return adapter.rotary(text, hidden, positions[None].expand(3, *positions.shape))

    return attn, rotary, config


@pytest.mark.parametrize("rows", [3, 4])
def test_a_batched_decode_step_attends_each_row_as_alone(attention, rows):
    """rows 4: the step padded to a power of two, as captured steps run; the padding row writes the
    pad slot only."""
    attn, rotary, config = attention
    heads, dim = config.num_key_value_heads, config.head_dim
    torch.manual_seed(0)
    lengths = [3, 6, 4]
    prompts = [torch.randn(1, n, config.hidden_size) for n in lengths]
    steps = [torch.randn(1, 1, config.hidden_size) for _ in lengths]
    alone = []
    with torch.no_grad():
        for prompt, step, n in zip(prompts, steps, lengths):
            cache = SlotKVCache(2, 1, heads, dim, 16, torch.float32, "cpu")
            attn(hidden_states=prompt, position_embeddings=rotary(prompt, torch.arange(n)[None]),
                 attention_mask=causal_mask(n, 0, torch.float32, prompt.device), past_key_values=cache.slot_view(0))
            cache.begin_decode([0])
            out, _ = attn(hidden_states=step, position_embeddings=rotary(step, torch.tensor([[n]])),
                          attention_mask=cache.decode_masks(torch.float32)[1], past_key_values=cache)
            alone.append(out)
        slots = SlotKVCache(2, 4, heads, dim, 16, torch.float32, "cpu")
        order = [2, 0, 3]  # any slots, in any order
        for prompt, n, slot in zip(prompts, lengths, order):
            attn(hidden_states=prompt, position_embeddings=rotary(prompt, torch.arange(n)[None]),
                 attention_mask=causal_mask(n, 0, torch.float32, prompt.device), past_key_values=slots.slot_view(slot))
        assert [slots.host_lengths[1][s] for s in order] == lengths and slots.host_lengths[0] == [0] * 4
        before = [k.clone() for k in slots.keys]
        slots.begin_decode(order, rows)
        batch = torch.cat(steps + [torch.randn(1, 1, config.hidden_size)] * (rows - 3))
        positions = torch.tensor(lengths + [0] * (rows - 3))[:, None]
        together, _ = attn(hidden_states=batch, position_embeddings=rotary(batch, positions),
                           attention_mask=slots.decode_masks(torch.float32)[1], past_key_values=slots)
        slots.advance()
    torch.testing.assert_close(together[:3], torch.cat(alone), rtol=1e-5, atol=1e-6)
    assert [slots.host_lengths[1][s] for s in order] == [n + 1 for n in lengths]
    assert slots.lengths[1, :4].tolist() == [7, 0, 4, 5]  # slots 2, 0, 3 held 3, 6, 4
    assert slots.lengths[0, :4].tolist() == [1, 0, 1, 1]  # a step moves every layer of its rows on
    assert slots.lengths[1, slots.pad_slot] == (rows > 3)
    assert torch.equal(slots.keys[1][1], before[1][1])  # slot 1 holds no sequence: nothing wrote it
    with pytest.raises(ValueError, match="a step of 3 slots cannot run as 2 rows"):
        slots.begin_decode(order, 2)


def test_slots_are_released_checked_and_bounded():
    cache = SlotKVCache(layers=1, slots=2, kv_heads=1, head_dim=4, capacity=4, dtype=torch.float32, device="cpu")
    view = cache.slot_view(1)
    view.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), 0)
    assert view.get_seq_length(0) == 3 and cache.slot_view(0).get_seq_length(0) == 0
    with pytest.raises(CacheFullError, match="slot 1, layer 0 needs 5 positions, the cache holds 4"):
        view.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), 0)
    cache.begin_decode([1])
    masks = cache.decode_masks(torch.float32)
    assert masks.shape == (1, 1, 1, 1, 4) and (masks[0, 0, 0, 0] == 0).tolist() == [True, True, True, True]
    cache.update(torch.full((1, 1, 1, 4), 2.0), torch.full((1, 1, 1, 4), 2.0), 0)
    cache.advance()
    assert cache.keys[0][1, 0, 3].tolist() == [2.0] * 4 and not cache.keys[0][0].any()
    with pytest.raises(CacheFullError, match=r"slot\(s\) \[1\] hold 4 positions already"):
        cache.begin_decode([1])
    with pytest.raises(ValueError, match="must be distinct slots"):
        cache.begin_decode([0, 0])
    with pytest.raises(RuntimeError, match="outside a decode step"):
        cache.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 0)
    cache.release(1)
    assert cache.slot_view(1).get_seq_length(0) == 0 and cache.lengths[:, :2].tolist() == [[0, 0]]
    with pytest.raises(ValueError, match="slot 2 is not one of"):
        cache.slot_view(2)


def test_a_decode_step_attends_to_its_rows_span_not_the_whole_capacity():
    cache = SlotKVCache(layers=1, slots=2, kv_heads=1, head_dim=2, capacity=600, dtype=torch.float32, device="cpu")
    cache.slot_view(0).update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), 0)
    cache.slot_view(1).update(torch.ones(1, 1, 300, 2), torch.ones(1, 1, 300, 2), 0)
    cache.begin_decode([0])
    keys, _ = cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 0)
    assert keys.shape[2] == 256 and cache.decode_masks(torch.float32).shape[-1] == 256
    cache.advance()
    cache.begin_decode([0, 1])  # the longer row sets the span: 301 positions, in steps of 256
    keys, _ = cache.update(torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2), 0)
    assert keys.shape[2] == 512 and cache.decode_masks(torch.float32).shape[-1] == 512


def test_prompts_prefilled_together_land_in_their_slots_at_their_own_lengths():
    """rows_view: B right-padded prompts written at once; each slot keeps its own prompt's length (the
    padding past it is masked in decode and written over); misuse is refused."""
    cache = SlotKVCache(layers=2, slots=3, kv_heads=1, head_dim=2, capacity=6, dtype=torch.float32, device="cpu")
    cache.slot_view(0).update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)  # an old sequence's keys go
    view = cache.rows_view([2, 0], [4, 2])
    keys = torch.arange(16, dtype=torch.float32).reshape(2, 1, 4, 2)
    for layer in range(2):
        out_keys, _ = view.update(keys, -keys, layer)
        assert torch.equal(out_keys, keys)
    assert [lengths[:3] for lengths in cache.host_lengths] == [[2, 0, 4]] * 2
    assert cache.lengths[:, :3].tolist() == [[2, 0, 4]] * 2
    assert torch.equal(cache.keys[1][2, :, :4], keys[0]) and torch.equal(cache.values[0][0, :, :2], -keys[1, :, :2])
    cache.begin_decode([0, 2])  # decode sees each row up to its own length, the new token included
    visible = cache.decode_masks(torch.float32)[0, :, 0, 0] == 0
    assert visible[:, :6].tolist() == [[True] * 3 + [False] * 3, [True] * 5 + [False]]
    cache.abandon_step()
    with pytest.raises(RuntimeError, match="written twice"):
        view.update(keys, keys, 0)
    with pytest.raises(ValueError, match="must be distinct slots"):
        cache.rows_view([1, 1], [2, 2])
    with pytest.raises(CacheFullError, match="a slot holds 1 to 6"):
        cache.rows_view([1], [7])


def test_a_step_over_slots_0_to_b_returns_views_and_others_gathered_copies():
    cache = SlotKVCache(layers=1, slots=3, kv_heads=1, head_dim=2, capacity=4, dtype=torch.float32, device="cpu")
    for slot in range(3):
        cache.slot_view(slot).update(torch.full((1, 1, 2, 2), float(slot)), torch.full((1, 1, 2, 2), -float(slot)), 0)
    cache.begin_decode([0, 1, 2])
    assert cache.contiguous
    keys, values = cache.update(torch.ones(3, 1, 1, 2) * 9, torch.ones(3, 1, 1, 2) * 9, 0)
    assert keys.data_ptr() == cache.keys[0].data_ptr() and keys.shape == (3, 1, 4, 2)  # a view: no copy
    assert keys[:, 0, :3, 0].tolist() == [[0, 0, 9], [1, 1, 9], [2, 2, 9]] and values[2, 0, 1, 0] == -2
    cache.advance()
    for slots, rows in (([1, 0], None), ([0, 1], 4), ([1, 2], None)):  # out of order, padded, not from slot 0
        cache.begin_decode(slots, rows)
        assert not cache.contiguous
        keys, _ = cache.update(torch.zeros(rows or 2, 1, 1, 2), torch.zeros(rows or 2, 1, 1, 2), 0)
        assert keys.data_ptr() != cache.keys[0].data_ptr()
        assert keys[:len(slots), 0, 0, 0].tolist() == [float(s) for s in slots]
        cache.abandon_step()


def test_retract_takes_the_last_decode_step_back_in_every_layer():
    cache = SlotKVCache(3, 2, 1, 4, 16, torch.float32, "cpu")
    cache.keep(1, [0, 0, 0])
    for _ in range(2):
        cache.begin_decode([1])
        cache.advance()
    cache.retract([1])
    assert [lengths[1] for lengths in cache.host_lengths] == [1, 1, 1]
    assert cache.lengths[:, 1].tolist() == [1, 1, 1] and cache.lengths[:, 0].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="no decoded position"):
        cache.retract([0])
    assert [lengths[0] for lengths in cache.host_lengths] == [0, 0, 0]  # nothing half done


def test_a_prefill_writes_each_layers_length_without_a_copy_from_the_host():
    """A prompt's layer writes its keys and its length (on the device, for the decode steps) by kernels
    alone: assigning the Python int copied a host scalar to the device and waited, once a layer (on the
    H200 a 236-token prompt's 48 waits kept the host from running ahead of the device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func.__name__, [a.device.type if isinstance(a, torch.Tensor) else None for a in args],
                               [a.dim() if isinstance(a, torch.Tensor) else None for a in args]))
            return func(*args, **(kwargs or {}))

    cache = SlotKVCache(layers=2, slots=3, kv_heads=2, head_dim=4, capacity=16, dtype=torch.float32, device="cpu")
    view = cache.slot_view(1)
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    with Ops() as ops:
        view.update(keys, values, 1)
    assert cache.lengths[1, 1].item() == 5 and cache.host_lengths[1][1] == 5 and cache.lengths[0, 1].item() == 0
    assert torch.equal(cache.keys[1][1, :, :5], keys[0])
    scalar_copies = [c for c in ops.calls if c[0].startswith("copy_") and c[2][1] == 0]
    assert not scalar_copies and any(c[0].startswith("fill_") for c in ops.calls)
