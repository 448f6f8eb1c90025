"""The model runner: the KV slots, the decode step and its graphs, the scheduler, and every prefill.

Shapes: B sequences in a step, V vocabulary, C a slot's capacity.

A `ModelRunner` is the open loop every generation runs through, one request (chat, eval, the
benchmarks: `generation.generate`) or many (the server, `generate_batch`): `add` requests at any time,
`step` runs the scheduler's next plan (scheduler.py), `cancel` drops one at the next step. A new
request's prompt runs through the model once (vision tower, M-RoPE positions, pruning) into its own
slot of a SlotKVCache (slot_cache.py), and every running sequence then gets one token per DecodeStep
(decode_step.py), all rows in one forward: one router call and one expert call per MoE layer for the
whole batch, so an expert that several rows route to is fetched once per step. A single request is a
step of one row, through the same step and the same CUDA graphs. Requests join when a slot is free and
leave when they finish, between steps. Greedy rows give the tokens the request gets alone, whatever ran
beside it. Where every row is greedy, the next step is launched from the device's argmax before the
host reads this one's tokens, and taken back if a row stops (steps_ahead.py).

Prompts are prefilled whole, or `prefill_chunk` tokens per step; fresh whole prompts waiting together (up
to `prefill_budget` tokens) run as one right-padded forward, their images through one vision-tower call
(prefill_group.py), so a burst of requests costs one prefill's fixed cost and the running streams wait
once, not once per newcomer. A finished request's slot keeps its KV until another request needs it: a
conversation's next turn, which re-sends the history, goes to that slot and prefills only what follows
(prompt_history.py). Each sequence gets a slot of the runner's capacity, so nothing is preempted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.model_pass import HostPrompt, ModelPass, PrefillRow
from .decoding import Decoding, decode_engine
from .host_prompt import host_prompt
from .prefill_group import family_per_token_inputs, group_inputs, groupable, padding_token
from .prompt_history import ImageKeys, SlotHistory, image_keys, may_continue, reusable_prefix
from .sampling import Sampling, continuation, eos_ids, sample
from .scheduler import BlockPool, PrefillChunk, Scheduler, SchedulerError, Sequence, Status, StepPlan
from .slot_cache import SlotKVCache
from .steps_ahead import LaunchedStep, TokenReads

PREFILL_BUDGET = 8192  # prompt tokens prefilled together in one step (vLLM's default max_num_batched_tokens)
REQUEST_KEYS = itertools.count()


@dataclass(eq=False)
class BatchRequest:
    """One request of a ModelRunner: its processed inputs (batch 1), how many tokens, how sampled, and who
    hears of each sampled id (`on_token`, called on the runner's thread; a true answer ends the request
    there, as a stop string does)."""
    inputs: dict[str, torch.Tensor]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    min_new_tokens: int = 0  # end-of-sequence tokens do not stop it before this many (benchmarks)
    on_token: Callable[[int], bool | None] | None = None
    sequence: Sequence | None = None
    rope_delta: int = 0
    started: bool = False     # its first prefill chunk ran
    slot: int | None = None   # the KV slot it ran in
    history: SlotHistory | None = None  # the slot's held history it was matched with when added (ModelRunner.held)
    key: int = field(default_factory=lambda: next(REQUEST_KEYS))  # unique across runners (ModelPass rows)
    pruned: list[int] = field(default_factory=list)  # prompt positions pruning left out of layers >= pruned_from
    pruned_from: int | None = None


class ModelRunner:
    """The open loop of generation: `add` requests at any time, `step` runs the scheduler's next
    plan (a prefill chunk and a decode token for every running sequence), `cancel` drops one at the next
    step. Slots hold `capacity` tokens each (prompt and new tokens); `max_batch` of them run at once.
    `prefill_chunk` tokens of a prompt go through the model per step (None: whole prompts), so a long
    image prompt does not stall the running streams for its whole prefill; the vision tower still runs
    on the prompt's images at once, in its first chunk. Rules that prune visual tokens prefill whole
    (pruning needs the whole prompt in one forward). With whole prompts, fresh ones that wait together
    are prefilled in one forward up to `prefill_budget` tokens (0: one at a time)."""

    def __init__(self, model: Any, max_batch: int, capacity: int, max_queue: int, prefill_chunk: int | None = None,
                 prefill_budget: int = PREFILL_BUDGET, engine: Decoding | None = None):
        engine = engine or decode_engine(model)
        if engine is None:
            raise ValueError("the model runner runs on the lean decode path: the rules need a VisDecoder "
                             "(e.g. optimize_rules/qwen3vl.yaml) and decode: lean")
        self.model, self.engine, self.capacity = model, engine, capacity
        adapter, text = engine.adapter, engine.text
        config, weight = text.config, adapter.token_embedding(text).weight
        heads, key_dim, value_dim = adapter.kv_cache_shape(config)
        self.cache = SlotKVCache(len(adapter.layers_of(text)), max_batch, heads, key_dim, capacity, weight.dtype,
                                 weight.device, value_dim)
        self.lm_head = engine.output_head
        self.step_fn = engine.make_step(self.cache)
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
        self.eos = frozenset(eos_ids(model))
        self.device = weight.device
        self.requests: dict[int, BatchRequest] = {}
        # what each free slot still holds from the request that finished there (a chat's next turn re-sends
        # it and prefills only what follows)
        self.held: dict[int, SlotHistory] = {}
        self.reuses = self.reused_tokens = 0
        self._deltas: tuple[tuple[int, ...], torch.Tensor] | None = None  # the decode rows' M-RoPE deltas
        # greedy steps launched one ahead of the host's read (steps_ahead.py); False: each step waits for the last
        self.chain_steps = True
        self.token_reads = TokenReads(max_batch, weight.device)
        self._ahead: LaunchedStep | None = None  # the step queued for the next plan's rows
        self.steps_ahead = self.steps_retracted = 0

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def stats(self) -> dict[str, Any]:
        """The step's counters (DecodeStep.stats, with the (rows, span) shapes it captured), and the
        prefill chunk in use (None: whole prompts)."""
        return {**self.step_fn.stats(), "prefill_chunk": self.prefill_chunk, "prefill_pieces": self.prefill_pieces,
                "prefill_pieces_beside_decode": self.pieces_beside_decode, "prefill_groups": self.prefill_groups,
                "grouped_prompts": self.grouped_prompts, "reused_prefixes": self.reuses,
                "reused_tokens": self.reused_tokens, "steps_ahead": self.steps_ahead,
                "steps_retracted": self.steps_retracted}

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
        Not without the text model's own forward (a continuation runs through it); under visual-token
        pruning only a continuation without new images (pruning picks among all visual tokens at once)."""
        if not self.held or self.text_forward is None or "pixel_values_videos" in request.inputs:
            return None, 0
        new_images_ok = not self.engine.context.pruning.active
        adapter, config = self.engine.adapter, self.model.config
        ids, images = request.inputs["input_ids"][0].tolist(), ImageKeys(request.inputs)
        image_token = adapter.image_token_id(config)
        best = (None, 0)
        for slot, held in self.held.items():
            if not may_continue(held.ids, ids, image_token):
                continue  # decided by the tokens alone: no image is hashed
            common = reusable_prefix(held.ids, held.images.get(), ids, images.get(), image_token,
                                     1 / adapter.vision_merge_size(config) ** 2, new_images_ok)
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
        if self._ahead is not None and (plan.prefills or self._ahead.ids != tuple(
                s.id for s in sorted(plan.decode, key=lambda s: s.kv_blocks[0]))):
            self._retract_ahead()  # the plan changed (a prompt to prefill, a cancel) before any prefill runs
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
            step = self._ahead if self._ahead is not None else self._launch(decode, requests)
            self._ahead = self._launch(decode, requests, step.tokens) if self._may_chain(plan, decode, requests) \
                else None
            greedy = step.greedy()  # one device read for every greedy row (the step ahead stays queued)
            for row, (sequence, request) in enumerate(zip(decode, requests)):
                sampled[sequence.id] = sample(step.logits[row:row + 1], request.sampling) \
                    if request.sampling.do_sample else greedy[row]
        for sequence_id, token in sampled.items():
            request = self.requests[sequence_id]
            if request.min_new_tokens and len(request.sequence.generated) + 1 >= request.min_new_tokens:
                request.sequence.stop_token_ids = self.eos  # end-of-sequence may stop it from now on
            if request.on_token is not None and request.on_token(token):
                request.sequence.stop_requested = True  # the caller's stop: this token is its last
        self.scheduler.finish_step(plan, sampled)
        if self._ahead is not None and any(self.requests[i].sequence.done for i in self._ahead.ids):
            self._retract_ahead()  # a row stopped: the step launched ahead was a step too many
        ended = [r for r in self.requests.values() if r.sequence.done]
        for request in ended:
            del self.requests[request.sequence.id]
            self._parts.pop(request.sequence.id, None)
            self._keep_history(request)
        return len(plan.decode), ended

    def _launch(self, decode: list[Sequence], requests: list[BatchRequest],
                tokens: torch.Tensor | None = None) -> LaunchedStep:
        """The decode step of these rows queued on the device, from `tokens` on the device (a step launched
        ahead) or else each sequence's last token from the host (one copy into the step's buffer)."""
        if tokens is None:
            tokens = torch.tensor([s.generated[-1] for s in decode])
        else:
            self.steps_ahead += 1
        slots = [s.kv_blocks[0] for s in decode]
        logits = self.step_fn(slots, tokens, self._rope_deltas(decode, requests))
        return self.token_reads.launched(tuple(s.id for s in decode), slots, logits)

    def _may_chain(self, plan: StepPlan, decode: list[Sequence], requests: list[BatchRequest]) -> bool:
        """Whether to launch the next step before reading this one (steps_ahead.py): every row greedy and
        due another token after this one, nothing to prefill next, and a step the engine can chain."""
        scheduler = self.scheduler
        return self.chain_steps and not plan.prefills and not (scheduler.waiting and scheduler.pool.free) \
            and all(not r.sampling.do_sample for r in requests) \
            and all(len(s.generated) + 1 < s.max_new_tokens and not s.cancel_requested for s in decode) \
            and self.step_fn.chainable(len(decode))

    def _retract_ahead(self) -> None:
        self.cache.retract(self._ahead.slots)
        self._ahead = None
        self.steps_retracted += 1

    def _rope_deltas(self, decode: list[Sequence], requests: list[BatchRequest]) -> torch.Tensor:
        """The decode rows' M-RoPE deltas on the device, made again only when the rows change."""
        key = tuple(s.id for s in decode)
        if self._deltas is None or self._deltas[0] != key:
            self._deltas = key, torch.tensor([r.rope_delta for r in requests], device=self.device)
        return self._deltas[1]

    def _keep_history(self, request: BatchRequest) -> None:
        """A finished request's slot keeps its KV for the conversation's next turn: the prompt and every
        generated token but the last (which no step consumed)."""
        sequence = request.sequence
        if sequence.status is not Status.FINISHED or not request.started:
            return  # cancelled, or never prefilled
        slot = request.slot
        ids = request.inputs["input_ids"][0].tolist() + sequence.generated[:-1]
        history = SlotHistory(ids, ImageKeys(request.inputs), request.rope_delta, request.pruned, request.pruned_from)
        if [lengths[slot] for lengths in self.cache.host_lengths] == history.layer_lengths(len(ids), self.cache.num_layers):
            self.held[slot] = history

    def _row(self, request: BatchRequest, start: int, length: int, host: HostPrompt | None = None) -> PrefillRow:
        return PrefillRow(request.key, request.slot, start, length, request.inputs["input_ids"], request.max_new_tokens,
                          host)

    def _announce(self, rows: tuple[PrefillRow, ...] | None, width: int = 0,
                  modality: torch.Tensor | None = None) -> None:
        """What the prefill forward about to run computes (None: it ended), for operators keyed by position; each
        expert runtime hears of a prompt before its vision tower runs (its copies may start now), with the tokens
        its routers will see, padding included. `modality`: the forward's tokens' modality where the family splits
        its experts by it (`adapter.modality_argument()`: ERNIE-4.5-VL): tokens of a nonzero one reach the second
        expert set's runtime (its vision experts), the rest the primary one's. Why: the primary (text) runtime
        decides whether to stream a layer by how many tokens its routers see; counted with the picture's, a
        prompt of a few text tokens streamed a whole layer of text experts that its routers then barely used. The
        count is read back from the device: such a family's forward reads its modality ids back anyway (its
        layers split the tokens between the sets by boolean masks)."""
        context = self.engine.context
        context.model_pass = None if rows is None else ModelPass(rows, width, cache=self.cache)
        if not rows:
            return
        tokens = width * len(rows) if width else sum(row.length for row in rows)
        second = 0 if modality is None else int(torch.count_nonzero(modality))
        if context.offload_runtime is not None:
            context.offload_runtime.begin_prompt(tokens - second)
        if second:  # without such tokens none of the second set's layers run
            for runtime in context.expert_set_runtimes.values():
                runtime.begin_prompt(second)

    def _modality(self, inputs: dict[str, torch.Tensor], start: int = 0, end: int | None = None) -> torch.Tensor | None:
        """Positions [start, end) of the forward's modality row(s) (`_announce`), None where the family has none."""
        name = self.engine.adapter.modality_argument()
        return inputs[name][:, start:end] if name and name in inputs else None

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
                self.cache.keep(slot, held.layer_lengths(start, self.cache.num_layers))
                request.pruned = [p for p in held.pruned if p < start]
                request.pruned_from = held.pruned_from if request.pruned else None
                adapter.set_rope_delta(self.model, torch.tensor([[held.rope_delta]], device=self.device))
                inputs = continuation(self.model, adapter, request.inputs, start, image_keys(request.inputs),
                                      held.images.count())
                offset = start
                self.reuses, self.reused_tokens = self.reuses + 1, self.reused_tokens + start
            else:  # a new prompt, or a history another request overwrote since: from the first token
                start = 0
                self.cache.release(slot)
                adapter.set_rope_delta(self.model, None)  # this prompt's own M-RoPE positions
        whole = first and chunk.end == sequence.prompt_len  # the whole prompt (or what follows the history) at once
        # a fresh picture prompt's facts read on the host first, so that its forward never waits for the device
        host = host_prompt(self.model, adapter, inputs) if whole and not start and self.text_forward is not None \
            else None
        if host is not None:  # the decode steps' offset, as the model's forward would have kept it
            adapter.set_rope_delta(self.model, torch.tensor([[host.rope_delta]], device=self.device))
        self._announce((self._row(request, start, chunk.end - start, host),),
                       modality=self._modality(request.inputs, start, chunk.end))
        try:
            if whole:
                pruning = self.engine.context.pruning
                pruned_before = pruning.pruned_prefills
                if host is not None:
                    logits = self._forward_from_host(inputs, host, view)
                else:
                    logits = self.model(**inputs, past_key_values=view, use_cache=True, logits_to_keep=1).logits[:, -1]
                if pruning.pruned_prefills > pruned_before:  # positions of the prompt its later layers left out
                    kept = set(pruning.keep.tolist())
                    request.pruned = [p for p in range(sequence.prompt_len) if p not in kept]
                    request.pruned_from = pruning.prune_at
            else:
                if first:  # the vision tower and the positions, for every chunk to come
                    self._parts[sequence.id] = (offset, self.text_forward.prefill_parts(
                        lambda: self.model(**inputs, past_key_values=view, use_cache=True, logits_to_keep=1)))
                offset, parts = self._parts[sequence.id]
                hidden = self.text_forward.prefill_chunk(parts, start - offset, chunk.end - offset, view)
                logits = self.lm_head(hidden[:, -1]) if chunk.end == sequence.prompt_len else None
        finally:
            self._announce(None)
        if host is not None:
            request.rope_delta = host.rope_delta
        elif first:
            delta = adapter.rope_delta(self.model)
            request.rope_delta = int(delta.reshape(-1)[0]) if delta is not None else 0
        if logits is None:
            return None
        self._parts.pop(sequence.id, None)
        return sample(logits, request.sampling)

    def _forward_from_host(self, inputs: dict[str, torch.Tensor], host: HostPrompt, view: Any) -> torch.Tensor:
        """A whole picture prompt through the model from its host facts (host_prompt.py): the family's text model
        inputs, then our text model's forward and the output head on the last position, as the model's forward
        with `logits_to_keep=1` (no device read on the way)."""
        parts = self.engine.adapter.prompt_inputs(self.model, inputs, host.visual_rows, host.visual_tokens)
        hidden = self.text_forward(**parts, position_ids=host.position_ids, past_key_values=view,
                                   use_cache=True).last_hidden_state
        return self.lm_head(hidden[:, -1])

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
        inputs = group_inputs([r.inputs for r in requests], pad_id=padding_token(model, adapter),
                              per_token=family_per_token_inputs(adapter))
        view = self.cache.rows_view(slots, lengths)
        adapter.set_rope_delta(model, None)  # the prompts' own M-RoPE positions
        # before the vision tower (prefill_parts runs it, the text model not): the expert runtime may start copying
        self._announce(tuple(self._row(r, 0, n) for r, n in zip(requests, lengths)), width=max(lengths),
                       modality=self._modality(inputs))
        try:
            parts = self.text_forward.prefill_parts(lambda: model(**inputs, past_key_values=view, use_cache=True,
                                                                  logits_to_keep=1))
            hidden = self.text_forward(inputs_embeds=parts["inputs_embeds"], position_ids=parts["position_ids"],
                                       past_key_values=view, use_cache=True,
                                       visual_pos_masks=parts["visual_pos_masks"],
                                       deepstack_visual_embeds=parts["deepstack_visual_embeds"],
                                       **self.text_forward.modality_of(parts)).last_hidden_state
        finally:
            self._announce(None)
        last = torch.tensor(lengths, device=hidden.device) - 1
        logits = self.lm_head(hidden[torch.arange(len(chunks), device=hidden.device), last])   # (B, V)
        delta = adapter.rope_delta(model)
        sampled = {}
        for row, (chunk, request) in enumerate(zip(chunks, requests)):
            request.rope_delta = int(delta.reshape(-1)[row]) if delta is not None else 0
            sampled[chunk.sequence.id] = sample(logits[row:row + 1], request.sampling)
        return sampled


