"""Grouped-query decode attention (engine/decode_attention.py) against transformers' sdpa, which
repeats the key/value heads: the same output for one query token with a per-row mask, and every other
call handed to sdpa unchanged."""

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vismmoe_kt.demo.tiny import build_tiny_model
from vismmoe_kt.engine.decode_attention import NAME, grouped_decode_attention, use_grouped_decode_attention
from vismmoe_kt.models import adapter_for


class Heads(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def test_one_query_token_attends_as_with_repeated_heads_and_the_rest_goes_to_sdpa():
    torch.manual_seed(0)
    rows, kv_heads, span, dim = 3, 2, 10, 16
    key, value = torch.randn(rows, kv_heads, span, dim), torch.randn(rows, kv_heads, span, dim)
    query = torch.randn(rows, kv_heads * 4, 1, dim)
    lengths = torch.tensor([3, 10, 6])  # each row sees its own positions only
    visible = torch.arange(span)[None, :] < lengths[:, None]
    mask = torch.zeros(rows, 1, 1, span).masked_fill(~visible[:, None, None], float("-inf"))
    got, _ = grouped_decode_attention(Heads(), query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(Heads(), query, key, value, mask, scaling=0.25)
    assert got.shape == want.shape == (rows, 1, kv_heads * 4, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a prefill (several query tokens, causal): sdpa's own answer
    prefill = torch.randn(1, kv_heads * 4, span, dim)
    got, _ = grouped_decode_attention(Heads(), prefill, key[:1], value[:1], None, scaling=0.25)
    want, _ = sdpa_attention_forward(Heads(), prefill, key[:1], value[:1], None, scaling=0.25)
    assert torch.equal(got, want)


def test_a_text_models_sdpa_config_switches_and_other_choices_stay():
    model, _ = build_tiny_model("tiny-4x16", seed=0)
    adapter = adapter_for("qwen3_vl_moe")
    config = adapter.text_model(model).config
    assert config._attn_implementation == "sdpa" and use_grouped_decode_attention(config)
    assert config._attn_implementation == NAME and use_grouped_decode_attention(config)  # twice: no change
    assert model.config.vision_config._attn_implementation == "sdpa"  # the vision tower keeps its own
    config._attn_implementation = "eager"
    assert not use_grouped_decode_attention(config) and config._attn_implementation == "eager"
