"""Visual-token saliency: head-averaged attention each merged visual token receives in the vision
encoder's last block (DESIGN.md "Decisions"), per image; or (`saliency_source: llm`, FastV-style)
the attention the last prompt token pays to each visual token in the last layer of the LLM prefix.

The vision tower runs fused attention, so the probabilities are never materialised; a forward
pre-hook on the last block's attention recomputes them from its inputs for that block only:
q, k from its qkv projection with the same rotary embedding, softmax(q k^T / sqrt(d)) inside each
image (cu_seqlens bounds), averaged over heads and queries. A merged token (spatial_merge_size**2
consecutive patches, the order Qwen-VL's processor emits) gets the mean of its patches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def received_attention(attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(patches,) mean attention received by each patch in `attn` (a Qwen-VL vision attention)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

    length = hidden.shape[0]
    q, k, _ = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
    out = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks = q[start:end].transpose(0, 1).float(), k[start:end].transpose(0, 1).float()  # (heads, L, d)
        received = torch.zeros(end - start, device=hidden.device)
        for head in range(qs.shape[0]):  # one head at a time keeps memory at L x L
            probs = torch.softmax(qs[head] @ ks[head].T * attn.scaling, dim=-1)
            received += probs.mean(dim=0)
        out.append(received / qs.shape[0])
    return torch.cat(out)


class SaliencyRecorder:
    """Hooks the last vision block's attention; `take()` returns the merged tokens' saliency once."""

    def __init__(self, vision_tower: nn.Module, merge: int):
        self.merge = merge
        self.enabled = False
        self._value: torch.Tensor | None = None
        attn = vision_tower.blocks[-1].attn
        self._handle = attn.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, attn: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.enabled:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        cu = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        pos = kwargs.get("position_embeddings")
        with torch.no_grad():
            patches = received_attention(attn, hidden, cu, pos)
        self._value = patches.view(-1, self.merge * self.merge).mean(dim=1)

    def take(self) -> torch.Tensor | None:
        value, self._value = self._value, None
        return value

    def remove(self) -> None:
        self._handle.remove()


def last_token_attention(attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                         positions: torch.Tensor) -> torch.Tensor:
    """Head-averaged attention of the last token to `positions`, in a Qwen3 text attention layer
    (`hidden` is that layer's input after its input norm; batch 1)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb

    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(hidden[:, -1:]).view(1, 1, -1, attn.head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
    cos, sin = position_embeddings
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    k = k.repeat_interleave(attn.num_key_value_groups, dim=1)  # grouped-query attention
    probs = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * attn.scaling, dim=-1)  # (1, heads, 1, S)
    return probs.mean(dim=1)[0, 0, positions]
