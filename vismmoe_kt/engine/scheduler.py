"""Scheduler: which sequences a batched step runs, and the KV memory each one holds (continuous batching).

Requests wait in a queue (at most `max_queue`); up to `max_batch` run at once. Each step is a plan:
one decode token for every running sequence whose prompt is in the cache, and prefill work: either
one chunk of `prefill_chunk` prompt tokens of one sequence (a long image prompt is prefilled over
several steps, so the running streams keep decoding meanwhile), or several whole fresh prompts that
together fit `prefill_budget` tokens (requests that arrive together are prefilled in one forward, as
vLLM schedules them, so their images share one vision-tower call and no running stream waits for one
newcomer's prefill after another's). Sequences join when there is room and leave when they finish or
are cancelled, always between steps.

KV memory is counted in blocks of `block_size` tokens (`BlockPool`): a sequence holds enough blocks
for every token in the cache, taken as it grows. When a decode token finds no free block, the most
recently admitted running sequence is preempted: its blocks are freed and it goes back to the front
of the queue, to be prefilled again from its prompt and the tokens it has generated (as vLLM and
nano-vllm do). A request that could never fit (its prompt and its token budget beyond the whole
pool) is refused when it is added, never left waiting.

Pure bookkeeping: no tensors, no model. The engine runs a plan and reports the tokens it sampled
(`finish_step`); what the cache holds where is the engine's (a block table per sequence).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from ..errors import VismmoeError


class SchedulerError(VismmoeError, ValueError):
    """A request the scheduler cannot take (a full queue, or more tokens than the whole KV memory)."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(eq=False)  # compared by identity: two requests with the same prompt are two sequences
class Sequence:
    """One request: its prompt and what it has generated so far."""
    prompt_len: int
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    id: int = -1
    generated: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    cached: int = 0                                   # tokens whose KV is in the cache
    kv_blocks: list[int] = field(default_factory=list)   # the KV blocks it holds, in token order
    cancel_requested: bool = False
    stop_requested: bool = False  # the caller ends it after its latest token (finished, not cancelled)
    preemptions: int = 0
    preferred_block: int | None = None  # a free block holding the first `cached` tokens already (a chat's history)
    solo_prefill: bool = False  # its prompt prefills in a forward of its own (the engine cannot group it)

    @property
    def length(self) -> int:
        """Tokens in the sequence: the prompt and every generated token."""
        return self.prompt_len + len(self.generated)

    @property
    def in_cache(self) -> bool:
        """Whether everything but the last sampled token is cached: the next step decodes that one."""
        return bool(self.generated) and self.cached == self.length - 1

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED)


