"""A prompt's attention in four kernels: the decode step's fused attention (fused_attention.py) for the
prefill of one sequence, which runs transformers' attention modules.

Shapes: T prompt rows, H hidden, Hq query heads, Hkv key/value heads, D head dim.

With every expert on the GPU a prompt is bound by the host launching kernels (about 5100 for 236 tokens
over 48 layers, 105 ms for 45 ms of device work on an H200), and transformers' Qwen3 attention is about
19 of a layer's: three projections, two per-head norms, ten element-wise ops of the rotary embedding,
two cache writes, the attention, a copy and the output projection. Here, where the module writes one
sequence into our slot cache (`SlotView`: a single request's prompt, or a chunk of it):
    qkv        one GEMM over the stacked query/key/value weights (the modules' weights are views of it);
    heads      fused_attention's heads kernel over the T rows: each query and key head's RMSNorm and rotary
               embedding, the query written in sdpa's (1, Hq, T, D) layout, the key and value into the
               slot at positions start..start+T-1;
    attention  sdpa over the slot's keys so far, as transformers calls it (grouped heads, causal, or the
               mask it was given for a continued prompt);
    output     the output projection.
Every other call (a batch of prompts, a decode step through the module, attentions output) runs the
module's own forward. The values are the module's, each op rounded as torch rounds it (the heads
kernel's contract); `install` does it only where the kernel serves (CUDA, Triton, a power-of-two head
dim), since on the CPU the module's own ops are what the twin would run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.base import DecodeAttentionParts
from .decode_attention import NAME as GROUPED_SDPA, grouped_decode_attention
from .fused_attention import KERNEL_DTYPES, fusable, heads_torch, prompt_heads_triton, stacked_qkv_weight, tl
from .slot_cache import SlotView


class PromptAttention:
    """A replacement forward for one attention module: `(hidden_states (1, T, H), position_embeddings,
    attention_mask, past_key_values, **kwargs)` -> (output (1, T, H), None), the module's contract.
    `kernel` False runs the heads kernel's torch twin (the CPU's tests)."""

    def __init__(self, module: nn.Module, parts: DecodeAttentionParts, kernel: bool = True):
        if not fusable(parts):
            raise ValueError("these attention parts do not fit the fused attention (fusable() says why not)")
        self.module, self.parts, self.kernel = module, parts, kernel
        self.own_forward = module.forward  # the module's forward: every call this one does not serve
        self.qkv_weight = stacked_qkv_weight(parts)
        self.served = 0

    def serves(self, hidden: torch.Tensor, past: Any, kwargs: dict) -> bool:
        """An inference prompt of one sequence into a slot cache made for this attention; else the module."""
        if type(past) is not SlotView or hidden.dim() != 3 or hidden.shape[0] != 1 or kwargs.get("output_attentions") \
                or self.module.training or torch.is_grad_enabled() or not asks_for_sdpa(self.module):
            return False  # training (dropout, gradients: the kernel has no backward) and other calls
        cache, p = past.cache, self.parts
        keys, values = cache.keys[p.layer_index], cache.values[p.layer_index]
        return cache.dtype == self.qkv_weight.dtype and cache.device == self.qkv_weight.device \
            and keys.shape[-1] == values.shape[-1] == p.head_dim and keys.stride() == values.stride() \
            and (not self.kernel or hidden.is_cuda)

    def __call__(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None, past_key_values: Any = None, **kwargs: Any):
        if not self.serves(hidden_states, past_key_values, kwargs):
            return self.own_forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        p, rows = self.parts, hidden_states.shape[1]
        qkv = F.linear(hidden_states[0], self.qkv_weight)                              # (T, (Hq + 2 Hkv) D)
        cos, sin = (t.reshape(rows, p.head_dim) for t in position_embeddings)
        start, _ = past_key_values.claim(p.layer_index, rows)
        try:
            query = self._heads(qkv, cos, sin, past_key_values, start)
            keys, values = past_key_values.filled(p.layer_index)
            out, _ = grouped_decode_attention(self.module, query, keys, values, attention_mask, scaling=p.scaling,
                                              **kwargs)                                 # (1, T, Hq, D)
        except BaseException:
            past_key_values.rewind(p.layer_index, start)  # the positions were not written: not the slot's
            raise
        self.served += 1
        return F.linear(out.reshape(1, rows, -1), p.output.weight), None

    def _heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: SlotView,
               start: int) -> torch.Tensor:
        """The query (1, Hq, T, D), normed and rotated; the keys and values written at start..start+T-1."""
        p, cache, slot, rows = self.parts, past.cache, past.slot, qkv.shape[0]
        keys, values = cache.keys[p.layer_index][slot], cache.values[p.layer_index][slot]
        if self.kernel:
            return prompt_heads_triton(qkv, cos, sin, p, keys, values, start)
        query, key, value = heads_torch(qkv, cos, sin, p)
        keys[:, start:start + rows] = key.transpose(0, 1)
        values[:, start:start + rows] = value.transpose(0, 1)
        return query.transpose(0, 1)[None]


def eligible(module: nn.Module, parts: DecodeAttentionParts | None) -> bool:
    """Whether the prompt forward computes what this module would: parts the fused attention takes, and
    sdpa the attention asked for (eager or flash attention keep the module's own)."""
    return fusable(parts) and asks_for_sdpa(module)


def asks_for_sdpa(module: nn.Module) -> bool:
    """The attention implementation the module's config names now (per call: it can be switched after install;
    the parts' own fit holds from install on, and a cache that no longer fits them is checked apart)."""
    return getattr(module.config, "_attn_implementation", None) in ("sdpa", GROUPED_SDPA)


def kernel_serves(parts: DecodeAttentionParts) -> bool:
    """Whether the heads kernel runs these weights: on a CUDA device with Triton, a power-of-two head dim."""
    weight = parts.query.weight
    return tl is not None and weight.is_cuda and weight.dtype in KERNEL_DTYPES \
        and parts.head_dim & (parts.head_dim - 1) == 0


def install(adapter: Any, text: nn.Module) -> int:
    """Give each of the text model's attentions that the kernel serves the prompt forward; the count."""
    installed = 0
    for layer in adapter.layers_of(text):
        module = adapter.attention(layer)
        parts = adapter.decode_attention_parts(module)
        if "forward" in vars(module) or not eligible(module, parts) or not kernel_serves(parts):
            continue
        module.forward = PromptAttention(module, parts)
        installed += 1
    return installed
