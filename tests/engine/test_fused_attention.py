"""The decode step's fused attention (engine/fused_attention.py) and fused ops (add + RMSNorm, the
router's top-k softmax): the torch twin against transformers' Qwen3-VL-MoE attention module writing the
same slot cache; the Triton kernels against the twins in Triton's interpreter; the kernels compiled for
Hopper at Qwen3-VL-30B-A3B's shapes."""

import pytest
import torch
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextAttention, Qwen3VLMoeTextRotaryEmbedding

from vismmoe_kt.engine.fused_attention import FusedDecodeAttention, fusable, stacked_qkv_weight
from vismmoe_kt.engine.slot_cache import SlotKVCache
from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter

from conftest import UNDER_INTERPRETER, compile_for_hopper, run_in_triton_interpreter

SLOTS, CAPACITY = 3, 40


def attention_layer(seed=0, bias=False):
    config = Qwen3VLMoeTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  attention_bias=bias, num_hidden_layers=2, rope_scaling={"rope_type": "default",
                                  "mrope_section": [2, 3, 3]})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    attn = Qwen3VLMoeTextAttention(config, layer_idx=1).eval()
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.uniform_(0.5, 1.5)  # not ones: a norm applied without its weight would pass
    return attn, config


def filled_caches(attn, config, lengths):
    """Two equal slot caches with prompts of `lengths` written through the module, and the rotary."""
    rotary = Qwen3VLMoeTextRotaryEmbedding(config)
    caches = [SlotKVCache(2, SLOTS, 2, 16, CAPACITY, torch.float32, "cpu") for _ in range(2)]
    for slot, length in enumerate(lengths):
        hidden = torch.randn(1, length, 64)
        positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
        cos, sin = rotary(hidden, positions)
        for cache in caches:
            attn(hidden_states=hidden, position_embeddings=(cos, sin), attention_mask=None,
                 past_key_values=cache.slot_view(slot))
    return caches, rotary


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, 0]])  # every slot in order (views), a gather of some
def test_the_fused_decode_attention_equals_the_module_and_writes_the_same_cache(slots):
    attn, config = attention_layer()
    lengths = [5, 9, 3]
    caches, rotary = filled_caches(attn, config, lengths)
    parts = Qwen3VLMoeAdapter().decode_attention_parts(attn)
    assert fusable(parts) and parts.layer_index == 1 and parts.heads == 4 and parts.kv_heads == 2
    hidden = torch.randn(len(slots), 1, 64)
    positions = torch.tensor([lengths[s] for s in slots]).view(1, -1, 1).expand(3, -1, 1)
    cos, sin = rotary(hidden, positions)
    outputs = []
    for cache, fused in zip(caches, (False, True)):
        cache.begin_decode(slots)
        mask = cache.decode_masks(hidden.dtype)[1]
        if fused:
            out = FusedDecodeAttention(parts, cache)(hidden, cos, sin, mask)
        else:
            out = attn(hidden_states=hidden, position_embeddings=(cos, sin), attention_mask=mask,
                       past_key_values=cache)[0]
        outputs.append(out)
        cache.advance()
    assert outputs[1].shape == outputs[0].shape == (len(slots), 1, 64)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip((*caches[0].keys, *caches[0].values), (*caches[1].keys, *caches[1].values)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert caches[1].host_lengths == caches[0].host_lengths


def test_the_stacked_weight_replaces_the_projections_without_changing_them():
    attn, _ = attention_layer(seed=3)
    before = [p.weight.clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    parts = Qwen3VLMoeAdapter().decode_attention_parts(attn)
    stacked = stacked_qkv_weight(parts)
    assert stacked.shape == (4 * 16 + 2 * 2 * 16, 64)
    assert attn.q_proj.weight.data_ptr() == stacked.data_ptr()  # views of it: nothing held twice
    for old, module in zip(before, (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(module.weight, old, rtol=0, atol=0)
    assert stacked_qkv_weight(parts) is stacked  # made once


def test_attentions_the_fused_path_cannot_serve_keep_their_module():
    attn, _ = attention_layer(bias=True)
    assert Qwen3VLMoeAdapter().decode_attention_parts(attn) is None
    assert not fusable(None)


SCRIPT = r"""
import torch
from types import SimpleNamespace
from vismmoe_kt.engine.fused_attention import heads_torch, heads_triton
from vismmoe_kt.engine.fused_ops import _route_triton, add_rms_norm, _add_rms_norm_kernel, triton
from vismmoe_kt.engine.slot_cache import SlotKVCache

torch.manual_seed(0)
# bfloat16 is not here: the interpreter converts it approximately (numpy has none); gpu_check.py checks it
for dtype in (torch.float32, torch.float16):
    heads, kv, d, rows = 4, 2, 16, 2
    p = SimpleNamespace(heads=heads, kv_heads=kv, head_dim=d, layer_index=1,
                        query_norm=((torch.rand(d) + 0.5).to(dtype), 1e-6), key_norm=((torch.rand(d) + 0.5).to(dtype), 1e-5))
    qkv = torch.randn(rows, (heads + 2 * kv) * d).to(dtype)
    angles = torch.rand(rows, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    caches = [SlotKVCache(2, 3, kv, d, 8, dtype, "cpu") for _ in range(2)]
    prompts = [(slot, torch.randn(1, kv, n, d).to(dtype), torch.randn(1, kv, n, d).to(dtype)) for slot, n in ((0, 2), (2, 5))]
    for cache in caches:
        for slot, k, v in prompts:
            cache.slot_view(slot).update(k, v, 1)
        cache.begin_decode([2, 0])
    query, key, value = heads_torch(qkv, cos, sin, p)
    caches[0].update(key[:, :, None], value[:, :, None], 1)
    got = heads_triton(qkv, cos, sin, p, caches[1])
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, query, **tol)
    for a, b in zip((caches[0].keys[1], caches[0].values[1]), (caches[1].keys[1], caches[1].values[1])):
        torch.testing.assert_close(b, a, **tol)
    assert caches[1].keys[1][2, :, 5].abs().sum() > 0 and caches[1].keys[1][0, :, 2].abs().sum() > 0

    x, r = torch.randn(3, 100).to(dtype), torch.randn(3, 100).to(dtype)
    w = (torch.rand(100) + 0.5).to(dtype)
    total, out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(3,)](x, r, w, total, out, 100, 100, 1e-6, N=100, BLOCK=128)
    want_total, want = add_rms_norm(w, 1e-6, x, r)   # on the CPU: the torch path
    torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    torch.testing.assert_close(out, want, **tol)

    logits = torch.randn(5, 24).to(dtype)
    weights, chosen, every = _route_triton(logits, 6, True)
    top, ids = torch.topk(logits, 6, dim=-1)
    assert torch.equal(chosen, ids) and chosen.dtype == torch.long
    torch.testing.assert_close(weights, torch.softmax(top, -1, dtype=torch.float).to(dtype), **tol)
    torch.testing.assert_close(every, torch.softmax(logits, -1, dtype=torch.float), rtol=1e-5, atol=1e-6)
    assert len(_route_triton(logits, 6, False)) == 2
print("OK")
"""


def test_the_kernels_match_their_twins_in_the_interpreter():
    run_in_triton_interpreter(SCRIPT)


SPLIT_SCRIPT = r"""
import torch
import torch.nn.functional as F
from types import SimpleNamespace
from vismmoe_kt.engine.fused_attention import heads_torch
from vismmoe_kt.engine.split_attention import attend_triton, workspace
from vismmoe_kt.engine.slot_cache import SlotKVCache

torch.manual_seed(0)
d = 16
for dtype in (torch.float32, torch.float16):
    for heads, kv in ((4, 2), (6, 2)):  # G = 2 and 3: the head group padded to tl.dot's 16 rows
        p = SimpleNamespace(heads=heads, kv_heads=kv, head_dim=d, layer_index=1, scaling=d ** -0.5,
                            query_norm=((torch.rand(d) + 0.5).to(dtype), 1e-6), key_norm=((torch.rand(d) + 0.5).to(dtype), 1e-5))
        # gathered rows and rows in slot order; one split, several, more splits than a short row has blocks
        for slots, splits in (([2, 0], 1), ([2, 0], 4), ([0, 1, 2], 2), ([0, 1, 2], 8)):
            caches = [SlotKVCache(2, 3, kv, d, 200, dtype, "cpu") for _ in range(2)]
            prompts = [(s, torch.randn(1, kv, n, d).to(dtype), torch.randn(1, kv, n, d).to(dtype)) for s, n in ((0, 2), (2, 75))]
            rows = len(slots)
            qkv = torch.randn(rows, (heads + 2 * kv) * d).to(dtype)
            angles = torch.rand(rows, d // 2) * 6
            cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
            for cache in caches:
                for slot, k, v in prompts:
                    cache.slot_view(slot).update(k, v, 1)
                cache.begin_decode(slots)  # slot 1 is empty: its row attends to its new token alone
            query, key, value = heads_torch(qkv, cos, sin, p)
            keys, values = caches[0].update(key[:, :, None], value[:, :, None], 1)
            mask = caches[0].decode_masks(dtype)[1].float()
            grouped = query.view(rows, kv, heads // kv, d).float()
            want = F.scaled_dot_product_attention(grouped, keys.float(), values.float(), attn_mask=mask, scale=p.scaling)
            space = workspace(caches[1], heads, kv, d)
            got = attend_triton(qkv, cos, sin, p, caches[1], space, splits=splits)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-3, atol=3e-3)
            torch.testing.assert_close(got.float(), want.reshape(rows, -1), **tol)
            for a, b in zip((caches[0].keys[1], caches[0].values[1]), (caches[1].keys[1], caches[1].values[1])):
                torch.testing.assert_close(b, a, **tol)  # the new keys and values where the module writes them
            assert int(space.counters.abs().sum()) == 0  # every merge reset its counter
print("OK")
"""


def test_the_one_kernel_attention_matches_heads_and_sdpa_in_the_interpreter():
    run_in_triton_interpreter(SPLIT_SCRIPT, timeout=900)


@pytest.mark.skipif(UNDER_INTERPRETER, reason="the interpreter replaces the compiler")
def test_the_fused_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    from vismmoe_kt.engine import fused_attention, fused_ops

    for prompt in (False, True):  # a decode step's rows, a prompt's (engine/prompt_attention.py)
        compile_for_hopper(fused_attention._heads_kernel,
                           {"qkv_ptr": "*bf16", "row_stride": "i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                            "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps_q": "fp32", "eps_k": "fp32", "q_ptr": "*bf16",
                            "q_row_stride": "i32", "q_head_stride": "i32",
                            "k_cache": "*bf16", "v_cache": "*bf16", "slot_stride": "i32", "head_stride": "i32",
                            "pos_stride": "i32", "slots_ptr": "*i64", "lengths_ptr": "*i64", "first_position": "i32",
                            "HQ": "constexpr", "HKV": "constexpr", "D": "constexpr", "PROMPT": "constexpr"},
                           {"HQ": 32, "HKV": 4, "D": 128, "PROMPT": prompt}, num_warps=1)
    from vismmoe_kt.engine import split_attention
    compile_for_hopper(split_attention._attend_kernel,
                       {"qkv_ptr": "*bf16", "row_stride": "i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                        "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps_q": "fp32", "eps_k": "fp32",
                        "k_cache": "*bf16", "v_cache": "*bf16", "slot_stride": "i32", "head_stride": "i32",
                        "pos_stride": "i32", "slots_ptr": "*i64", "lengths_ptr": "*i64", "part_ptr": "*fp32",
                        "stat_ptr": "*fp32", "count_ptr": "*i32", "out_ptr": "*bf16", "scale": "fp32",
                        "HQ": "constexpr", "HKV": "constexpr", "D": "constexpr", "G": "constexpr", "GP": "constexpr",
                        "SPLITS": "constexpr", "MAXS": "constexpr", "BLOCK_N": "constexpr", "ITERS": "constexpr"},
                       {"HQ": 32, "HKV": 4, "D": 128, "G": 8, "GP": 16, "SPLITS": 32, "MAXS": 64, "BLOCK_N": 32,
                        "ITERS": 1}, num_warps=4)
    compile_for_hopper(fused_ops._add_rms_norm_kernel,
                       {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "total_ptr": "*bf16", "out_ptr": "*bf16",
                        "x_stride": "i32", "r_stride": "i32", "eps": "fp32", "N": "constexpr", "BLOCK": "constexpr"},
                       {"N": 2048, "BLOCK": 2048}, num_warps=4)
    compile_for_hopper(fused_ops._route_kernel,
                       {"logits_ptr": "*bf16", "stride": "i32", "weights_ptr": "*bf16", "chosen_ptr": "*i64",
                        "every_ptr": "*fp32", "E": "constexpr", "K": "constexpr", "BLOCK": "constexpr",
                        "KBLOCK": "constexpr", "PROBABILITIES": "constexpr"},
                       {"E": 128, "K": 8, "BLOCK": 128, "KBLOCK": 8, "PROBABILITIES": True}, num_warps=1)
