"""Visual-token saliency: head-averaged attention each merged visual token receives in the vision
encoder's last block (docs/design.md "Vision compression"), per image; or (`saliency_source: llm`, FastV-style)
the attention the last prompt token pays to each visual token in the last layer of the LLM prefix.

The vision tower runs fused attention, so the probabilities are never materialised; a forward
pre-hook on the last block's attention keeps its inputs, from which `take()` recomputes them for that block only:
q, k from its qkv projection with the same rotary embedding, softmax(q k^T / sqrt(d)) inside each
image (cu_seqlens bounds), averaged over heads and queries. A merged token (spatial_merge_size**2
consecutive patches, the order Qwen-VL's processor emits) gets the mean of its patches.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree


class SaliencyRecorder:
    """Hooks the vision encoder's last attention; `take()` returns the merged tokens' saliency once.

    `received(attn, hidden, cu_seqlens, position_embeddings) -> (patches,)` is the family's attention
    math (the model adapter's `attention_received`). The hook only keeps the attention's inputs, and `take()`
    computes from them: a hook that launches nothing and reads nothing on the host lets the tower be replayed
    as a CUDA graph, which returns the kept inputs beside the tower's outputs (`recorded`, `restore`:
    engine/vision_graph.py). Eagerly the tower took about 12 ms more than its replay per 448 px prompt on an
    H100 (2026-12-05), the saliency's own math besides."""

    def __init__(self, attn: nn.Module, merge: int, received: Callable[..., torch.Tensor]):
        self.attn, self.merge, self.received = attn, merge, received
        self._inputs: tuple | None = None  # (hidden, cu_seqlens, position_embeddings) of the last forward
        self._spec = None                  # their pytree structure (what `restore` rebuilds)
        self._handle = None

    @property
    def enabled(self) -> bool:
        return self._handle is not None

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """The hook sits on the attention only while enabled."""
        if on and self._handle is None:
            self._handle = self.attn.register_forward_pre_hook(self._hook, with_kwargs=True)
        elif not on and self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._inputs = None

    def _hook(self, attn: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        cu = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        self._inputs = (hidden, cu, kwargs.get("position_embeddings"))
        self._spec = _pytree.tree_structure(self._inputs)

    def recorded(self) -> list[torch.Tensor] | None:
        """The inputs the last forward left, as a list of tensors (None: none left, or one is not a tensor)."""
        if self._inputs is None:
            return None
        leaves = _pytree.tree_leaves(self._inputs)
        return leaves if all(isinstance(leaf, torch.Tensor) for leaf in leaves) else None

    def restore(self, tensors: list[torch.Tensor]) -> None:
        """Leave `tensors` (what `recorded` gave, or a replay's values of them) as the last forward's inputs."""
        self._inputs = _pytree.tree_unflatten(list(tensors), self._spec)

    def take(self) -> torch.Tensor | None:
        if self._inputs is None:
            return None
        (hidden, cu, pos), self._inputs = self._inputs, None
        with torch.no_grad():
            patches = self.received(self.attn, hidden, cu, pos)
        return patches.view(-1, self.merge * self.merge).mean(dim=1)

    def remove(self) -> None:
        self.enabled = False
