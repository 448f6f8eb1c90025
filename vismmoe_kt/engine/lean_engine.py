"""The decode engine's state for one model: a StaticKVCache, the LeanDecodeStep bound to it, and what
the cache holds (for conversations that reuse it).

The engine owns decoding: it is made on first use for a model whose text model's forward is ours
(a VisDecoder rule registered it in the load context) and kept in that context (`decode_state`).
`decode_engine(model)` returns it, or None where transformers' loop decodes (no such rule, or
`decode: hf`). The engine reads everything model-specific through the family's adapter.

Conversations: the cache remembers which token ids and which images (by content) it holds. When the
next request starts with the same tokens and the same images (a chat's next turn re-sends the
history), only the tokens after the common prefix are prefilled on top of it (generation.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.context import LoadContext, context_of_model
from ..models import ModelAdapter, adapter_for
from .decode_attention import use_grouped_decode_attention
from .fused_ops import fuse_norms
from .lean_step import LeanDecodeStep
from .static_cache import StaticKVCache

CAPACITY_STEP = 256  # caches grow in these steps, so most requests reuse the buffers (and the graphs)


@dataclass(frozen=True)
class ImageKey:
    grid: tuple[int, int, int]  # (t, h, w) patches
    digest: bytes               # of its pixel rows: two images of one size give the same tokens

    def patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def image_keys(inputs: dict[str, torch.Tensor]) -> list[ImageKey]:
    """One key per image of a processed request, in prompt order."""
    grids = inputs.get("image_grid_thw")
    if grids is None:
        return _whole_request_key(inputs)
    pixels = inputs["pixel_values"].detach().cpu().contiguous()
    keys, start = [], 0
    for grid in grids.tolist():
        rows = grid[0] * grid[1] * grid[2]
        digest = hashlib.blake2b(pixels[start:start + rows].numpy().tobytes(), digest_size=16).digest()
        keys.append(ImageKey(tuple(grid), digest))
        start += rows
    return keys


def _whole_request_key(inputs: dict[str, torch.Tensor]) -> list[ImageKey]:
    """Images without per-image grids (DeepSeek-OCR-2: global views and local tiles, fixed token counts):
    one key for all of the request's pixels, with no patches. A cache then keeps a prefix only for the
    very same images and no new ones (another image, or one more, prefills the whole prompt)."""
    tensors = [inputs[name] for name in ("pixel_values", "pixel_values_local") if inputs.get(name) is not None]
    if not tensors:
        return []
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return [ImageKey((0, 0, 0), digest.digest())]


def reusable_prefix(held: list[int], held_images: list[ImageKey], ids: list[int], images: list[ImageKey],
                    image_token_id: int | None, tokens_per_patch: float, new_images_ok: bool) -> int:
    """How many leading tokens of a request (`ids`, `images`) a cache holding `held` (with
    `held_images`) can keep (0: prefill everything)."""
    if not held or images[:len(held_images)] != held_images:
        return 0  # another image where one was: same tokens, different keys and values
    common = _shared_tokens(held, ids)
    if image_token_id is None:
        return common
    if image_token_id in held[common:]:
        return 0  # a held image would be cut: its M-RoPE offsets would go stale
    new = images[len(held_images):]
    if new and not new_images_ok:
        return 0
    # the new part must hold exactly the new images, whole
    if ids[common:].count(image_token_id) != round(sum(k.patches() for k in new) * tokens_per_patch):
        return 0
    return common


class ImageKeys:
    """A request's image keys (image_keys), hashed on first use: hashing copies the pixels
    to the host, several milliseconds an image, which a finishing request would otherwise add to the
    step every running stream waits for."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        self._inputs: dict[str, torch.Tensor] | None = inputs
        self._keys: list[ImageKey] | None = None

    def count(self) -> int:
        """How many images (from their grids: nothing hashed)."""
        if self._keys is not None:
            return len(self._keys)
        grids = self._inputs.get("image_grid_thw")
        return 0 if grids is None else int(grids.shape[0])

    def get(self) -> list[ImageKey]:
        if self._keys is None:
            self._keys, self._inputs = image_keys(self._inputs), None
        return self._keys


