"""Text generation with our decode path: prefill through the model, then lean decode steps.

`generate(model, inputs, ...)` is what chat, the server, eval and the bench call. Where the model has
a decode engine (lean_engine.py: a VisDecoder rule and `decode: lean`, the default), the prompt runs
through the model once (vision tower, M-RoPE positions, pruning) into the engine's StaticKVCache, and
every further token comes from `LeanDecodeStep`: no DynamicCache growth, no HF generation loop, and
one host read per token (the sampled id, which the streamer and the stop check need anyway).
Otherwise it is `model.generate`, unchanged.

A request that starts with what the cache holds (a chat's next turn) prefills only the rest: the
vision tower runs on its new images only. The images the cache holds must all lie inside the reused
prefix (their M-RoPE offsets then hold; positions of the new part come from the whole prompt). Under
visual-token pruning a turn that adds an image is prefilled whole (pruning picks among all visual
tokens at once), and the kept prefix is cut per layer, counting the pruned positions.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError
from ..models import ModelAdapter
from ..core.context import context_of_model
from .lean_engine import ImageKey, decode_engine, image_keys


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


def continuation(model: Any, adapter: ModelAdapter, inputs: dict[str, torch.Tensor], start: int,
                 images: list[ImageKey], held_images: int) -> dict[str, torch.Tensor]:
    """The model inputs for the tokens from `start` on, the first `held_images` images being cached."""
    prompt = inputs["input_ids"]
    part = {"input_ids": prompt[:, start:]}
    if len(images) == held_images:
        return part  # text only: positions continue from the cached length plus the held rope offset
    rows = sum(k.patches() for k in images[:held_images])
    # M-RoPE positions of a new image depend on everything before it: take them from the whole prompt
    positions, deltas = adapter.rope_index(model, inputs)
    adapter.set_rope_delta(model, deltas)
    part.update(pixel_values=inputs["pixel_values"][rows:], image_grid_thw=inputs["image_grid_thw"][held_images:],
                position_ids=positions[:, :, start:])
    for name in ("mm_token_type_ids", adapter.modality_argument()):  # M-RoPE families' processors give the first
        if name in inputs:  # (Kimi K2.5's does not); a modality-separated family's experts need the second
            part[name] = inputs[name][:, start:]
    return part


def check_context(model: Any, adapter: ModelAdapter, prompt_tokens: int, max_new_tokens: int) -> None:
    """A clear error before any work where a request could outgrow the model's context as we serve it
    (`context_length`: Llama 4's attention chunk, else the model's positions), not a wrong token past it."""
    limit = adapter.context_length(model.config)
    if prompt_tokens + max_new_tokens > limit:
        raise InputError(f"a prompt of {prompt_tokens} tokens plus max_new_tokens={max_new_tokens} is over this "
                         f"model's context of {limit} tokens: shorten the prompt or ask for fewer tokens")


def generate(model: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int, streamer: Any = None,
             do_sample: bool = False, temperature: float | None = None, top_p: float | None = None,
             stopping_criteria: Any = None, min_new_tokens: int = 0) -> torch.Tensor:
    """(1, prompt + new) token ids, like `model.generate` (batch 1). End-of-sequence tokens do not stop
    it before `min_new_tokens` (benchmarks decode a fixed count)."""
    engine = decode_engine(model)
    context = engine.context if engine is not None else context_of_model(model)
    routing = context.routing if context is not None else None  # a routing source replacing the routers' choice
    if engine is None:
        if routing is not None:
            routing.begin(inputs["input_ids"], max_new_tokens)
        sampling = {"do_sample": do_sample} if not do_sample else {"do_sample": True, "temperature": temperature,
                                                                     "top_p": top_p}
        return model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                              streamer=streamer, stopping_criteria=stopping_criteria, **sampling)
    prompt = inputs["input_ids"]
    check_context(model, engine.adapter, int(prompt.shape[1]), max_new_tokens)
    if prompt.shape[0] != 1:
        raise ValueError(f"the lean decode path takes one request at a time, got a batch of {prompt.shape[0]}")
    if max_new_tokens < 1:
        return prompt
    adapter, pruning = engine.adapter, engine.context.pruning
    ids = prompt[0].tolist()
    images = image_keys(inputs)
    reuse = 0
    if engine.fits(len(ids) + max_new_tokens) and "pixel_values_videos" not in inputs:
        merge = adapter.vision_merge_size(model.config)
        reuse = engine.reusable_prefix(ids, images, adapter.image_token_id(model.config), 1 / merge ** 2,
                                       new_images_ok=not pruning.active)
    if streamer is not None:
        streamer.put(prompt.cpu())
    if not reuse:
        engine.prepare(len(ids) + max_new_tokens)
    if routing is not None:
        routing.begin(prompt, max_new_tokens, start=reuse)
    if reuse:  # the history is in the cache: prefill the rest only (the vision tower sees new images only)
        held_images = len(engine.images)
        engine.keep_prefix(reuse)
        cache = engine.cache
        engine.sequence, engine.images = list(ids), list(images)
        logits = model(**continuation(model, adapter, inputs, reuse, images, held_images), past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
    else:
        cache = engine.cache
        adapter.set_rope_delta(model, None)  # a new request: M-RoPE positions come from this prompt
        pruned_before = pruning.pruned_prefills
        logits = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        engine.note_prefill(ids, images, pruning.pruned_prefills > pruned_before)
    delta = adapter.rope_delta(model)
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