@dataclass(frozen=True)
class PrefillChunk:
    sequence: Sequence
    start: int  # the first token of the chunk (the prompt's, or after a preemption the generated ones too)
    end: int    # one past the last; the chunk that reaches the sequence's length samples its next token


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[Sequence, ...]       # one token each
    prefills: tuple[PrefillChunk, ...]  # one chunk, or several whole fresh prompts run as one forward

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefills


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens each: a free list, and who holds what."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise SchedulerError(f"a KV pool needs at least one block of one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, sequence: Sequence, tokens: int) -> bool:
        """Give `sequence` blocks for `tokens` tokens in all; False (and nothing taken) if too few are free."""
        missing = self.blocks_for(tokens) - len(sequence.kv_blocks)
        if missing > len(self.free):
            return False
        if missing > 0 and not sequence.kv_blocks and sequence.preferred_block in self.free:
            self.free.remove(sequence.preferred_block)  # the block that holds its prefix comes first
            sequence.kv_blocks.append(sequence.preferred_block)
            missing -= 1
        sequence.kv_blocks.extend(self.free.popleft() for _ in range(max(missing, 0)))
        return True

    def release(self, sequence: Sequence) -> None:
        self.free.extend(sequence.kv_blocks)
        sequence.kv_blocks = []
        sequence.cached = 0


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch: int, max_queue: int, prefill_chunk: int,
                 prefill_budget: int = 0):
        """`prefill_budget`: prompt tokens a step may prefill in whole fresh prompts together (0: one
        sequence's chunk per step)."""
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1 or prefill_budget < 0:
            raise SchedulerError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be at least 1, "
                                 f"max_queue ({max_queue}) and prefill_budget ({prefill_budget}) at least 0")
        self.pool, self.max_batch, self.max_queue, self.prefill_chunk = pool, max_batch, max_queue, prefill_chunk
        self.prefill_budget = prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self._ids = itertools.count()

    # --- requests ------------------------------------------------------------------------------
    def add(self, sequence: Sequence) -> Sequence:
        """Queue a request; SchedulerError if the queue is full or it could never fit the KV memory."""
        if sequence.prompt_len < 1 or sequence.max_new_tokens < 1:
            raise SchedulerError(f"a request needs a prompt and at least one new token, got {sequence.prompt_len} "
                                 f"prompt tokens and max_new_tokens {sequence.max_new_tokens}")
        if len(self.waiting) >= self.max_queue:
            raise SchedulerError(f"the queue is full ({self.max_queue} requests waiting): try again later")
        needed = self.pool.blocks_for(sequence.prompt_len + sequence.max_new_tokens)
        if needed > self.pool.num_blocks:
            raise SchedulerError(f"a request of {sequence.prompt_len} prompt tokens and {sequence.max_new_tokens} new "
                                 f"ones needs {needed} KV blocks of {self.pool.block_size} tokens; there are "
                                 f"{self.pool.num_blocks} in all")
        sequence.id = next(self._ids)
        self.waiting.append(sequence)
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """The client is gone: the sequence leaves at the next step boundary and its blocks are freed."""
        sequence.cancel_requested = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- steps ---------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The next step: decode every running sequence that is in the cache, and prefill one chunk (or
        several whole prompts)."""
        self._drop_cancelled()
        decode: list[Sequence] = []
        for sequence in list(self.running):
            if sequence.status is not Status.RUNNING or not sequence.in_cache:
                continue  # preempted by an earlier one this step, or still prefilling
            while not self.pool.grow(sequence, sequence.length):  # the token it decodes needs a slot
                victim = self._preempt(exclude=sequence)
                if victim is None:  # cannot happen: a lone sequence fits the pool (`add` checks)
                    break
                if victim in decode:
                    decode.remove(victim)
            else:
                decode.append(sequence)
        return StepPlan(tuple(decode), self._prefills())

    def finish_step(self, plan: StepPlan, sampled: dict[int, int]) -> list[Sequence]:
        """Record a run plan: `sampled` maps sequence id -> the token sampled for it (every decoded one,
        and the prefilled one whose chunk reached its end). Returns the sequences that finished."""
        finished = []
        for sequence in plan.decode:
            sequence.cached = sequence.length  # the decoded token's KV went in
        stepped = list(plan.decode)
        for chunk in plan.prefills:
            chunk.sequence.cached = chunk.end
            if chunk.end == chunk.sequence.length:  # the prompt's last chunk: a token is sampled
                stepped.append(chunk.sequence)
        for sequence in stepped:
            if sequence.id not in sampled:
                raise SchedulerError(f"step result lacks a token for sequence {sequence.id}")
            token = sampled[sequence.id]
            sequence.generated.append(token)
            if token in sequence.stop_token_ids or len(sequence.generated) >= sequence.max_new_tokens \
                    or sequence.stop_requested:
                self._leave(sequence, Status.FINISHED)
                finished.append(sequence)
        return finished

    # --- internals -----------------------------------------------------------------------------
    def _prefills(self) -> tuple[PrefillChunk, ...]:
        """The step's prefill work: `_prefill_chunk`'s, and when that is a whole fresh prompt, the waiting
        fresh prompts behind it that fit the budget and a free slot, whole."""
        first = self._prefill_chunk()
        if first is None:
            return ()
        chunks = [first]
        if not self._groupable(first.sequence) or first.start or first.end != first.sequence.length:
            return tuple(chunks)
        budget = self.prefill_budget - first.sequence.length
        while self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
            if not self._groupable(sequence) or sequence.length > budget or not self.pool.grow(sequence, sequence.length):
                break  # the queue's order holds: what cannot join now goes first next step
            self.waiting.popleft()
            sequence.status, sequence.cached = Status.RUNNING, 0
            self.running.append(sequence)
            chunks.append(PrefillChunk(sequence, 0, sequence.length))
            budget -= sequence.length
        return tuple(chunks)

    def _groupable(self, sequence: Sequence) -> bool:
        """A prompt that may share a prefill forward: fresh (no history to continue), not marked solo,
        short enough for the budget and one chunk."""
        return not sequence.solo_prefill and not sequence.cached and not sequence.preemptions \
            and sequence.length <= min(self.prefill_budget, self.prefill_chunk)

    def _prefill_chunk(self) -> PrefillChunk | None:
        """Continue a running sequence's prefill, else admit the first waiting one if there is room."""
        sequence = next((s for s in self.running if not s.in_cache), None)
        if sequence is None and self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
        if sequence is None:
            return None
        if sequence.status is Status.WAITING and sequence.cached and sequence.preferred_block not in self.pool.free:
            sequence.cached = 0  # the block holding its prefix went to another sequence: prefill from the start
        # up to the sequence's end (after a preemption its generated tokens too): the last chunk samples the next
        end = min(sequence.cached + self.prefill_chunk, sequence.length)
        if not self.pool.grow(sequence, end):
            return None  # the running ones free blocks as they finish; admission waits for them
        if sequence.status is Status.WAITING:
            self.waiting.popleft()
            sequence.status = Status.RUNNING
            self.running.append(sequence)
        return PrefillChunk(sequence, sequence.cached, end)

    def _preempt(self, exclude: Sequence) -> Sequence | None:
        """Free the most recently admitted running sequence (not `exclude`): back to the queue's front."""
        victim = next((s for s in reversed(self.running) if s is not exclude), None)
        if victim is None:
            return None
        self.running.remove(victim)
        self.pool.release(victim)
        victim.status = Status.WAITING
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self.running if s.cancel_requested]:
            self._leave(sequence, Status.CANCELLED)
        for sequence in [s for s in self.waiting if s.cancel_requested]:
            self.waiting.remove(sequence)
            sequence.status = Status.CANCELLED

    def _leave(self, sequence: Sequence, status: Status) -> None:
        self.running.remove(sequence)
        self.pool.release(sequence)
        sequence.status = status
