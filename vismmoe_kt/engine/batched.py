"""Batched generation: several requests in one decode step, as the scheduler plans (continuous batching).

Shapes: B sequences in a step, H hidden, V vocabulary, K experts per token, C a slot's capacity.

`generate_batch(model, requests, ...)` runs requests to the end through the Scheduler (scheduler.py):
a new request's prompt runs through the model once (vision tower, M-RoPE positions, pruning) into
its own slot of a SlotKVCache (slot_cache.py), and every running sequence then gets one token per
`BatchedDecodeStep`, all rows in one forward: one router call and one expert call per MoE layer for
the whole batch, so an expert that several rows route to is fetched once per step. Requests join
when a slot is free and leave when they finish, between steps. Greedy rows give the tokens the
request gets alone (`generate`), whatever ran beside it.

The step is LeanDecodeStep's pieces over B rows, captured in CUDA graphs per power-of-two batch size
and attention span where the rules' `graphs` allow (BatchedDecodeStep). A routing source
(`--routing synthetic`) gives each slot its own table. Prompts are prefilled whole, or `prefill_chunk`
tokens per step (BatchRunner); fresh whole prompts waiting together (up to `prefill_budget` tokens)
run as one right-padded forward, their images through one vision-tower call, so a burst of
requests costs one prefill's fixed cost and the running streams wait once, not once per newcomer.
A finished request's slot keeps its KV until another request needs it: a conversation's next turn,
which re-sends the history, goes to that slot and prefills only what follows (as the single-request
engine reuses its cache). Each sequence gets a slot of the longest
request's size, so nothing is preempted. The offload runtime serves a batch's pinned
layers from their banks and its offloaded ones through the decode table, token after token inside
the step (a miss one token lands is a hit for the next), both inside the graphs; with the hybrid's
CPU calls or a lookahead predictor, offloaded layers take the placement path instead, eagerly
between the graphs (one read of the step's routing per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..core.context import LoadContext
from ..models import ModelAdapter
from .generation import _eos_ids, check_context, continuation, next_token
from .graphs import State
from .lean_engine import ImageKeys, decode_engine, image_keys, may_continue, reusable_prefix
from .lean_step import LeanDecodeStep, experts_capturable, router_fn
from .prefill_group import family_per_token_inputs, group_inputs, groupable, padding_token
from .scheduler import BlockPool, PrefillChunk, Scheduler, SchedulerError, Sequence, Status
from .slot_cache import SlotKVCache

PREFILL_BUDGET = 8192  # prompt tokens prefilled together in one step (vLLM's default max_num_batched_tokens)


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0


class BatchedDecodeStep(LeanDecodeStep):
    """One decode token for each of B sequences in a SlotKVCache: LeanDecodeStep's pieces over B rows.

    With graphs, a step runs as R rows, R the next power of two of B (padding rows read and write the
    cache's pad slot), or R = B where offloaded layers look experts up row by row in the decode table
    (a padding row would fetch experts for nobody); each (R, attention span) gets its captures, made
    when first needed and checked against the eager step as LeanDecodeStep checks its own. Experts that
    are device work only for several rows (`batch_capturable`) join the graphs; the others (the
    placement path, which reads the routing on the host) run eagerly between them."""

    def __init__(self, text: nn.Module, adapter: ModelAdapter, lm_head: nn.Module, cache: SlotKVCache,
                 context: LoadContext, graphs: str = "off"):
        runtime = context.offload_runtime  # serves the step's rows as decode tokens while it runs
        hooks = []
        # an offload runtime whose table serves the batch: its step hooks too, and no padding rows (each row
        # looks its experts up in the table: a padding row would fetch experts nobody asked for)
        self.exact_rows = runtime is not None and runtime.batch_needs_exact_rows()
        if runtime is not None:
            runtime.prepare_batch(cache.max_rows)
            hooks.append((lambda: runtime.begin_batch_step(self.rows), runtime.end_batch_step))
            if runtime.batch_uses_table():
                hooks.append((runtime.before_step, runtime.after_step))
        self.context, self.rows, self.real_rows = context, 1, 1
        hooks.append(context.ep_step_hook(lambda: self.rows))  # the step (padding rows too), to an EP group
        super().__init__(text, adapter, lm_head, cache, graphs, hooks=hooks, routing=context.routing,
                         variants=[lambda: (self.rows, self.cache.span), lambda: self.cache.contiguous])
        rows, device = cache.max_rows, cache.device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)       # the captures' inputs
        self.deltas = torch.zeros(rows, dtype=torch.long, device=device)
        self.not_visual = torch.zeros(rows, dtype=torch.bool, device=device)

    @staticmethod
    def _experts_capturable(experts: nn.Module) -> bool:
        return experts_capturable(experts, "batch_capturable")

    @staticmethod
    def _layer_mask(masks: torch.Tensor, index: int) -> torch.Tensor:
        return masks[index]  # (R, 1, 1, span): each row's own

    def _router(self, moe_index: int, layer: nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The layer's router, or the routing source's row of each sequence's slot at its position (read
        on the device: the step stays capturable)."""
        if self.routing is None:
            return router_fn(self.adapter, self.adapter.router(layer))
        cache, routing = self.cache, self.routing
        return lambda x: routing.batch_decode_route(moe_index, cache.active, cache.lengths[0, cache.active])

    def _experts(self, experts: nn.Module) -> Callable[[State], State]:
        capturable = self._experts_capturable(experts)

        def run(state: State) -> State:
            hidden, flat, chosen, weights, cos, sin, masks = state
            rows = self.real_rows
            if capturable or rows == flat.shape[0]:
                out = experts(flat, chosen, weights)
            else:  # eager, between graphs: padding rows would add their experts to the step's fetches
                out = torch.zeros_like(flat)
                out[:rows] = experts(flat[:rows], chosen[:rows], weights[:rows])
            return hidden + out.view_as(hidden), cos, sin, masks
        return run

    def _embed(self, state: State) -> State:
        rows = self.rows
        hidden = self.embed(self.tokens[:rows])                                  # (R, 1, H)
        position = self.cache.lengths[0, self.cache.active] + self.deltas[:rows]  # the prefix layer holds every position
        cos, sin = self.adapter.rotary(self.text, hidden, position.view(1, -1, 1).expand(self.adapter.position_rows(), -1, 1))
        return hidden, cos, sin, self.cache.decode_masks(hidden.dtype)           # masks (L, R, 1, 1, span)

    def __call__(self, slots: list[int], tokens: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        """(B,) last tokens and M-RoPE deltas of the sequences in `slots` -> (B, V) logits; the rows move on."""
        b = self.real_rows = len(slots)
        self.rows = b if self.backend is None or self.exact_rows else 1 << (b - 1).bit_length()
        self.cache.begin_decode(slots, self.rows)
        self.tokens[:b, 0].copy_(tokens.view(-1))
        self.tokens[b:self.rows].zero_()
        self.deltas[:b].copy_(rope_deltas.view(-1))
        self.deltas[b:self.rows].zero_()
        # decode tokens are text: what the operators that treat visual tokens apart read from the context
        self.context.token_is_visual = self.not_visual[:self.rows]
        try:
            logits = self._announced(self._eager_step if self.backend is None else self._graphed_step)
        except BaseException:
            self.cache.abandon_step()
            raise
        self.cache.advance_on_host()
        self.counters.steps += 1
        self.counters.graphed_steps += self.segments is not None
        return logits[:b]


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
    started: bool = False     # its first prefill chunk ran
    slot: int | None = None   # the KV slot it ran in
    history: Any = None       # the slot's held history it was matched with when added (BatchRunner.held)


class BatchRunner:
    """The open loop of continuous batching: `add` requests at any time, `step` runs the scheduler's next
    plan (a prefill chunk and a decode token for every running sequence), `cancel` drops one at the next
    step. Slots hold `capacity` tokens each (prompt and new tokens); `max_batch` of them run at once.
    `prefill_chunk` tokens of a prompt go through the model per step (None: whole prompts), so a long
    image prompt does not stall the running streams for its whole prefill; the vision tower still runs
    on the prompt's images at once, in its first chunk. Rules that prune visual tokens prefill whole
    (pruning needs the whole prompt in one forward). With whole prompts, fresh ones that wait together
    are prefilled in one forward up to `prefill_budget` tokens (0: one at a time)."""

    def __init__(self, model: Any, max_batch: int, capacity: int, max_queue: int, prefill_chunk: int | None = None,
                 prefill_budget: int = PREFILL_BUDGET):
        engine = decode_engine(model)
        if engine is None:
            raise ValueError("batched generation runs on the lean decode path: the rules need a VisDecoder "
                             "(e.g. optimize_rules/qwen3vl.yaml) and decode: lean")
        self.model, self.engine, self.capacity = model, engine, capacity
        adapter, text = engine.adapter, engine.text
        config, weight = text.config, adapter.token_embedding(text).weight
        heads, key_dim, value_dim = adapter.kv_cache_shape(config)
        self.cache = SlotKVCache(len(adapter.layers_of(text)), max_batch, heads, key_dim, capacity, weight.dtype,
                                 weight.device, value_dim)
        self.routing = engine.context.routing if engine.context.routing is not None \
            and engine.context.routing.replaces else None
        if self.routing is not None:  # a table per slot, read by the batched step's routers
            self.routing.reserve_slots(max_batch, capacity, weight.device, weight.dtype)
        self.lm_head = adapter.output_head(model)
        self.step_fn = BatchedDecodeStep(text, adapter, self.lm_head, self.cache, engine.context, engine.graphs)
        self._parts: dict[int, dict] = {}  # sequence id -> its prompt's text-model inputs, while chunks remain
        self.prefill_pieces = 0       # prompt chunks (or whole prompts) run
        self.pieces_beside_decode = 0  # ... of them in a step that also decoded running sequences
        if prefill_chunk is not None and prefill_chunk < 2:
            raise ValueError(f"prefill_chunk must be at least 2 tokens, got {prefill_chunk}")
        self.text_forward = engine.context.text_forward
        if prefill_budget < 0:
            raise ValueError(f"prefill_budget must be at least 0 tokens, got {prefill_budget}")
        # chunks and groups both run our text model's forward on unpruned prompts; groups take whole ones
        own_forward = self.text_forward is not None and not engine.context.pruning.active
        self.prefill_chunk = prefill_chunk if own_forward else None
        grouping = own_forward and self.prefill_chunk is None
        self.prefill_groups = self.grouped_prompts = 0
        # a slot is one block of `capacity` tokens: a request fits one (`add` checks), so nothing is preempted
        self.scheduler = Scheduler(BlockPool(max_batch, capacity), max_batch=max_batch, max_queue=max_queue,
                                   prefill_chunk=self.prefill_chunk or capacity,
                                   prefill_budget=prefill_budget if grouping else 0)
        self.eos = frozenset(_eos_ids(model))
        self.device = weight.device
        self.requests: dict[int, BatchRequest] = {}
        # what each free slot still holds from the request that finished there (a chat's next turn re-sends
        # it and prefills only what follows): token ids with KV in the slot, its images, its M-RoPE delta
        self.held: dict[int, tuple[list[int], ImageKeys, int]] = {}
        self.reuses = self.reused_tokens = 0
        engine.forget()  # the single-request cache is not this one: its next request prefills whole

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def stats(self) -> dict[str, Any]:
        """The batched step's counters (LeanDecodeStep.stats), the (rows, span) shapes it captured, and
        the prefill chunk in use (None: whole prompts)."""
        step = self.step_fn
        # capture keys: ((rows, span), rows are slots 0..B-1); shapes once each
        return {**step.stats(), "captured_shapes": sorted({key[0] for key in step._captured}),
                "prefill_chunk": self.prefill_chunk, "prefill_pieces": self.prefill_pieces,
                "prefill_pieces_beside_decode": self.pieces_beside_decode, "prefill_groups": self.prefill_groups,
                "grouped_prompts": self.grouped_prompts, "reused_prefixes": self.reuses,
                "reused_tokens": self.reused_tokens}

    def add(self, request: BatchRequest) -> Sequence:
        prompt = request.inputs["input_ids"]
        if prompt.shape[0] != 1:
            raise ValueError("each request is one prompt (batch 1)")
        if prompt.shape[1] + request.max_new_tokens > self.capacity:
            raise SchedulerError(f"a request of {prompt.shape[1]} prompt tokens and {request.max_new_tokens} new ones "
                                 f"is longer than a slot ({self.capacity} tokens)")
        stops = self.eos if request.min_new_tokens == 0 else frozenset()
        sequence = Sequence(prompt.shape[1], request.max_new_tokens, stops)
        sequence.preferred_block, sequence.cached = self._reusable_slot(request)
        sequence.solo_prefill = not groupable(request.inputs, self.engine.adapter)
        request.history = self.held.get(sequence.preferred_block)  # what it expects to find there
        request.sequence = self.scheduler.add(sequence)
        self.requests[request.sequence.id] = request
        return request.sequence

    def _reusable_slot(self, request: BatchRequest) -> tuple[int | None, int]:
        """(the free slot holding the longest prefix of this request, that prefix's length), or (None, 0).
        Not with rules that prune visual tokens (a pruned slot's layers hold different lengths) or
        without the text model's own forward (a continuation runs through it)."""
        if not self.held or self.text_forward is None or self.engine.context.pruning.active \
                or "pixel_values_videos" in request.inputs:
            return None, 0
        adapter, config = self.engine.adapter, self.model.config
        ids, images = request.inputs["input_ids"][0].tolist(), ImageKeys(request.inputs)
        image_token = adapter.image_token_id(config)
        best = (None, 0)
        for slot, (held, held_images, _) in self.held.items():
            if not may_continue(held, ids, image_token):
                continue  # decided by the tokens alone: no image is hashed
            common = reusable_prefix(held, held_images.get(), ids, images.get(), image_token,
                                     1 / adapter.vision_merge_size(config) ** 2, new_images_ok=True)
            if common > best[1]:
                best = (slot, common)
        return best

    def forget_histories(self) -> None:
        """Free slots keep nothing for a next turn any more (a benchmark's timed run re-sends its warm-up's
        prompts, which must prefill whole, not continue the warm-up's KV)."""
        self.held.clear()

    def cancel(self, request: BatchRequest) -> None:
        if request.sequence is not None:
            self.scheduler.cancel(request.sequence)

    def step(self) -> tuple[int, list[BatchRequest]]:
        """Run one plan: (the decode step's batch size, the requests that ended in it, cancelled ones too)."""
        plan = self.scheduler.plan()
        sampled: dict[int, int] = {}
        if plan.prefills:
            self.prefill_pieces += 1
            self.pieces_beside_decode += bool(plan.decode)
        if len(plan.prefills) > 1:
            sampled.update(self._prefill_group(plan.prefills))
        elif plan.prefills:
            token = self._prefill(plan.prefills[0])
            if token is not None:  # the prompt's last chunk
                sampled[plan.prefills[0].sequence.id] = token
        if plan.decode:
            decode = sorted(plan.decode, key=lambda s: s.kv_blocks[0])  # rows in slot order: the cache's views
            requests = [self.requests[s.id] for s in decode]
            last = torch.tensor([s.generated[-1] for s in decode], device=self.device)
            deltas = torch.tensor([r.rope_delta for r in requests], device=self.device)
            logits = self.step_fn([s.kv_blocks[0] for s in decode], last, deltas)
            greedy = logits.argmax(dim=-1).tolist()  # one device read for every greedy row
            for row, (sequence, request) in enumerate(zip(decode, requests)):
                sampled[sequence.id] = _sample(logits[row:row + 1], request.sampling) \
                    if request.sampling.do_sample else greedy[row]
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
            self._parts.pop(request.sequence.id, None)
            self._keep_history(request)
        return len(plan.decode), ended

    def _keep_history(self, request: BatchRequest) -> None:
        """A finished request's slot keeps its KV for the conversation's next turn: the prompt and every
        generated token but the last (which no step consumed)."""
        sequence = request.sequence
        if sequence.status is not Status.FINISHED or not request.started:
            return  # cancelled, or never prefilled
        slot = request.slot
        ids = request.inputs["input_ids"][0].tolist() + sequence.generated[:-1]
        if all(lengths[slot] == len(ids) for lengths in self.cache.host_lengths):  # pruned slots are not kept
            self.held[slot] = (ids, ImageKeys(request.inputs), request.rope_delta)

    def _prefill(self, chunk: PrefillChunk) -> int | None:
        """A chunk of a sequence's prompt through the model into its slot; at the prompt's end, the token
        it samples (None before)."""
        sequence = chunk.sequence
        request, slot, adapter = self.requests[sequence.id], sequence.kv_blocks[0], self.engine.adapter
        if chunk.end > sequence.prompt_len:
            raise SchedulerError(f"sequence {sequence.id} was preempted: this runner holds a slot per sequence")
        view = self.cache.slot_view(slot)
        first = not request.started
        inputs, offset = request.inputs, 0  # what the model's forward takes, and the prompt position it starts at
        start = chunk.start
        if first:
            request.started, request.slot = True, slot
            held = self.held.pop(slot, None)
            if start and held is not None and held is request.history:  # a chat's next turn: its history is here
                self.cache.keep(slot, start)
                adapter.set_rope_delta(self.model, torch.tensor([[held[2]]], device=self.device))
                inputs = continuation(self.model, adapter, request.inputs, start, image_keys(request.inputs),
                                      held[1].count())
                offset = start
                self.reuses, self.reused_tokens = self.reuses + 1, self.reused_tokens + start
            else:  # a new prompt, or a history another request overwrote since: from the first token
                start = 0
                self.cache.release(slot)
                adapter.set_rope_delta(self.model, None)  # this prompt's own M-RoPE positions
            if self.routing is not None:
                self.routing.begin(request.inputs["input_ids"], request.max_new_tokens, start=start, slot=slot)
        elif self.routing is not None:
            self.routing.resume_slot_prefill(slot)
        try:
            if first and chunk.end == sequence.prompt_len:  # the whole prompt (or what follows the history) at once
                logits = self.model(**inputs, past_key_values=view, use_cache=True, logits_to_keep=1).logits[:, -1]
            else:
                if first:  # the vision tower and the positions, for every chunk to come
                    self._parts[sequence.id] = (offset, self.text_forward.prefill_parts(
                        lambda: self.model(**inputs, past_key_values=view, use_cache=True, logits_to_keep=1)))
                offset, parts = self._parts[sequence.id]
                hidden = self.text_forward.prefill_chunk(parts, start - offset, chunk.end - offset, view)
                logits = self.lm_head(hidden[:, -1]) if chunk.end == sequence.prompt_len else None
        finally:
            if self.routing is not None:
                self.routing.end_slot_prefill()
        if first:
            delta = adapter.rope_delta(self.model)
            request.rope_delta = int(delta.reshape(-1)[0]) if delta is not None else 0
        if logits is None:
            return None
        self._parts.pop(sequence.id, None)
        return _sample(logits, request.sampling)

    def _prefill_group(self, chunks: tuple[PrefillChunk, ...]) -> dict[int, int]:
        """Fresh whole prompts through the model in one forward, right-padded to the longest, each into
        its own slot: {sequence id: the token it samples}."""
        adapter, model = self.engine.adapter, self.model
        requests = [self.requests[c.sequence.id] for c in chunks]
        slots = [c.sequence.kv_blocks[0] for c in chunks]
        lengths = [c.end for c in chunks]
        if any(c.start or c.end != c.sequence.prompt_len for c in chunks):
            raise SchedulerError("a prefill group takes fresh whole prompts only")
        self.prefill_groups, self.grouped_prompts = self.prefill_groups + 1, self.grouped_prompts + len(chunks)
        for request, slot in zip(requests, slots):
            request.started, request.slot = True, slot
            self.held.pop(slot, None)  # a fresh prompt: whatever the slot held goes
            if self.routing is not None:
                self.routing.begin(request.inputs["input_ids"], request.max_new_tokens, slot=slot)
        inputs = group_inputs([r.inputs for r in requests], pad_id=padding_token(model, adapter),
                              per_token=family_per_token_inputs(adapter))
        view = self.cache.rows_view(slots, lengths)
        adapter.set_rope_delta(model, None)  # the prompts' own M-RoPE positions
        parts = self.text_forward.prefill_parts(lambda: model(**inputs, past_key_values=view, use_cache=True,
                                                              logits_to_keep=1))
        if self.routing is not None:
            self.routing.begin_rows(slots, lengths, max(lengths))
        try:
            hidden = self.text_forward(inputs_embeds=parts["inputs_embeds"], position_ids=parts["position_ids"],
                                       past_key_values=view, use_cache=True,
                                       visual_pos_masks=parts["visual_pos_masks"],
                                       deepstack_visual_embeds=parts["deepstack_visual_embeds"],
                                       **self.text_forward.modality_of(parts)).last_hidden_state
        finally:
            if self.routing is not None:
                self.routing.end_slot_prefill()
        last = torch.tensor(lengths, device=hidden.device) - 1
        logits = self.lm_head(hidden[torch.arange(len(chunks), device=hidden.device), last])   # (B, V)
        delta = adapter.rope_delta(model)
        sampled = {}
        for row, (chunk, request) in enumerate(zip(chunks, requests)):
            request.rope_delta = int(delta.reshape(-1)[row]) if delta is not None else 0
            sampled[chunk.sequence.id] = _sample(logits[row:row + 1], request.sampling)
        return sampled


def generate_batch(model: Any, requests: list[dict[str, torch.Tensor]], max_new_tokens: int | list[int],
                   max_batch: int = 8, sampling: Sampling | list[Sampling] | None = None,
                   min_new_tokens: int = 0, on_step: Callable[[int], None] | None = None,
                   stats: dict | None = None, runner: "BatchRunner | None" = None,
                   prefill_chunk: int | None = None, prefill_budget: int = PREFILL_BUDGET) -> list[torch.Tensor]:
    """Each request's (1, prompt + new) token ids, the requests decoded together (at most `max_batch` at
    once, the rest waiting for a free slot). `on_step(B)` is told each decode step's batch size; `stats`
    gets the batched step's counters (BatchRunner.stats). `runner`: an idle BatchRunner to run them on
    (its slots, and the graphs its earlier steps captured), instead of a new one of `max_batch` slots
    that prefills `prefill_chunk` prompt tokens per step (None: whole prompts, fresh ones together up to
    `prefill_budget` tokens)."""
    budgets = [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    samplings = sampling if isinstance(sampling, list) else [sampling or Sampling()] * len(requests)
    if not len(budgets) == len(samplings) == len(requests):
        raise ValueError(f"{len(requests)} requests, {len(budgets)} token budgets, {len(samplings)} samplings")
    for request, budget in zip(requests, budgets):
        check_context(model, model.vismmoe.adapter, int(request["input_ids"].shape[1]), budget)
    if runner is None:
        capacity = max(r["input_ids"].shape[1] + n for r, n in zip(requests, budgets))
        runner = BatchRunner(model, min(max_batch, len(requests)), capacity, max_queue=len(requests),
                             prefill_chunk=prefill_chunk, prefill_budget=prefill_budget)
    elif not runner.idle:
        raise ValueError("generate_batch needs an idle runner")
    batch = [BatchRequest(r, n, s, min_new_tokens) for r, n, s in zip(requests, budgets, samplings)]
    for request in batch:
        runner.add(request)
    while not runner.idle:
        size, _ = runner.step()
        if size and on_step is not None:
            on_step(size)
    if stats is not None:
        stats.update(runner.stats())
    return [torch.cat([r.inputs["input_ids"], torch.tensor([r.sequence.generated], dtype=r.inputs["input_ids"].dtype,
                                                           device=r.inputs["input_ids"].device)], dim=1)
            for r in batch]


def _sample(logits: torch.Tensor, sampling: Sampling) -> int:
    return int(next_token(logits, sampling.do_sample, sampling.temperature, sampling.top_p))
