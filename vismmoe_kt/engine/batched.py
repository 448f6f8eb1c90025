"""Batched generation: several requests in one decode step, as the scheduler plans (continuous batching).

Shapes: B sequences in a step, H hidden, V vocabulary, K experts per token, C a slot's capacity.

`generate_batch(model, requests, ...)` runs requests to the end through the Scheduler (scheduler.py):
a new request's prompt runs through the model once (vision tower, M-RoPE positions, pruning) into
its own slot of a SlotKVCache (slot_cache.py), and every running sequence then gets one token per
`BatchedDecodeStep`, all rows in one forward: one router call and one expert call per MoE layer for
the whole batch, so an expert that several rows route to is fetched once per step. Requests join
when a slot is free and leave when they finish, between steps. Greedy rows give the tokens the
request gets alone (`generate`), whatever ran beside it.

This first version decodes eagerly (no CUDA graphs), prefills a prompt in one piece, gives each
sequence a slot of the longest request's size (so nothing is preempted), and takes neither a
routing source nor prefix reuse; the offload runtime serves its batch through the placement path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..models import ModelAdapter
from .generation import _eos_ids, next_token
from .lean_engine import decode_engine
from .lean_step import norm_fn, router_fn
from .scheduler import BlockPool, Scheduler, Sequence
from .slot_cache import SlotKVCache


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0


class BatchedDecodeStep:
    """One decode token for each of B sequences in a SlotKVCache (its active slots), eagerly."""

    def __init__(self, text: nn.Module, adapter: ModelAdapter, lm_head: nn.Module, cache: SlotKVCache, context: Any):
        self.text, self.adapter, self.lm_head, self.cache, self.context = text, adapter, lm_head, cache, context
        self.embed = adapter.token_embedding(text)
        self.layers = [self._layer(index, layer) for index, layer in enumerate(adapter.layers_of(text))]
        self.final_norm = norm_fn(adapter, adapter.final_norm(text))
        if len(self.layers) != cache.num_layers:
            raise ValueError(f"the cache has {cache.num_layers} layers, the model {len(self.layers)}")

    def _layer(self, index: int, layer: nn.Module) -> Callable[..., torch.Tensor]:
        adapter, cache = self.adapter, self.cache
        norm_in = norm_fn(adapter, adapter.input_norm(layer))
        norm_post = norm_fn(adapter, adapter.post_attention_norm(layer))
        attention, mlp, experts = adapter.attention(layer), adapter.feed_forward(layer), adapter.experts(layer)
        router = router_fn(adapter, adapter.router(layer)) if experts is not None else None

        def run(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
            attended, _ = attention(hidden_states=norm_in(hidden), position_embeddings=(cos, sin),
                                    attention_mask=masks[index], past_key_values=cache)
            hidden = hidden + attended
            normed = norm_post(hidden)
            if experts is None:
                return hidden + mlp(normed)
            flat = normed.view(-1, normed.shape[-1])                        # (B, H): one token per row
            weights, chosen = router(flat)                                   # (B, K) each
            return hidden + experts(flat, chosen, weights).view_as(hidden)
        return run

    def __call__(self, tokens: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        """(B,) last tokens and M-RoPE deltas of the cache's active rows -> (B, V) logits; the rows move on."""
        hidden = self.embed(tokens.view(-1, 1))                              # (B, 1, H)
        # decode tokens are text: what the operators that treat visual tokens apart read from the context
        self.context.token_is_visual = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        position = self.cache.lengths[0, self.cache.active] + rope_deltas    # the prefix layer holds every position
        cos, sin = self.adapter.rotary(self.text, hidden, position.view(1, -1, 1).expand(3, -1, 1))
        masks = self.cache.decode_masks(hidden.dtype)                        # (L, B, 1, 1, C)
        for run in self.layers:
            hidden = run(hidden, cos, sin, masks)
        logits = self.lm_head(self.final_norm(hidden))[:, -1]
        self.cache.advance()
        return logits


