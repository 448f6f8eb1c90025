"""The vision encoder's attention in fewer launches (engine/vision_attention.py): the module's values to the
bit, one or several images packed, the images' lengths read once a forward of the tower, and the calls it
leaves to the module."""

import torch
from torch.overrides import TorchFunctionMode
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (Qwen3VLMoeVisionAttention,
                                                                    Qwen3VLMoeVisionRotaryEmbedding)

from vismmoe_kt.engine.vision_attention import ImageLengths, VisionAttention, install
from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter


def vision_attention(seed=0):
    config = Qwen3VLMoeVisionConfig(hidden_size=64, num_heads=4, depth=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3VLMoeVisionAttention(config).eval(), config


def inputs(config, lengths, seed=1):
    torch.manual_seed(seed)
    patches = sum(lengths)
    hidden = torch.randn(patches, 64).to(torch.bfloat16)
    positions = torch.randint(0, 8, (patches, 2))
    head_dim = 64 // 4
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)))
    freqs = torch.cat([positions[:, :1] * inv, positions[:, 1:] * inv], -1)
    emb = torch.cat([freqs, freqs], -1)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return hidden, cu, (emb.cos(), emb.sin())


class CountReads(TorchFunctionMode):
    """Counts tensor -> list reads (a device wait on a GPU)."""
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += getattr(func, "__name__", "") == "tolist"
        return func(*args, **(kwargs or {}))


def test_the_vision_attention_equals_the_module_to_the_bit():
    attn, config = vision_attention()
    attn.to(torch.bfloat16)
    parts = Qwen3VLMoeAdapter().vision_attention_parts(attn)
    assert parts is not None and parts.heads == 4 and parts.head_dim == 16
    fused = VisionAttention(attn, parts, ImageLengths(), Qwen3VLMoeAdapter())
    for lengths in ([12], [12, 20, 4]):  # one image, several packed
        hidden, cu, embeddings = inputs(config, lengths)
        with torch.no_grad():
            want = attn(hidden, cu_seqlens=cu, position_embeddings=embeddings)
            got = fused(hidden, cu_seqlens=cu, position_embeddings=embeddings)
        assert got.shape == want.shape == (sum(lengths), 64) and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fused.served == 2


def test_the_blocks_of_one_forward_read_the_lengths_once():
    lengths = ImageLengths()
    modules = [vision_attention(seed)[0] for seed in range(3)]
    fused = [VisionAttention(m, Qwen3VLMoeAdapter().vision_attention_parts(m), lengths, Qwen3VLMoeAdapter())
             for m in modules]
    hidden, cu, embeddings = inputs(modules[0].config, [6, 10])
    hidden = hidden.float()
    with torch.no_grad(), CountReads() as counter:
        for forward in fused:
            hidden = forward(hidden, cu_seqlens=cu, position_embeddings=embeddings)
    assert counter.reads == 1
    with torch.no_grad(), CountReads() as counter:
        fused[0](hidden, cu_seqlens=cu.clone(), position_embeddings=embeddings)  # another forward's bounds
    assert counter.reads == 1


def test_calls_it_does_not_serve_go_to_the_module():
    attn, config = vision_attention(seed=2)
    fused = VisionAttention(attn, Qwen3VLMoeAdapter().vision_attention_parts(attn), ImageLengths(), Qwen3VLMoeAdapter())
    hidden, cu, embeddings = inputs(config, [9])
    hidden = hidden.float()
    fused(hidden, cu_seqlens=cu, position_embeddings=embeddings)   # gradients on
    attn.qkv = torch.nn.Linear(64, 192)  # a projection replaced after install
    with torch.no_grad():
        torch.testing.assert_close(fused(hidden, cu_seqlens=cu, position_embeddings=embeddings),
                                   attn(hidden, cu_seqlens=cu, position_embeddings=embeddings), rtol=0, atol=0)
    attn.config._attn_implementation = "eager"
    with torch.no_grad():
        want = attn(hidden, cu_seqlens=cu, position_embeddings=embeddings)
        torch.testing.assert_close(fused(hidden, cu_seqlens=cu, position_embeddings=embeddings), want, rtol=0, atol=0)
    assert fused.served == 0


def test_install_puts_it_on_each_block_of_a_model_once(tmp_path):
    from vismmoe_kt.demo.tiny import build_tiny_model

    model, _ = build_tiny_model("tiny-4x16", seed=0)
    adapter = Qwen3VLMoeAdapter()
    attentions = [block.attn for block in model.model.visual.blocks]
    assert len(attentions) == model.config.vision_config.depth
    assert install(adapter, model) == len(attentions) and install(adapter, model) == 0
    assert all(isinstance(vars(a)["forward"], VisionAttention) for a in attentions)
    assert len({id(vars(a)["forward"].lengths) for a in attentions}) == 1  # one tower, one read of its lengths
