"""A prompt's fused attention (engine/prompt_attention.py): its torch twin against transformers' Qwen3-VL-MoE
attention module writing the same slot cache, a fresh prompt and a continued one; the calls it leaves to
the module; the heads kernel's prompt form against the twin in Triton's interpreter (test_fused_attention.py
compiles it for Hopper); a model whose prompts run on it decodes the same tokens."""

import pytest
import torch

from vismmoe_kt.engine.prompt_attention import PromptAttention, eligible, install
from vismmoe_kt.engine.slot_cache import SlotKVCache
from vismmoe_kt.engine.text_forward import causal_mask
from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter

from conftest import run_in_triton_interpreter
from test_fused_attention import CAPACITY, SLOTS, attention_layer


def rotary_of(config):
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding
    return Qwen3VLMoeTextRotaryEmbedding(config)


def prompt_inputs(rotary, start, length, seed):
    torch.manual_seed(seed)
    hidden = torch.randn(1, length, 64)
    positions = torch.arange(start, start + length).view(1, 1, -1).expand(3, 1, -1)
    return hidden, rotary(hidden, positions)


def test_the_prompt_attention_equals_the_module_and_writes_the_same_cache():
    attn, config = attention_layer(seed=1)
    parts = Qwen3VLMoeAdapter().decode_attention_parts(attn)
    fused = PromptAttention(attn, parts, kernel=False)
    rotary = rotary_of(config)
    caches = [SlotKVCache(2, SLOTS, 2, 16, CAPACITY, torch.float32, "cpu") for _ in range(2)]
    # a prompt into an empty slot (causal, no mask), then its continuation (the mask over what is cached)
    for start, length, seed in ((0, 7, 0), (7, 5, 1)):
        hidden, embeddings = prompt_inputs(rotary, start, length, seed)
        mask = causal_mask(length, start, hidden.dtype, hidden.device, implicit_causal=True)
        assert (mask is None) == (start == 0)
        with torch.no_grad():  # inference, as the runtime prefills
            want = attn(hidden_states=hidden, position_embeddings=embeddings, attention_mask=mask,
                        past_key_values=caches[0].slot_view(2))[0]
            got, weights = fused(hidden, embeddings, mask, caches[1].slot_view(2))
        assert weights is None and got.shape == want.shape == (1, length, 64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fused.served == 2
    for a, b in zip((*caches[0].keys, *caches[0].values), (*caches[1].keys, *caches[1].values)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert caches[1].keys[1][2, :, 11].abs().sum() > 0 and caches[1].keys[1][2, :, 12:].abs().sum() == 0
    assert caches[1].host_lengths == caches[0].host_lengths and caches[1].host_lengths[1][2] == 12
    assert torch.equal(caches[1].lengths, caches[0].lengths)


def test_calls_the_prompt_attention_does_not_serve_go_to_the_module():
    attn, config = attention_layer(seed=2)
    parts = Qwen3VLMoeAdapter().decode_attention_parts(attn)
    fused = PromptAttention(attn, parts, kernel=False)
    rotary = rotary_of(config)
    hidden, embeddings = prompt_inputs(rotary, 0, 4, 3)
    batch = torch.cat([hidden, hidden])
    batch_embeddings = tuple(torch.cat([t, t]) for t in embeddings)
    caches = [SlotKVCache(2, SLOTS, 2, 16, CAPACITY, torch.float32, "cpu") for _ in range(2)]
    # two prompts prefilled together (a rows view), a prompt asking for its attention weights, one with
    # gradients (the kernel has no backward) and one in training mode (the module's dropout)
    with torch.no_grad():
        want = attn(batch, batch_embeddings, None, caches[0].rows_view([0, 1], [4, 4]))[0]
        got = fused(batch, batch_embeddings, None, caches[1].rows_view([0, 1], [4, 4]))[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        fused(hidden, embeddings, None, caches[1].slot_view(2), output_attentions=True)
    out = fused(hidden, embeddings, None, caches[1].slot_view(1))[0]
    assert out.requires_grad and out.grad_fn is not None
    attn.train()
    with torch.no_grad():
        fused(hidden, embeddings, None, caches[1].slot_view(0))
    assert fused.served == 0
    attn.eval()
    with torch.no_grad():
        fused(hidden, embeddings, None, caches[1].slot_view(0))
    assert fused.served == 1


def test_a_failed_prompt_attention_gives_its_positions_back():
    attn, config = attention_layer(seed=5)
    fused = PromptAttention(attn, Qwen3VLMoeAdapter().decode_attention_parts(attn), kernel=False)
    cache = SlotKVCache(2, SLOTS, 2, 16, CAPACITY, torch.float32, "cpu")
    hidden, embeddings = prompt_inputs(rotary_of(config), 0, 6, 6)
    with torch.no_grad(), pytest.raises(RuntimeError):
        fused(hidden, embeddings, torch.zeros(1, 1, 6, 5), cache.slot_view(1))  # a mask of the wrong width
    assert cache.host_lengths[1][1] == 0 and int(cache.lengths[1, 1]) == 0
    with torch.no_grad():
        fused(hidden, embeddings, None, cache.slot_view(1))
    assert cache.host_lengths[1][1] == 6 and int(cache.lengths[1, 1]) == 6


def test_a_cache_made_for_another_attention_goes_to_the_module():
    attn, config = attention_layer(seed=7)
    fused = PromptAttention(attn, Qwen3VLMoeAdapter().decode_attention_parts(attn), kernel=False)
    hidden, embeddings = prompt_inputs(rotary_of(config), 0, 3, 8)
    for cache in (SlotKVCache(2, SLOTS, 2, 16, CAPACITY, torch.float64, "cpu"),     # another dtype
                  SlotKVCache(2, SLOTS, 2, 16, CAPACITY, torch.float32, "cpu", value_dim=8)):  # other value widths
        with torch.no_grad(), pytest.raises(RuntimeError):
            fused(hidden, embeddings, None, cache.slot_view(0))  # the module's own forward refuses it
    assert fused.served == 0


def test_install_leaves_attentions_on_the_cpu_and_other_implementations_alone():
    attn, _ = attention_layer(seed=4)

    class Adapter(Qwen3VLMoeAdapter):
        def layers_of(self, text):
            return [text]

        def attention(self, layer):
            return layer

    parts = Qwen3VLMoeAdapter().decode_attention_parts(attn)
    assert eligible(attn, parts)
    assert install(Adapter(), attn) == 0 and "forward" not in vars(attn)  # CPU weights: the module's own ops
    attn.config._attn_implementation = "eager"
    assert not eligible(attn, parts)
    attn.config._attn_implementation = "sdpa"
    biased, _ = attention_layer(bias=True)
    assert not eligible(biased, Qwen3VLMoeAdapter().decode_attention_parts(biased))
    with pytest.raises(ValueError, match="fusable"):
        PromptAttention(attn, None)


SCRIPT = r"""
import torch
from types import SimpleNamespace
from vismmoe_kt.engine.fused_attention import heads_torch, prompt_heads_triton
from vismmoe_kt.engine.slot_cache import SlotKVCache

torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):
    heads, kv, d, rows, start, slot = 4, 2, 16, 5, 3, 1
    p = SimpleNamespace(heads=heads, kv_heads=kv, head_dim=d, layer_index=1,
                        query_norm=((torch.rand(d) + 0.5).to(dtype), 1e-6), key_norm=((torch.rand(d) + 0.5).to(dtype), 1e-5))
    qkv = torch.randn(rows, (heads + 2 * kv) * d).to(dtype)
    angles = torch.rand(rows, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    cache = SlotKVCache(2, 3, kv, d, 12, dtype, "cpu")
    query, key, value = heads_torch(qkv, cos, sin, p)
    got = prompt_heads_triton(qkv, cos, sin, p, cache.keys[1][slot], cache.values[1][slot], start)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    assert got.shape == (1, heads, rows, d)
    torch.testing.assert_close(got[0], query.transpose(0, 1), **tol)
    torch.testing.assert_close(cache.keys[1][slot, :, start:start + rows], key.transpose(0, 1), **tol)
    torch.testing.assert_close(cache.values[1][slot, :, start:start + rows], value.transpose(0, 1), rtol=0, atol=0)
    written = torch.zeros(cache.keys[1].shape[:3], dtype=torch.bool)  # the slots and the pad slot
    written[slot, :, start:start + rows] = True
    for buffer in (cache.keys[1], cache.values[1]):
        assert buffer[~written].abs().sum() == 0  # nothing outside the prompt's positions of its slot
    assert cache.keys[0].abs().sum() == 0
print("OK")
"""


def test_the_prompt_heads_kernel_matches_its_twin_in_the_interpreter():
    run_in_triton_interpreter(SCRIPT)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import tiny_case
    model_dir, ref, inputs = tiny_case(tmp_path_factory, "tiny-4x16", 1, "Describe the image.", (160, 128), 2)
    return model_dir, inputs


def with_prompt_attention(model):
    """Every attention of the loaded model's text model on the prompt forward (the twin: on the CPU)."""
    adapter = Qwen3VLMoeAdapter()
    text = model.model.language_model
    forwards = []
    for layer in adapter.layers_of(text):
        module = adapter.attention(layer)
        module.forward = PromptAttention(module, adapter.decode_attention_parts(module), kernel=False)
        forwards.append(module.forward)
    return forwards


@pytest.mark.parametrize("rules", ["optimize_rules/qwen3vl-offload.yaml", "optimize_rules/qwen3vl.yaml"])
def test_a_model_on_the_prompt_attention_decodes_the_same_tokens(tiny, rules):
    """The prompt runs through the replacement in every layer (visual tokens pruned after the prefix with the
    default rules) and the greedy tokens are the module's."""
    from vismmoe_kt import load
    from vismmoe_kt.engine.generation import generate

    model_dir, inputs = tiny
    tokens = []
    for fused in (False, True):
        model, _ = load(model_dir, rules, generate_device="cpu", prefill_device="cpu", progress=False)
        forwards = with_prompt_attention(model) if fused else []
        with torch.no_grad():
            tokens.append(generate(model, inputs, 12))
        assert all(forward.served == 1 for forward in forwards)  # one prompt, one call a layer
    assert torch.equal(tokens[1], tokens[0])