def may_continue(held: list[int], ids: list[int], image_token: int | None) -> bool:
    """Whether a slot holding `held` could keep a prefix of `ids`, judged by the tokens alone (reusable_prefix
    decides, hashing the images, only where this says yes): they share a first token, and no held image
    lies past the shared tokens (one would be cut)."""
    common = _shared_tokens(held, ids)
    return common > 0 and (image_token is None or image_token not in held[common:])


def _shared_tokens(held: list[int], ids: list[int]) -> int:
    """Leading tokens `held` and `ids` share, leaving at least one of `ids` to prefill (it gives the
    next logits)."""
    common = 0
    for a, b in zip(held, ids):
        if a != b:
            break
        common += 1
    return min(common, len(ids) - 1)


class LeanEngine:
    """A model's decode state across requests: one StaticKVCache and the step bound to it."""

    def __init__(self, text: nn.Module, adapter: ModelAdapter, lm_head: nn.Module, context: LoadContext):
        self.text, self.adapter, self.lm_head, self.context = text, adapter, lm_head, context
        self.graphs = context.decode.graphs
        self.cache: StaticKVCache | None = None
        self.step: LeanDecodeStep | None = None
        self.retired_steps: list[dict] = []
        self.profiling = False  # time every piece (eager, a device sync after each): `profile()`
        self.sequence: list[int] = []   # the token ids the cache holds, in order
        self.images: list[ImageKey] = []  # the images among them, in order
        self.pruned: list[int] = []     # positions of `sequence` without an entry in layers >= pruned_from
        self.pruned_from: int | None = None
        self.reuses = self.reused_tokens = 0
        self.graph_pool = None  # one CUDA graph memory pool for every step (cache size) this engine makes
        context.step_hooks.append(context.ep_step_hook(lambda: 1))  # a step of one row, to an EP group
        use_grouped_decode_attention(text.config)  # decode steps' masked attention without repeating K/V heads
        # the attention's query/key RMSNorms in one kernel each on the GPU (7 launches fewer per norm: ~670 per step)
        fuse_norms([norm for layer in adapter.layers_of(text) for norm in adapter.attention_norms(adapter.attention(layer))],
                   adapter.rms_norm_params)

    def reusable_prefix(self, ids: list[int], images: list[ImageKey], image_token_id: int | None,
                        tokens_per_patch: float, new_images_ok: bool) -> int:
        """How many leading tokens of `ids` can stay in the cache (0: prefill everything)."""
        if self.cache is None or not self.sequence or self.cache.host_lengths[0] != len(self.sequence):
            return 0
        return reusable_prefix(self.sequence, self.images, ids, images, image_token_id, tokens_per_patch,
                               new_images_ok)

    def forget(self) -> None:
        """The next request prefills whole (benchmarks of cold prefill)."""
        self.sequence = []

    def keep_prefix(self, tokens: int) -> None:
        """Cut the cache back to the first `tokens` of its sequence, per layer."""
        pruned_before = sum(1 for p in self.pruned if p < tokens)
        lengths = [tokens - pruned_before if self.pruned_from is not None and layer >= self.pruned_from else tokens
                   for layer in range(self.cache.num_layers)]
        self.cache.truncate(lengths)
        self.pruned = [p for p in self.pruned if p < tokens]
        self.sequence = self.sequence[:tokens]
        self.reuses += 1
        self.reused_tokens += tokens

    def note_prefill(self, ids: list[int], images: list[ImageKey], pruned: bool) -> None:
        """After a full prefill: what the cache holds, and which positions pruning left out."""
        pruning = self.context.pruning
        self.sequence, self.images = list(ids), list(images)
        if pruned:
            kept = set(pruning.keep.tolist())
            self.pruned = [p for p in range(len(ids)) if p not in kept]
            self.pruned_from = pruning.prune_at
        else:
            self.pruned, self.pruned_from = [], None

    def prepare(self, positions: int) -> StaticKVCache:
        """An empty cache with room for `positions` (the old buffers and graphs when they suffice)."""
        text, adapter = self.text, self.adapter
        weight = adapter.token_embedding(text).weight
        heads, key_dim, value_dim = adapter.kv_cache_shape(text.config)
        shape = (len(adapter.layers_of(text)), heads, key_dim)
        if self.cache is None or not self.cache.fits(*shape, positions, weight.dtype, weight.device, value_dim):
            capacity = -(-positions // CAPACITY_STEP) * CAPACITY_STEP
            if self.step is not None:
                self.retired_steps.append(self.step.stats())
            self.cache = self.step = None  # free the old buffers before making larger ones
            self.cache = StaticKVCache(*shape, capacity, weight.dtype, weight.device, value_dim)
            routing = self.context.routing
            if routing is not None:  # the table's buffers are read by the captured steps: sized with the cache
                routing.reserve(capacity, weight.device, weight.dtype)
            if self.graph_pool is None and weight.device.type == "cuda":
                self.graph_pool = torch.cuda.graph_pool_handle()
            runtime = self.context.offload_runtime  # an offload cache that ranks eviction by the routers
            sink = runtime.router_sink() if runtime is not None else None
            self.step = LeanDecodeStep(text, adapter, self.lm_head, self.cache, self.graphs, self._set_visual,
                                       self.context.step_hooks, routing, self.graph_pool, sink,
                                       self.context.graph_variants)
        self.step.profiling = self.profiling
        self.cache.reset()
        self.sequence, self.images, self.pruned, self.pruned_from = [], [], [], None
        return self.cache

    def _set_visual(self, flag: torch.Tensor) -> None:
        """The decode token is text: what ReaLB's operators read from the context at each step."""
        self.context.token_is_visual = flag

    def fits(self, positions: int) -> bool:
        return self.cache is not None and self.cache.capacity >= positions

    def reset_profile(self) -> None:
        if self.step is not None:
            self.step.counters.profile.clear()
            self.step.counters.profile_steps = 0

    def profile(self) -> dict[str, Any]:
        """Seconds per decode step by piece kind and layer, from the profiled steps so far."""
        if self.step is None or not self.step.counters.profile_steps:
            return {}
        steps = self.step.counters.profile_steps
        return {"steps": steps, "seconds_per_step": {kind: {layer: round(t / steps, 6) for layer, t in column.items()}
                                                     for kind, column in self.step.counters.profile.items()}}

    def stats(self) -> dict[str, Any]:
        if self.step is None:
            return {}
        out = self.step.stats()
        for old in self.retired_steps:  # totals over every cache this engine made
            for key in ("steps", "graphed_steps", "segments_captured", "capture_failures", "check_failures",
                        "check_retries"):
                out[key] += old[key]
            out["check_max_difference"] = max(out["check_max_difference"], old["check_max_difference"])
        out["reused_prefixes"], out["reused_tokens"] = self.reuses, self.reused_tokens
        out["cache_capacity"] = self.cache.capacity
        out["cache_bytes"] = self.cache.nbytes()
        return out


def decode_engine(model: Any) -> LeanEngine | None:
    """The model's decode engine (made on first use), or None where transformers' loop decodes."""
    context = context_of_model(model)
    if context is None or context.text_model is None or context.decode.decode != "lean":
        return None
    if context.decode_state is None:
        info = getattr(model, "vismmoe", None)
        adapter = info.adapter if info is not None else adapter_for(model.config.model_type)
        context.decode_state = LeanEngine(context.text_model, adapter, adapter.output_head(model), context)
    return context.decode_state