def generate_batch(model: Any, requests: list[dict[str, torch.Tensor]], max_new_tokens: int | list[int],
                   max_batch: int = 8, sampling: Sampling | list[Sampling] | None = None,
                   min_new_tokens: int = 0, on_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Each request's (1, prompt + new) token ids, the requests decoded together (at most `max_batch` at
    once, the rest waiting for a free slot). `on_step(B)` is told each decode step's batch size."""
    engine = decode_engine(model)
    if engine is None:
        raise ValueError("batched generation runs on the lean decode path: the rules need a VisDecoder "
                         "(e.g. optimize_rules/qwen3vl.yaml) and decode: lean")
    if engine.context.routing is not None:
        raise ValueError("batched generation does not take a routing source yet (--routing model)")
    budgets = [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    samplings = sampling if isinstance(sampling, list) else [sampling or Sampling()] * len(requests)
    if not len(budgets) == len(samplings) == len(requests):
        raise ValueError(f"{len(requests)} requests, {len(budgets)} token budgets, {len(samplings)} samplings")
    if any(r["input_ids"].shape[0] != 1 for r in requests):
        raise ValueError("each request is one prompt (batch 1)")
    adapter, text = engine.adapter, engine.text
    capacity = max(r["input_ids"].shape[1] + n for r, n in zip(requests, budgets))
    slots = min(max_batch, len(requests))
    config, weight = text.config, adapter.token_embedding(text).weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = SlotKVCache(len(adapter.layers_of(text)), slots, config.num_key_value_heads, head_dim, capacity,
                        weight.dtype, weight.device)
    step = BatchedDecodeStep(text, adapter, adapter.output_head(model), cache, engine.context)
    # a slot is a block of `capacity` tokens: every request fits one, so nothing is ever preempted
    scheduler = Scheduler(BlockPool(slots, capacity), max_batch=slots, max_queue=len(requests), prefill_chunk=capacity)
    eos = frozenset(_eos_ids(model))
    sequences = [scheduler.add(Sequence(r["input_ids"].shape[1], n, eos if min_new_tokens == 0 else frozenset()))
                 for r, n in zip(requests, budgets)]
    index_of = {s.id: i for i, s in enumerate(sequences)}
    deltas = torch.zeros(len(requests), dtype=torch.long, device=weight.device)
    engine.forget()  # the single-request cache is not this one: its next request prefills whole
    while not scheduler.idle:
        plan = scheduler.plan()
        sampled: dict[int, int] = {}
        if plan.prefill is not None:
            sequence = plan.prefill.sequence
            i, slot = index_of[sequence.id], sequence.kv_blocks[0]
            cache.release(slot)
            adapter.set_rope_delta(model, None)  # this prompt's own M-RoPE positions
            logits = model(**requests[i], past_key_values=cache.slot_view(slot), use_cache=True,
                           logits_to_keep=1).logits[:, -1]
            delta = adapter.rope_delta(model)
            deltas[i] = delta.reshape(-1)[0] if delta is not None else 0
            sampled[sequence.id] = _sample(logits, samplings[i])
        if plan.decode:
            rows = [index_of[s.id] for s in plan.decode]
            cache.begin_decode([s.kv_blocks[0] for s in plan.decode])
            last = torch.tensor([s.generated[-1] for s in plan.decode], device=weight.device)
            logits = step(last, deltas[rows])
            for row, (sequence, i) in enumerate(zip(plan.decode, rows)):
                sampled[sequence.id] = _sample(logits[row:row + 1], samplings[i])
            if on_step is not None:
                on_step(len(plan.decode))
        for sequence in plan.decode + ((plan.prefill.sequence,) if plan.prefill is not None else ()):
            if min_new_tokens and len(sequence.generated) + 1 >= min_new_tokens:  # eos may stop it from now on
                sequence.stop_token_ids = eos
        scheduler.finish_step(plan, sampled)
    return [torch.cat([r["input_ids"], torch.tensor([s.generated], dtype=r["input_ids"].dtype,
                                                   device=r["input_ids"].device)], dim=1)
            for r, s in zip(requests, sequences)]


def _sample(logits: torch.Tensor, sampling: Sampling) -> int:
    return int(next_token(logits, sampling.do_sample, sampling.temperature, sampling.top_p))
