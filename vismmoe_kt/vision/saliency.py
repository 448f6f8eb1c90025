"""Visual-token saliency: head-averaged attention each merged visual token receives in the vision
encoder's last block (docs/design.md "Vision compression"), per image; or (`saliency_source: llm`, FastV-style)
the attention the last prompt token pays to each visual token in the last layer of the LLM prefix.

The vision tower runs fused attention, so the probabilities are never materialised; a forward
pre-hook on the last block's attention recomputes them from its inputs for that block only:
q, k from its qkv projection with the same rotary embedding, softmax(q k^T / sqrt(d)) inside each
image (cu_seqlens bounds), averaged over heads and queries. A merged token (spatial_merge_size**2
consecutive patches, the order Qwen-VL's processor emits) gets the mean of its patches.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class SaliencyRecorder:
    """Hooks the vision encoder's last attention; `take()` returns the merged tokens' saliency once.

    `received(attn, hidden, cu_seqlens, position_embeddings) -> (patches,)` is the family's attention
    math (the model adapter's `attention_received`)."""

    def __init__(self, attn: nn.Module, merge: int, received: Callable[..., torch.Tensor]):
        self.attn, self.merge, self.received = attn, merge, received
        self._value: torch.Tensor | None = None
        self._handle = None

    @property
    def enabled(self) -> bool:
        return self._handle is not None

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """The hook sits on the attention only while enabled: a hook inside the tower keeps the tower from being
        replayed as a CUDA graph (engine/vision_graph.py), since a replay would not run it."""
        if on and self._handle is None:
            self._handle = self.attn.register_forward_pre_hook(self._hook, with_kwargs=True)
        elif not on and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, attn: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        cu = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        pos = kwargs.get("position_embeddings")
        with torch.no_grad():
            patches = self.received(attn, hidden, cu, pos)
        self._value = patches.view(-1, self.merge * self.merge).mean(dim=1)

    def take(self) -> torch.Tensor | None:
        value, self._value = self._value, None
        return value

    def remove(self) -> None:
        self.enabled = False
