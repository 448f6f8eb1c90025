"""Greedy decode steps launched one ahead of the host's read (engine/steps_ahead.py): every request gets
the tokens of steps that wait for the last one, a step launched ahead is taken back when a row stops,
is cancelled or the plan changes, and a finished request's slot still keeps its history."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.engine.inputs import build_inputs, user_turn
from vismmoe_kt.engine.runner import BatchRequest, ModelRunner
from vismmoe_kt.engine.sampling import Sampling

from conftest import layer_bytes, make_image, tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir, _, _ = tiny_case(tmp_path_factory, "tiny-4x16", 1, "Describe the image.", (160, 128), 2)
    return model_dir


def loaded(case, layers=4, graphs="replay"):
    """Every expert resident (4 of 4 layers pinned): steps that chain; 2: offloaded layers, whose table
    upkeep reads each step before the next."""
    return load(case, "optimize_rules/qwen3vl-offload.yaml", expert_budget=int(layer_bytes(SPECS["tiny-4x16"]) * layers),
                graphs=graphs, **CPU)


def prompts(processor):
    return [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(160, 128, seed=1)]),
            build_inputs(processor, [user_turn("Hello there", 0)], []),
            build_inputs(processor, [user_turn("Two shapes?", 1)], [make_image(128, 128, seed=3)])]


def run(model, inputs, budgets, chain, max_batch=3, late=None, stop_at=None, cancel=None, sampling=None):
    """Each request's generated tokens and the runner. `late` (step, index): request `index` is added
    after that many steps; `stop_at` {index: n}: its caller stops it at its n-th token; `cancel` (step,
    index): cancelled after that many steps."""
    runner = ModelRunner(model, max_batch=max_batch, capacity=512, max_queue=8)
    runner.chain_steps = chain
    requests = []
    for i, (request, n) in enumerate(zip(inputs, budgets)):
        stop = (lambda token, i=i: len(requests[i].sequence.generated) + 1 >= stop_at[i]) \
            if stop_at and i in stop_at else None
        requests.append(BatchRequest(dict(request), n, sampling or Sampling(), min_new_tokens=n, on_token=stop))
    for i, request in enumerate(requests):
        if late is None or i != late[1]:
            runner.add(request)
    steps = 0
    with torch.no_grad():
        while not runner.idle or (late is not None and requests[late[1]].sequence is None):
            runner.step()
            steps += 1
            if late is not None and steps == late[0]:
                runner.add(requests[late[1]])
            if cancel is not None and steps == cancel[0]:
                runner.cancel(requests[cancel[1]])
    return [r.sequence.generated for r in requests], runner


@pytest.mark.parametrize("graphs", ["off", "replay"])
def test_steps_launched_ahead_give_the_tokens_of_steps_that_wait(case, graphs):
    model, processor = loaded(case, graphs=graphs)
    inputs = prompts(processor)
    for chosen, budgets in (([inputs[0]], [12]), (inputs, [12, 5, 9])):
        want, _ = run(model, chosen, budgets, chain=False)
        got, runner = run(model, chosen, budgets, chain=True)
        assert got == want
        stats = runner.stats()
        # every decode step but the first after each prefill ran ahead; a request's last token launches none
        assert stats["steps_ahead"] >= max(budgets) - 1 - len(budgets) * 2
        assert stats["steps_retracted"] <= len(budgets)


def test_a_newcomer_takes_the_step_ahead_back_and_every_row_keeps_its_tokens(case):
    model, processor = loaded(case)
    inputs = prompts(processor)
    want, _ = run(model, inputs, [10, 10, 6], chain=False, late=(4, 2))
    got, runner = run(model, inputs, [10, 10, 6], chain=True, late=(4, 2))
    assert got == want
    assert runner.stats()["steps_retracted"] >= 1  # the plan changed under the step launched ahead
    assert runner.stats()["steps_ahead"] > 0


def test_a_callers_stop_takes_the_step_ahead_back_and_the_slot_keeps_the_history(case):
    model, processor = loaded(case)
    inputs = prompts(processor)[:1]
    want, _ = run(model, inputs, [12], chain=False, stop_at={0: 5})
    got, runner = run(model, inputs, [12], chain=True, stop_at={0: 5})
    assert got == want and len(got[0]) == 5
    assert runner.stats()["steps_retracted"] == 1
    # the slot holds the prompt and every token but the last, in every layer: the next turn may continue it
    prompt = inputs[0]["input_ids"].shape[1]
    assert set(runner.held) == {0}
    assert all(lengths[0] == prompt + 4 for lengths in runner.cache.host_lengths)
    assert runner.cache.lengths[:, 0].tolist() == [prompt + 4] * runner.cache.num_layers


def test_a_cancel_takes_the_step_ahead_back_and_the_others_decode_on(case):
    model, processor = loaded(case)
    inputs = prompts(processor)[:2]
    want, _ = run(model, inputs, [10, 10], chain=False, cancel=(4, 0))
    got, runner = run(model, inputs, [10, 10], chain=True, cancel=(4, 0))
    assert got[1] == want[1] and len(got[1]) == 10
    assert got[0] == want[0] and len(got[0]) < 10
    assert runner.stats()["steps_retracted"] >= 1


def test_offloaded_steps_chain_and_keep_the_cache_account_in_order(case):
    """Offloaded layers through the decode table: the table's upkeep before each step reads the step
    before (not its tokens), so steps chain there too, with the same tokens and the same cache account."""
    model, processor = loaded(case, layers=2)
    want, _ = run(model, prompts(processor)[:1], [10], chain=False)
    runtime = model.vismmoe.context.offload_runtime
    unchained = dict(runtime.counters["decode"]), set(runtime.cache.where)
    model, processor = loaded(case, layers=2)
    got, runner = run(model, prompts(processor)[:1], [10], chain=True)
    runtime = model.vismmoe.context.offload_runtime
    assert got == want and runner.stats()["steps_ahead"] > 0
    # hits and misses of every offloaded layer, and what the slabs hold
    assert (dict(runtime.counters["decode"]), set(runtime.cache.where)) == unchained
    assert sum(c.misses for c in unchained[0].values()) > 0  # the cache did work that could differ


def test_the_placement_path_and_sampled_rows_wait_for_each_step(case):
    model, processor = loaded(case, layers=2)
    model.vismmoe.context.offload_runtime.table_enabled = False  # per-layer host reads of the routing
    _, runner = run(model, prompts(processor)[:1], [8], chain=True)
    assert not runner.step_fn.chainable(1) and runner.stats()["steps_ahead"] == 0
    model, processor = loaded(case)
    _, runner = run(model, prompts(processor)[:1], [8], chain=True, sampling=Sampling(True, 0.8, 0.9))
    assert runner.step_fn.chainable(1) and runner.stats()["steps_ahead"] == 0
