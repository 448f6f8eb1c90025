"""The vision encoder's attention with fewer launches and one device wait a prompt, not one a block.

Shapes: S patches (every image's, packed), H heads, D head dim, cu_seqlens (images + 1,) the images' bounds.

A prompt's picture runs every block of the vision encoder (27 for Qwen3-VL-30B-A3B) once, as transformers'
modules, and with every expert on the GPU a prompt is bound by the host launching kernels. transformers'
Qwen3-VL vision attention, under sdpa, reads the images' lengths back from the device at every block
(`cu_seqlens.tolist()`: a wait) and runs the rotary embedding as about fourteen element-wise kernels (each
of the query and the key cast to fp32, rotated by halves, multiplied, added and cast back). Here, for the
attentions the adapter describes (VisionAttentionParts):
    qkv        the projection, as the module runs it;
    rotary     the query and key together (vision_rotary.py): on a GPU one kernel, elsewhere one cast, one
               rotation, the products and the cast back (the same fp32 values either way);
    attention  sdpa inside each image, the lengths read once for all the blocks of a prompt (they share
               one cu_seqlens tensor), no concatenation for a single image;
    output     the output projection.
The values are the module's. Every call it does not serve (training, gradients, flash or eager attention,
no position embeddings) runs the module's own forward. Installed on every device: the module's ops in
fewer calls, and on a GPU the rotary embedding's one kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.base import VisionAttentionParts
from .vision_rotary import rotate


class ImageLengths:
    """The images' lengths of the tower's current forward, read from its cu_seqlens once and shared by the
    blocks (each gets the same tensor)."""

    def __init__(self):
        # (the bounds tensor, its lengths): held, so no other tensor can take its identity; one tuple, so a
        # reader never sees one forward's bounds with another's lengths
        self._last: tuple[torch.Tensor, list[int]] | None = None

    def of(self, cu_seqlens: torch.Tensor) -> list[int]:
        last = self._last
        if last is None or last[0] is not cu_seqlens:
            last = self._last = (cu_seqlens, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())  # the forward's one wait
        return last[1]


class VisionAttention:
    """A replacement forward for one vision attention: `(hidden_states (S, C), cu_seqlens, position_embeddings
    ((S, D) cos, sin), **kwargs)` -> (S, C), the module's contract."""

    def __init__(self, module: nn.Module, parts: VisionAttentionParts, lengths: ImageLengths, adapter: Any):
        self.module, self.parts, self.lengths, self.adapter = module, parts, lengths, adapter
        self.own_forward = module.forward
        self.served = 0

    def serves(self, position_embeddings: Any) -> bool:
        """Inference under sdpa, with the projections the parts were made from (a replaced one: the module's)."""
        return position_embeddings is not None and not self.module.training and not torch.is_grad_enabled() \
            and getattr(self.module.config, "_attn_implementation", None) == "sdpa" \
            and self.adapter.vision_attention_parts(self.module) == self.parts

    def __call__(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
        if not self.serves(position_embeddings):
            return self.own_forward(hidden_states, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                                    **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        p, patches = self.parts, hidden_states.shape[0]
        qkv = p.projection(hidden_states).reshape(patches, 3, p.heads, p.head_dim)
        query_key = rotate(qkv, *position_embeddings)  # (2, S, H, D), the module's dtype (vision_rotary.py)
        # (1, H, S, D) views of contiguous (S, H, D) tensors, as the module hands them to the attention
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query_key[0], query_key[1], qkv[:, 2]))
        lengths = self.lengths.of(cu_seqlens)
        chunks = zip(*(t.split(lengths, dim=2) for t in (query, key, value))) if len(lengths) > 1 \
            else [(query, key, value)]
        outputs = [sdpa_attention_forward(self.module, q, k, v, attention_mask=None, scaling=p.scaling, dropout=0.0,
                                          is_causal=False)[0] for q, k, v in chunks]   # (1, S_i, H, D) each
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        self.served += 1
        return p.output(out.reshape(patches, -1))


def install(adapter: Any, model: nn.Module) -> int:
    """Give each vision attention of the model that the adapter describes the forward above; the count. The
    modules are found by what they are (the tower may sit inside an operator that replaced it)."""
    lengths, installed = ImageLengths(), 0  # one tower: its blocks share the lengths of a forward
    for module in model.modules():
        parts = adapter.vision_attention_parts(module)
        if parts is None or "forward" in vars(module):
            continue
        module.forward = VisionAttention(module, parts, lengths, adapter)
        installed += 1
    return installed
