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
from .scheduler import BlockPool, Scheduler, SchedulerError, Sequence
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


@dataclass(eq=False)
class BatchRequest:
    """One request of a BatchRunner: its processed inputs (batch 1), how many tokens, how sampled, and who
    hears of each sampled id (`on_token`, called on the runner's thread)."""
    inputs: dict[str, torch.Tensor]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    min_new_tokens: int = 0  # end-of-sequence tokens do not stop it before this many (benchmarks)
    on_token: Callable[[int], None] | None = None
    sequence: Sequence | None = None
    rope_delta: int = 0


class BatchRunner:
    """The open loop of continuous batching: `add` requests at any time, `step` runs the scheduler's next
    plan (one prefill and a decode token for every running sequence), `cancel` drops one at the next step.
    Slots hold `capacity` tokens each (prompt and new tokens); `max_batch` of them run at once."""

    def __init__(self, model: Any, max_batch: int, capacity: int, max_queue: int):
        engine = decode_engine(model)
        if engine is None:
            raise ValueError("batched generation runs on the lean decode path: the rules need a VisDecoder "
                             "(e.g. optimize_rules/qwen3vl.yaml) and decode: lean")
        if engine.context.routing is not None:
            raise ValueError("batched generation does not take a routing source yet (--routing model)")
        self.model, self.engine, self.capacity = model, engine, capacity
        adapter, text = engine.adapter, engine.text
        config, weight = text.config, adapter.token_embedding(text).weight
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = SlotKVCache(len(adapter.layers_of(text)), max_batch, config.num_key_value_heads, head_dim,
                                 capacity, weight.dtype, weight.device)
        self.step_fn = BatchedDecodeStep(text, adapter, adapter.output_head(model), self.cache, engine.context)
        # a slot is one block of `capacity` tokens: a request fits one (`add` checks), so nothing is preempted
        self.scheduler = Scheduler(BlockPool(max_batch, capacity), max_batch=max_batch, max_queue=max_queue,
                                   prefill_chunk=capacity)
        self.eos = frozenset(_eos_ids(model))
        self.device = weight.device
        self.requests: dict[int, BatchRequest] = {}
        engine.forget()  # the single-request cache is not this one: its next request prefills whole

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def add(self, request: BatchRequest) -> Sequence:
        prompt = request.inputs["input_ids"]
        if prompt.shape[0] != 1:
            raise ValueError("each request is one prompt (batch 1)")
        if prompt.shape[1] + request.max_new_tokens > self.capacity:
            raise SchedulerError(f"a request of {prompt.shape[1]} prompt tokens and {request.max_new_tokens} new ones "
                                 f"is longer than a slot ({self.capacity} tokens)")
        stops = self.eos if request.min_new_tokens == 0 else frozenset()
        request.sequence = self.scheduler.add(Sequence(prompt.shape[1], request.max_new_tokens, stops))
        self.requests[request.sequence.id] = request
        return request.sequence

    def cancel(self, request: BatchRequest) -> None:
        if request.sequence is not None:
            self.scheduler.cancel(request.sequence)

    def step(self) -> tuple[int, list[BatchRequest]]:
        """Run one plan: (the decode step's batch size, the requests that ended in it, cancelled ones too)."""
        plan = self.scheduler.plan()
        sampled: dict[int, int] = {}
        if plan.prefill is not None:
            sampled[plan.prefill.sequence.id] = self._prefill(plan.prefill.sequence)
        if plan.decode:
            requests = [self.requests[s.id] for s in plan.decode]
            self.cache.begin_decode([s.kv_blocks[0] for s in plan.decode])
            last = torch.tensor([s.generated[-1] for s in plan.decode], device=self.device)
            deltas = torch.tensor([r.rope_delta for r in requests], device=self.device)
            logits = self.step_fn(last, deltas)
            for row, (sequence, request) in enumerate(zip(plan.decode, requests)):
                sampled[sequence.id] = _sample(logits[row:row + 1], request.sampling)
        for sequence_id, token in sampled.items():
            request = self.requests[sequence_id]
            if request.min_new_tokens and len(request.sequence.generated) + 1 >= request.min_new_tokens:
                request.sequence.stop_token_ids = self.eos  # end-of-sequence may stop it from now on
            if request.on_token is not None:
                request.on_token(token)
        self.scheduler.finish_step(plan, sampled)
        ended = [r for r in self.requests.values() if r.sequence.done]
        for request in ended:
            del self.requests[request.sequence.id]
        return len(plan.decode), ended

    def _prefill(self, sequence: Sequence) -> int:
        """A new sequence's prompt through the model into its slot; the token it samples."""
        request, slot, adapter = self.requests[sequence.id], sequence.kv_blocks[0], self.engine.adapter
        self.cache.release(slot)
        adapter.set_rope_delta(self.model, None)  # this prompt's own M-RoPE positions
        logits = self.model(**request.inputs, past_key_values=self.cache.slot_view(slot), use_cache=True,
                            logits_to_keep=1).logits[:, -1]
        delta = adapter.rope_delta(self.model)
        request.rope_delta = int(delta.reshape(-1)[0]) if delta is not None else 0
        return _sample(logits, request.sampling)


def generate_batch(model: Any, requests: list[dict[str, torch.Tensor]], max_new_tokens: int | list[int],
                   max_batch: int = 8, sampling: Sampling | list[Sampling] | None = None,
                   min_new_tokens: int = 0, on_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Each request's (1, prompt + new) token ids, the requests decoded together (at most `max_batch` at
    once, the rest waiting for a free slot). `on_step(B)` is told each decode step's batch size."""
    budgets = [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    samplings = sampling if isinstance(sampling, list) else [sampling or Sampling()] * len(requests)
    if not len(budgets) == len(samplings) == len(requests):
        raise ValueError(f"{len(requests)} requests, {len(budgets)} token budgets, {len(samplings)} samplings")
    capacity = max(r["input_ids"].shape[1] + n for r, n in zip(requests, budgets))
    runner = BatchRunner(model, min(max_batch, len(requests)), capacity, max_queue=len(requests))
    batch = [BatchRequest(r, n, s, min_new_tokens) for r, n, s in zip(requests, budgets, samplings)]
    for request in batch:
        runner.add(request)
    while not runner.idle:
        size, _ = runner.step()
        if size and on_step is not None:
            on_step(size)
    return [torch.cat([r.inputs["input_ids"], torch.tensor([r.sequence.generated], dtype=r.inputs["input_ids"].dtype,
                                                           device=r.inputs["input_ids"].device)], dim=1)
            for r in batch]


def _sample(logits: torch.Tensor, sampling: Sampling) -> int:
    return int(next_token(logits, sampling.do_sample, sampling.temperature, sampling.top_p))
