"""Text generation with our decode path: prefill through the model, then lean decode steps.

`generate(model, inputs, ...)` is what the chat command and the server call. When the model's
language model is a VisDecoder with `decode: lean` (the default), the prompt runs through the model
once (vision tower, M-RoPE positions, pruning) into a StaticKVCache, and every further token comes
from `LeanDecodeStep`: no DynamicCache growth, no HF generation loop, and one host read per token
(the sampled id, which the streamer and the stop check need anyway). Otherwise it is
`model.generate`, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from .lean_step import LeanDecodeStep
from .static_cache import StaticKVCache

CAPACITY_STEP = 256  # caches grow in these steps, so most requests reuse the buffers (and the graphs)


class LeanEngine:
    """A model's decode state across requests: one StaticKVCache and the step bound to it."""

    def __init__(self, decoder: Any, lm_head: torch.nn.Module, graphs: str):
        self.decoder, self.lm_head, self.graphs = decoder, lm_head, graphs
        self.cache: StaticKVCache | None = None
        self.step: LeanDecodeStep | None = None
        self.retired_steps: list[dict] = []
        self.profiling = False  # time every piece (eager, a device sync after each): `profile()`

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
            self.step = LeanDecodeStep(text, self.lm_head, self.cache, self.graphs, self.decoder.set_token_is_visual)
        self.step.profiling = self.profiling
        self.cache.reset()
        return self.cache

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


def generate(model: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int, streamer: Any = None,
             do_sample: bool = False, temperature: float | None = None, top_p: float | None = None,
             stopping_criteria: Any = None) -> torch.Tensor:
    """(1, prompt + new) token ids, like `model.generate` (batch 1)."""
    decoder = lean_decoder_of(model)
    if decoder is None:
        sampling = {"do_sample": do_sample} if not do_sample else {"do_sample": True, "temperature": temperature,
                                                                     "top_p": top_p}
        return model.generate(**inputs, max_new_tokens=max_new_tokens, streamer=streamer,
                              stopping_criteria=stopping_criteria, **sampling)
    prompt = inputs["input_ids"]
    if prompt.shape[0] != 1:
        raise ValueError(f"the lean decode path takes one request at a time, got a batch of {prompt.shape[0]}")
    if max_new_tokens < 1:
        return prompt
    engine = decoder.lean_engine(model.lm_head)
    cache = engine.prepare(prompt.shape[1] + max_new_tokens)
    if streamer is not None:
        streamer.put(prompt.cpu())
    model.model.rope_deltas = None  # a new request: M-RoPE positions come from this prompt
    logits = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    delta = model.model.rope_deltas
    engine.step.rope_delta.copy_(delta.reshape(-1)[:1] if delta is not None else torch.zeros(1, dtype=torch.long))
    eos, produced = _eos_ids(model), []
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    try:
        for index in range(max_new_tokens):
            token = next_token(logits, do_sample, temperature, top_p)
            value = int(token)  # the step's host read: the streamer and the stop check need the id
            produced.append(value)
            if streamer is not None:
                streamer.put(token.cpu())
            if value in eos or index == max_new_tokens - 1:
                break
            if stopping_criteria is not None:
                so_far = torch.cat([prompt, torch.tensor([produced], device=prompt.device)], dim=1)
                if bool(torch.as_tensor(stopping_criteria(so_far, logits)).all()):
                    break
            logits = engine.step(token)
    finally:
        if streamer is not None:
            streamer.end()
    return torch.cat([prompt, torch.tensor([produced], dtype=prompt.dtype, device=prompt.device)], dim=1)
