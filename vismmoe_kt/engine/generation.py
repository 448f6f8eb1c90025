"""Text generation with our decode path: prefill through the model, then lean decode steps.

`generate(model, inputs, ...)` is what the chat command and the server call. When the model's
language model is a VisDecoder with `decode: lean` (the default), the prompt runs through the model
once (vision tower, M-RoPE positions, pruning) into a StaticKVCache, and every further token comes
from `LeanDecodeStep`: no DynamicCache growth, no HF generation loop, and one host read per token
(the sampled id, which the streamer and the stop check need anyway). Otherwise it is
`model.generate`, unchanged.

Conversations: the cache remembers which token ids and which images (by content) it holds. When the
next request starts with the same tokens and the same images (a chat's next turn re-sends the
history), only the tokens after the common prefix are prefilled on top of it: the vision tower runs
on the new images only, the earlier turns not at all. The images the cache holds must all lie inside
the reused prefix (their M-RoPE offsets then hold; positions of the new part come from the whole
prompt). Under visual-token pruning a turn that adds an image is prefilled whole (pruning picks among
all visual tokens at once), and the kept prefix is cut per layer, counting the pruned positions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

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
        return []
    pixels = inputs["pixel_values"].detach().cpu().contiguous()
    keys, start = [], 0
    for grid in grids.tolist():
        rows = grid[0] * grid[1] * grid[2]
        digest = hashlib.blake2b(pixels[start:start + rows].numpy().tobytes(), digest_size=16).digest()
        keys.append(ImageKey(tuple(grid), digest))
        start += rows
    return keys


class LeanEngine:
    """A model's decode state across requests: one StaticKVCache and the step bound to it."""

    def __init__(self, decoder: Any, lm_head: torch.nn.Module, graphs: str):
        self.decoder, self.lm_head, self.graphs = decoder, lm_head, graphs
        self.cache: StaticKVCache | None = None
        self.step: LeanDecodeStep | None = None
        self.retired_steps: list[dict] = []
        self.profiling = False  # time every piece (eager, a device sync after each): `profile()`
        self.sequence: list[int] = []   # the token ids the cache holds, in order
        self.images: list[ImageKey] = []  # the images among them, in order
        self.pruned: list[int] = []     # positions of `sequence` without an entry in layers >= pruned_from
        self.pruned_from: int | None = None
        self.reuses = self.reused_tokens = 0

    def reusable_prefix(self, ids: list[int], images: list[ImageKey], image_token_id: int | None,
                        tokens_per_patch: float, new_images_ok: bool) -> int:
        """How many leading tokens of `ids` can stay in the cache (0: prefill everything)."""
        held = self.sequence
        if self.cache is None or not held or self.cache.host_lengths[0] != len(held):
            return 0
        if images[:len(self.images)] != self.images:
            return 0  # another image where one was: same tokens, different keys and values
        common = 0
        for a, b in zip(held, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token to prefill: it gives the next logits
        if image_token_id is None:
            return common
        if image_token_id in held[common:]:
            return 0  # a held image would be cut: its M-RoPE offsets would go stale
        new = images[len(self.images):]
        if new and not new_images_ok:
            return 0
        # the new part must hold exactly the new images, whole
        if ids[common:].count(image_token_id) != round(sum(k.patches() for k in new) * tokens_per_patch):
            return 0
        return common

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
        decoder = self.decoder
        self.sequence, self.images = list(ids), list(images)
        if pruned:
            kept = set(decoder.last_keep.tolist())
            self.pruned = [p for p in range(len(ids)) if p not in kept]
            self.pruned_from = decoder.last_prune_at
        else:
            self.pruned, self.pruned_from = [], None

    def prepare(self, positions: int) -> StaticKVCache:
        """An empty cache with room for `positions` (the old buffers and graphs when they suffice)."""
        text = self.decoder.orig_module
        config = text.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = text.embed_tokens.weight
        shape = (len(text.layers), config.num_key_value_heads, head_dim)
        if self.cache is None or not self.cache.fits(*shape, positions, weight.dtype, weight.device):
            capacity = -(-positions // CAPACITY_STEP) * CAPACITY_STEP
            if self.step is not None:
                self.retired_steps.append(self.step.stats())
            self.cache = self.step = None  # free the old buffers before making larger ones
            self.cache = StaticKVCache(*shape, capacity, weight.dtype, weight.device)
            self.step = LeanDecodeStep(text, self.lm_head, self.cache, self.graphs, self.decoder.set_token_is_visual,
                                       self.decoder.step_hooks)
        self.step.profiling = self.profiling
        self.cache.reset()
        self.sequence, self.images, self.pruned, self.pruned_from = [], [], [], None
        return self.cache

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
            for key in ("steps", "graphed_steps", "segments_captured", "capture_failures", "check_failures"):
                out[key] += old[key]
        out["reused_prefixes"], out["reused_tokens"] = self.reuses, self.reused_tokens
        out["cache_capacity"] = self.cache.capacity
        out["cache_bytes"] = self.cache.nbytes()
        return out


def lean_decoder_of(model: Any):
    from ..operators.vis_decoder import VisDecoder

    inner = getattr(model, "model", None)
    decoder = getattr(inner, "language_model", None)
    return decoder if isinstance(decoder, VisDecoder) and decoder.decode == "lean" else None


def next_token(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float) -> torch.Tensor:
    """(1, V) logits -> (1,) token id: greedy, or sampled with temperature and nucleus (top-p) filtering."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / max(float(temperature), 1e-5)
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p  # the most likely token always stays
        scores = scores.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
    return torch.multinomial(scores.softmax(dim=-1), 1)[:, 0]


def _eos_ids(model: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return set() if eos is None else set([eos] if isinstance(eos, int) else eos)


def continuation(model: Any, inputs: dict[str, torch.Tensor], start: int, images: list[ImageKey],
                 held_images: int) -> dict[str, torch.Tensor]:
    """The model inputs for the tokens from `start` on, the first `held_images` images being cached."""
    prompt = inputs["input_ids"]
    part = {"input_ids": prompt[:, start:]}
    if len(images) == held_images:
        return part  # text only: positions continue from the cached length plus the held rope offset
    rows = sum(k.patches() for k in images[:held_images])
    types = inputs["mm_token_type_ids"]
    # M-RoPE positions of a new image depend on everything before it: take them from the whole prompt
    positions, deltas = model.model.get_rope_index(prompt, types, image_grid_thw=inputs["image_grid_thw"])
    model.model.rope_deltas = deltas
    part.update(pixel_values=inputs["pixel_values"][rows:], image_grid_thw=inputs["image_grid_thw"][held_images:],
                mm_token_type_ids=types[:, start:], position_ids=positions[:, :, start:])
    return part


def generate(model: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int, streamer: Any = None,
             do_sample: bool = False, temperature: float | None = None, top_p: float | None = None,
             stopping_criteria: Any = None, min_new_tokens: int = 0) -> torch.Tensor:
    """(1, prompt + new) token ids, like `model.generate` (batch 1). End-of-sequence tokens do not stop
    it before `min_new_tokens` (benchmarks decode a fixed count)."""
    decoder = lean_decoder_of(model)
    if decoder is None:
        sampling = {"do_sample": do_sample} if not do_sample else {"do_sample": True, "temperature": temperature,
                                                                     "top_p": top_p}
        return model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                              streamer=streamer, stopping_criteria=stopping_criteria, **sampling)
    prompt = inputs["input_ids"]
    if prompt.shape[0] != 1:
        raise ValueError(f"the lean decode path takes one request at a time, got a batch of {prompt.shape[0]}")
    if max_new_tokens < 1:
        return prompt
    engine = decoder.lean_engine(model.lm_head)
    ids = prompt[0].tolist()
    images = image_keys(inputs)
    reuse = 0
    if engine.fits(len(ids) + max_new_tokens) and "pixel_values_videos" not in inputs:
        merge = model.config.vision_config.spatial_merge_size
        reuse = engine.reusable_prefix(ids, images, getattr(model.config, "image_token_id", None), 1 / merge ** 2,
                                       new_images_ok=not decoder.active)
    if streamer is not None:
        streamer.put(prompt.cpu())
    if reuse:  # the history is in the cache: prefill the rest only (the vision tower sees new images only)
        held_images = len(engine.images)
        engine.keep_prefix(reuse)
        cache = engine.cache
        engine.sequence, engine.images = list(ids), list(images)
        logits = model(**continuation(model, inputs, reuse, images, held_images), past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
    else:
        cache = engine.prepare(len(ids) + max_new_tokens)
        model.model.rope_deltas = None  # a new request: M-RoPE positions come from this prompt
        pruned_before = decoder.counters.pruned_prefills
        logits = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        engine.note_prefill(ids, images, decoder.counters.pruned_prefills > pruned_before)
    delta = model.model.rope_deltas
    engine.step.rope_delta.copy_(delta.reshape(-1)[:1] if delta is not None else torch.zeros(1, dtype=torch.long))
    eos, produced = _eos_ids(model), []
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    held = engine.sequence
    engine.sequence = []  # unknown until the loop ends normally (an error leaves the cache unusable)
    try:
        for index in range(max_new_tokens):
            token = next_token(logits, do_sample, temperature, top_p)
            value = int(token)  # the step's host read: the streamer and the stop check need the id
            produced.append(value)
            if streamer is not None:
                streamer.put(token.cpu())
            if (value in eos and index + 1 >= min_new_tokens) or index == max_new_tokens - 1:
                break
            if stopping_criteria is not None:
                so_far = torch.cat([prompt, torch.tensor([produced], device=prompt.device)], dim=1)
                if bool(torch.as_tensor(stopping_criteria(so_far, logits)).all()):
                    break
            logits = engine.step(token)
        engine.sequence = held + produced[:-1]  # every produced token but the last went through a step
    finally:
        if streamer is not None:
            streamer.end()
    return torch.cat([prompt, torch.tensor([produced], dtype=prompt.dtype, device=prompt.device)], dim=1)
