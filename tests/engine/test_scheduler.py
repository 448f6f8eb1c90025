"""The continuous-batching scheduler (engine/scheduler.py) as pure bookkeeping: chunked prefill beside
decode, whole prompts prefilled together within a token budget, admission within `max_batch` and the KV blocks, preemption and recompute, cancellation, and
(hypothesis) its invariants over random arrivals, stops and cancels. A fake engine samples token
f(sequence, position), so a sequence's output does not depend on what ran beside it: batched runs must
give every request the tokens it gets alone."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vismmoe_kt.engine.scheduler import BlockPool, Scheduler, SchedulerError, Sequence, Status


def token_for(sequence: Sequence, salt: int = 0) -> int:
    """What the fake model samples next for `sequence`: a function of its id and length only."""
    return (sequence.id * 7919 + sequence.length * 104729 + salt) % 50 + 1


def sampled_by(plan) -> dict[int, int]:
    out = {s.id: token_for(s) for s in plan.decode}
    for chunk in plan.prefills:
        if chunk.end == chunk.sequence.length:
            out[chunk.sequence.id] = token_for(chunk.sequence)
    return out


def run_to_end(scheduler: Scheduler, limit: int = 10_000) -> list:
    plans = []
    while not scheduler.idle:
        plan = scheduler.plan()
        check_plan(scheduler, plan)
        plans.append(plan)
        scheduler.finish_step(plan, sampled_by(plan))
        check_pool(scheduler)
        assert len(plans) < limit, "no progress"
    return plans


def check_plan(scheduler: Scheduler, plan) -> None:
    assert len({id(s) for s in plan.decode}) == len(plan.decode)
    assert all(s.status is Status.RUNNING and s.in_cache for s in plan.decode)
    assert all(len(s.kv_blocks) * scheduler.pool.block_size >= s.length for s in plan.decode)
    for chunk in plan.prefills:
        assert chunk.sequence not in plan.decode and chunk.sequence.status is Status.RUNNING
        assert 0 < chunk.end - chunk.start <= scheduler.prefill_chunk and chunk.start == chunk.sequence.cached
        assert len(chunk.sequence.kv_blocks) * scheduler.pool.block_size >= chunk.end
    assert len({id(c.sequence) for c in plan.prefills}) == len(plan.prefills)
    if len(plan.prefills) > 1:  # a group: whole fresh prompts within the budget
        assert all(c.start == 0 and c.end == c.sequence.length for c in plan.prefills)
        assert sum(c.end for c in plan.prefills) <= scheduler.prefill_budget
    assert len(scheduler.running) <= scheduler.max_batch


def check_pool(scheduler: Scheduler) -> None:
    held = [b for s in scheduler.running for b in s.kv_blocks]
    assert len(held) == len(set(held)) and not set(held) & set(scheduler.pool.free)
    assert len(held) + len(scheduler.pool.free) == scheduler.pool.num_blocks
    assert all(not s.kv_blocks for s in scheduler.waiting)


def alone(prompt_len: int, max_new: int, seq_id: int, stop=frozenset()) -> list[int]:
    """The tokens a request gets when it runs by itself."""
    scheduler = Scheduler(BlockPool(1000, 4), max_batch=1, max_queue=10, prefill_chunk=10**6)
    scheduler._ids = iter([seq_id])
    sequence = scheduler.add(Sequence(prompt_len, max_new, stop))
    run_to_end(scheduler)
    return sequence.generated


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    scheduler = Scheduler(BlockPool(64, 4), max_batch=3, max_queue=8, prefill_chunk=4)
    short = scheduler.add(Sequence(3, 6))
    long = scheduler.add(Sequence(13, 2))
    plans = run_to_end(scheduler)
    long_chunks = [(c.start, c.end) for p in plans for c in p.prefills if c.sequence is long]
    assert long_chunks == [(0, 4), (4, 8), (8, 12), (12, 13)]
    # the short one decodes in the steps that prefill the long one
    assert all(short in p.decode for p in plans if any(c.sequence is long for c in p.prefills))
    assert short.status is long.status is Status.FINISHED and len(short.generated) == 6 and len(long.generated) == 2
    assert short.generated == alone(3, 6, short.id) and long.generated == alone(13, 2, long.id)
    assert len(scheduler.pool.free) == 64


def test_a_sequence_whose_prefix_a_free_block_holds_starts_there_or_from_scratch():
    """preferred_block: the block keeping a conversation's history is taken first, and the prefill
    starts after the `cached` tokens; if another sequence took that block meanwhile, from the start."""
    scheduler = Scheduler(BlockPool(2, 64), max_batch=2, max_queue=4, prefill_chunk=64)
    follow_up = Sequence(40, 4)
    follow_up.preferred_block, follow_up.cached = 1, 30
    scheduler.add(follow_up)
    plan = scheduler.plan()
    assert follow_up.kv_blocks == [1] and [(c.start, c.end) for c in plan.prefills] == [(30, 40)]
    scheduler2 = Scheduler(BlockPool(2, 64), max_batch=2, max_queue=4, prefill_chunk=64)
    squatter, late = Sequence(10, 4), Sequence(40, 4)
    late.preferred_block, late.cached = 0, 30  # block 0 goes to the first sequence admitted
    scheduler2.add(squatter)
    scheduler2.add(late)
    scheduler2.finish_step(scheduler2.plan(), {squatter.id: 1})
    plan = scheduler2.plan()
    assert squatter.kv_blocks == [0] and late.kv_blocks == [1] and [(c.start, c.end) for c in plan.prefills] == [(0, 40)]


def test_no_more_than_max_batch_run_and_the_queue_refuses_beyond_max_queue():
    scheduler = Scheduler(BlockPool(64, 4), max_batch=2, max_queue=3, prefill_chunk=8)
    for _ in range(3):
        scheduler.add(Sequence(4, 3))
    with pytest.raises(SchedulerError, match="queue is full"):
        scheduler.add(Sequence(4, 3))
    plans = run_to_end(scheduler)
    assert max(len(p.decode) + sum(not c.sequence.in_cache for c in p.prefills) for p in plans) <= 2


def test_fresh_prompts_that_arrive_together_are_prefilled_in_one_step_within_the_budget():
    """With a budget, whole fresh prompts join the first one's prefill while they fit it and a free
    slot; a prompt with a history to continue (cached), a solo one, or one past the budget waits for
    the next step, and the queue keeps its order."""
    scheduler = Scheduler(BlockPool(64, 4), max_batch=4, max_queue=8, prefill_chunk=64, prefill_budget=20)
    a, b, c = scheduler.add(Sequence(6, 3)), scheduler.add(Sequence(7, 3)), scheduler.add(Sequence(8, 3))
    plan = scheduler.plan()
    assert [ch.sequence for ch in plan.prefills] == [a, b] and all(ch.start == 0 for ch in plan.prefills)
    scheduler.finish_step(plan, sampled_by(plan))
    assert a.in_cache and b.in_cache and c.status is Status.WAITING
    plan = scheduler.plan()
    assert [ch.sequence for ch in plan.prefills] == [c] and set(plan.decode) == {a, b}
    scheduler.finish_step(plan, sampled_by(plan))
    run_to_end(scheduler)
    assert [s.generated for s in (a, b, c)] == [alone(6, 3, a.id), alone(7, 3, b.id), alone(8, 3, c.id)]

    scheduler = Scheduler(BlockPool(8, 64), max_batch=4, max_queue=8, prefill_chunk=64, prefill_budget=100)
    fresh, solo, later = Sequence(10, 2), Sequence(10, 2), Sequence(10, 2)
    solo.solo_prefill = True
    for sequence in (fresh, solo, later):
        scheduler.add(sequence)
    assert [ch.sequence for ch in scheduler.plan().prefills] == [fresh]  # the solo one stops the group
    no_budget = Scheduler(BlockPool(8, 64), max_batch=4, max_queue=8, prefill_chunk=64)
    for _ in range(3):
        no_budget.add(Sequence(10, 2))
    assert len(no_budget.plan().prefills) == 1  # budget 0: one sequence at a time, as before


def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_recomputed():
    # 6 blocks of 2 tokens: each request needs 5 at its end, so two cannot finish side by side
    scheduler = Scheduler(BlockPool(6, 2), max_batch=2, max_queue=4, prefill_chunk=4)
    first, second = scheduler.add(Sequence(4, 6)), scheduler.add(Sequence(4, 6))
    run_to_end(scheduler)
    assert second.preemptions >= 1 and first.preemptions == 0
    assert first.generated == alone(4, 6, first.id) and second.generated == alone(4, 6, second.id)


def test_a_cancelled_sequence_frees_its_blocks_at_the_next_step_and_the_others_are_unchanged():
    scheduler = Scheduler(BlockPool(32, 4), max_batch=3, max_queue=4, prefill_chunk=8)
    kept, gone, queued = scheduler.add(Sequence(5, 8)), scheduler.add(Sequence(6, 8)), Sequence(3, 2)
    for _ in range(4):
        plan = scheduler.plan()
        scheduler.finish_step(plan, sampled_by(plan))
    assert gone.status is Status.RUNNING and gone.kv_blocks
    scheduler.cancel(gone)
    scheduler.add(queued)
    scheduler.cancel(queued)  # cancelled while still waiting
    plan = scheduler.plan()
    assert gone.status is Status.CANCELLED and not gone.kv_blocks and gone not in plan.decode
    assert queued.status is Status.CANCELLED and queued not in scheduler.waiting
    scheduler.finish_step(plan, sampled_by(plan))
    run_to_end(scheduler)
    assert kept.generated == alone(5, 8, kept.id) and len(scheduler.pool.free) == 32


def test_a_stop_token_ends_a_sequence_early():
    stop = frozenset({token_for(Sequence(4, 1, id=0, generated=[0] * 2))})  # what sequence 0 samples third
    scheduler = Scheduler(BlockPool(32, 4), max_batch=1, max_queue=1, prefill_chunk=8)
    sequence = scheduler.add(Sequence(4, 10, stop))
    run_to_end(scheduler)
    assert sequence.status is Status.FINISHED and len(sequence.generated) == 3 and sequence.generated[-1] in stop


def test_requests_that_could_never_run_are_refused_when_added():
    scheduler = Scheduler(BlockPool(4, 4), max_batch=2, max_queue=4, prefill_chunk=8)
    with pytest.raises(SchedulerError, match="needs 5 KV blocks of 4 tokens; there are 4 in all"):
        scheduler.add(Sequence(12, 5))
    with pytest.raises(SchedulerError, match="at least one new token"):
        scheduler.add(Sequence(3, 0))
    with pytest.raises(SchedulerError, match="max_batch"):
        Scheduler(BlockPool(4, 4), max_batch=0, max_queue=4, prefill_chunk=8)
    with pytest.raises(SchedulerError, match="at least one block"):
        BlockPool(0, 4)
    with pytest.raises(SchedulerError, match="lacks a token for sequence"):
        scheduler.add(Sequence(3, 2))
        scheduler.finish_step(scheduler.plan(), {})


requests = st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6), st.booleans()),
                    min_size=1, max_size=12)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(requests, st.integers(1, 4), st.integers(1, 3), st.integers(8, 40), st.integers(1, 9), st.integers(0, 40))
def test_invariants_hold_and_every_request_ends_as_it_would_alone(arrivals, max_batch, block_size, blocks, chunk,
                                                                   budget):
    """Random arrivals (prompt, budget, step it arrives at, cancelled later or not): the pool is never
    over-committed, at most max_batch run, plans are well-formed, nothing is lost, and every request
    that is not cancelled gets exactly the tokens it gets alone, whether its prompt was prefilled alone,
    in chunks or beside others."""
    scheduler = Scheduler(BlockPool(blocks, block_size), max_batch=max_batch, max_queue=100, prefill_chunk=chunk,
                          prefill_budget=budget)
    pending = sorted(arrivals, key=lambda a: a[2])
    added, step = [], 0
    while pending or not scheduler.idle:
        while pending and pending[0][2] <= step:
            prompt, budget, _, cancel = pending.pop(0)
            try:
                added.append((scheduler.add(Sequence(prompt, budget)), cancel))
            except SchedulerError:  # beyond the whole pool: refused, never queued
                assert block_size * blocks < prompt + budget
        for sequence, cancel in added:
            if cancel and step % 5 == 4 and not sequence.done:
                scheduler.cancel(sequence)
        plan = scheduler.plan()
        check_plan(scheduler, plan)
        scheduler.finish_step(plan, sampled_by(plan))
        check_pool(scheduler)
        step += 1
        assert step < 5000, "no progress"
    for sequence, cancel in added:
        assert sequence.done and not sequence.kv_blocks
        if sequence.status is Status.FINISHED:
            assert sequence.generated == alone(sequence.prompt_len, sequence.max_new_tokens, sequence.id)
        else:
            assert cancel
    assert len(scheduler.pool.free) == blocks
