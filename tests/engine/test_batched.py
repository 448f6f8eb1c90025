"""Batched generation (engine/runner.py): requests decoded together, as the scheduler plans, give
every request the greedy tokens it gets alone, with every expert resident or offloaded, whatever the
batch size and whoever joins or leaves meanwhile."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.engine.generation import generate_batch
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.engine.inputs import build_inputs, user_turn

from conftest import layer_bytes, make_image, tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir, _, _ = tiny_case(tmp_path_factory, "tiny-4x16", 1, "Describe the image.", (160, 128), 2)
    return model_dir


def requests_for(processor):
    """Prompts of different lengths, with and without images of different sizes."""
    return [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(160, 128, seed=1)]),
            build_inputs(processor, [user_turn("What is here? Answer in a few words please.", 1)],
                         [make_image(96, 64, seed=2)]),
            build_inputs(processor, [user_turn("Hello there", 0)], []),
            build_inputs(processor, [user_turn("Two shapes?", 1)], [make_image(128, 128, seed=3)])]


@pytest.mark.parametrize("rules,layers,max_batch,graphs", [
    ("qwen3vl-offload", 4, 4, "off"), ("qwen3vl-offload", 4, 2, "off"), ("qwen3vl-offload", 2, 3, "off"),
    ("qwen3vl", 2, 3, "off"), ("qwen3vl-offload", 4, 3, "replay"), ("qwen3vl-offload", 2, 3, "replay")])
def test_batched_greedy_tokens_equal_each_request_alone(case, rules, layers, max_batch, graphs):
    """qwen3vl: VisMMOE whole, visual tokens pruned after the pinned layer (each slot's later layers hold
    fewer tokens than its first), misses split between the GPU and the CPU. graphs replay: the CPU twin
    of the captured steps, one per power-of-two batch size (3 sequences run as 4 rows, one of them
    padding) with every expert resident; with offloaded layers, whose tokens look their experts up in
    the decode table one after another inside the step, one per batch size (no padding rows)."""
    budget = int(layer_bytes(SPECS["tiny-4x16"]) * layers)
    model, processor = load(case, f"optimize_rules/{rules}.yaml", expert_budget=budget, graphs=graphs, **CPU)
    requests = requests_for(processor)
    budgets = [12, 5, 9, 7]
    with torch.no_grad():
        alone = [generate(model, dict(r), n, min_new_tokens=n) for r, n in zip(requests, budgets)]
        sizes, stats = [], {}
        together = generate_batch(model, [dict(r) for r in requests], budgets, max_batch=max_batch,
                                  min_new_tokens=max(budgets), on_step=sizes.append, stats=stats)
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    assert max(sizes) == min(max_batch, len(requests)) and max(sizes) > 1  # rows really ran together
    # the first step prefills as many prompts as there are slots, right-padded in one forward (the
    # images through one vision-tower call); pruning prefills each prompt alone
    if rules == "qwen3vl":
        assert stats["prefill_groups"] == stats["grouped_prompts"] == 0
    else:
        assert stats["prefill_groups"] >= 1 and stats["grouped_prompts"] >= min(max_batch, len(requests))
        assert stats["prefill_pieces"] == len(requests) - stats["grouped_prompts"] + stats["prefill_groups"]
    if graphs == "off":
        assert stats["graphed_steps"] == 0 and stats["captured_shapes"] == []
    else:
        assert stats["graphed_steps"] == stats["steps"] == len(sizes) and stats["check_failures"] == 0
        offloaded = layers < 4
        shapes = {rows for rows, _ in stats["captured_shapes"]}
        assert shapes == (set(sizes) if offloaded else {1 << (b - 1).bit_length() for b in sizes})
        assert (3 in shapes) == offloaded and (4 in shapes) != offloaded  # 3 sequences: as 3 rows, or padded to 4
        assert stats["eager_pieces_per_step"] == 0  # every layer inside the captures
    if rules == "qwen3vl":
        assert model.vismmoe.context.pruning.pruned_prefills == 6  # three image requests, alone and batched
    with torch.no_grad():  # the single-request path still works after a batch
        assert torch.equal(generate(model, dict(requests[0]), budgets[0], min_new_tokens=budgets[0]), alone[0])


@pytest.mark.parametrize("graphs", ["off", "replay"])
def test_batched_requests_follow_their_own_routing_tables(case, graphs):
    """A routing source under batching: each request's slot gets the table it gets alone (request i
    of the synthetic seeds), its prefill (whole, or 16 tokens a step) and every batched step read it,
    so the tokens are the same as alone."""
    from vismmoe_kt.operators.source_router import install_routing

    budget = int(layer_bytes(SPECS["tiny-4x16"]) * 2)
    model, processor = load(case, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget, graphs=graphs, **CPU)
    routing = install_routing(model, "synthetic:3")
    requests, budgets = requests_for(processor)[:3], [10, 8, 6]
    with torch.no_grad():
        alone = [generate(model, dict(r), n, min_new_tokens=n) for r, n in zip(requests, budgets)]
        tables = [entry["ids"] for entry in routing.history]
        routing.requests, stats, sizes = 0, {}, []  # the same seeds again, in the same order
        together = generate_batch(model, [dict(r) for r in requests], budgets, max_batch=3,  # replay: chunked too
                                  min_new_tokens=max(budgets), stats=stats, on_step=sizes.append,
                                  prefill_chunk=16 if graphs == "replay" else None)
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    for table, entry in zip(tables, routing.history[-3:]):
        assert torch.equal(table, entry["ids"])
    runtime = model.vismmoe.context.offload_runtime
    assert runtime.counters["decode"]  # the batched steps' offloaded layers counted as decode
    # whole prompts: the three prefilled in one forward, each token reading its own slot's table
    assert (stats["prefill_groups"], stats["grouped_prompts"]) == ((0, 0) if graphs == "replay" else (1, 3))
    assert max(sizes) > 1  # rows decoded together
    if graphs == "replay":  # offloaded layers through the table: one capture per batch size, no padding
        assert {rows for rows, _ in stats["captured_shapes"]} == set(sizes) and stats["eager_pieces_per_step"] == 0


@pytest.mark.parametrize("rules,graphs", [("qwen3vl-offload", "off"), ("qwen3vl-offload", "replay"), ("qwen3vl", "off")])
def test_prompts_prefilled_in_chunks_between_decode_steps_give_the_same_tokens(case, rules, graphs):
    """prefill_chunk 8: a prompt of ~60 tokens (an image's among them) goes through the text model 8
    tokens per step while the running requests decode; the vision tower's output, M-RoPE positions
    and deepstack features are cut per chunk, and every request gets its tokens alone. qwen3vl prunes
    visual tokens, which needs the whole prompt: it prefills whole, and says so (prefill_chunk None)."""
    budget = int(layer_bytes(SPECS["tiny-4x16"]) * 2)
    model, processor = load(case, f"optimize_rules/{rules}.yaml", expert_budget=budget, graphs=graphs, **CPU)
    requests, budgets = requests_for(processor), [6, 5, 4, 7]
    with torch.no_grad():
        alone = [generate(model, dict(r), n, min_new_tokens=n) for r, n in zip(requests, budgets)]
        stats, sizes = {}, []
        together = generate_batch(model, [dict(r) for r in requests], budgets, max_batch=3, prefill_chunk=8,
                                  min_new_tokens=max(budgets), stats=stats, on_step=sizes.append)
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    chunked = rules == "qwen3vl-offload"
    assert stats["prefill_chunk"] == (8 if chunked else None)
    lengths = [r["input_ids"].shape[1] for r in requests]
    assert stats["prefill_pieces"] == (sum(-(-n // 8) for n in lengths) if chunked else len(requests))
    if chunked:  # the running requests decoded while later prompts came in, a chunk per step
        assert min(lengths) > 8 and stats["prefill_pieces_beside_decode"] > len(requests)  # whole prompts: < 4


@pytest.mark.parametrize("mode", ["expert-major", "grouped-gemm"])
def test_each_way_of_computing_a_batched_steps_resident_experts_gives_the_tokens_alone(case, mode, monkeypatch):
    """batch_experts: the expert-major blocks (their torch twin here; the Triton kernels are checked
    against it in tests/runtime/kernels/test_expert_major.py) and grouped GEMM, every expert resident."""
    from vismmoe_kt.runtime.kernels import expert_major

    calls = []
    twin = expert_major.experts_by_block
    monkeypatch.setattr(expert_major, "experts_by_block", lambda *a, **k: calls.append(1) or twin(*a, **k))
    model, processor = load(case, "optimize_rules/qwen3vl-offload.yaml",
                            expert_budget=int(layer_bytes(SPECS["tiny-4x16"]) * 4), **CPU)
    runtime = model.vismmoe.context.offload_runtime
    runtime.batch_experts = mode
    requests, budgets = requests_for(processor), [6, 5, 4, 7]
    with torch.no_grad():
        alone = [generate(model, dict(r), n, min_new_tokens=n) for r, n in zip(requests, budgets)]
        together = generate_batch(model, [dict(r) for r in requests], budgets, max_batch=4, min_new_tokens=max(budgets))
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    assert bool(calls) == (mode == "expert-major")  # the batched steps' layers went the way asked


def test_what_batched_generation_refuses(case):
    model, processor = load(case, "optimize_rules/qwen3vl-gpu.yaml", **CPU)  # no VisDecoder: no lean engine
    with pytest.raises(ValueError, match="runs on the lean decode path"):
        generate_batch(model, requests_for(processor)[:1], 4)


@pytest.mark.parametrize("graphs,chunk", [("off", None), ("replay", 16)])
def test_a_conversations_next_turn_prefills_only_what_follows_its_history(case, graphs, chunk):
    """A finished request's slot keeps its KV; the conversation's next turn (the history re-sent, as
    chat clients do) is admitted to that slot and prefills only the tokens after the history, and
    gets the tokens it gets alone. The same prompt again reuses all but its last token."""
    from vismmoe_kt.engine.runner import ModelRunner

    budget = int(layer_bytes(SPECS["tiny-4x16"]) * 2)
    model, processor = load(case, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget, graphs=graphs, **CPU)
    image = make_image(160, 128, seed=1)
    first = build_inputs(processor, [user_turn("Describe the image.", 1)], [image])
    other = build_inputs(processor, [user_turn("Hello there", 0)], [])
    runner = ModelRunner(model, max_batch=2, capacity=512, max_queue=4, prefill_chunk=chunk)
    with torch.no_grad():
        answered, _ = generate_batch(model, [dict(first), dict(other)], [6, 5], min_new_tokens=6, runner=runner)
        answer = processor.decode(answered[0, first["input_ids"].shape[1]:], skip_special_tokens=True)
        follow_up = build_inputs(processor, [user_turn("Describe the image.", 1),
                                             {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                                             user_turn("What colour is it?", 0)], [image])
        together = generate_batch(model, [dict(follow_up), dict(other)], [6, 5], min_new_tokens=6, runner=runner)
        alone = [generate(model, dict(r), n, min_new_tokens=6) for r, n in ((follow_up, 6), (other, 5))]
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    stats = runner.stats()
    assert stats["reused_prefixes"] == 2  # the follow-up on its history, the repeated prompt on itself
    assert stats["reused_tokens"] >= first["input_ids"].shape[1] + other["input_ids"].shape[1] - 1


def test_a_history_overwritten_before_its_turn_is_prefilled_again(case):
    """One slot: the follow-up was matched to the slot's history when it was added, but an earlier
    request in the queue ran there first; the follow-up then prefills from its first token (and gets
    the tokens it gets alone), never reading the other request's keys and values."""
    from vismmoe_kt.engine.runner import BatchRequest, ModelRunner

    model, processor = load(case, "optimize_rules/qwen3vl-offload.yaml", expert_budget=int(layer_bytes(SPECS["tiny-4x16"]) * 4),
                            **CPU)
    first = build_inputs(processor, [user_turn("Hello there, how are you today?", 0)], [])
    runner = ModelRunner(model, max_batch=1, capacity=256, max_queue=4)
    with torch.no_grad():
        answered = generate_batch(model, [dict(first)], 4, min_new_tokens=4, runner=runner)[0]
        answer = processor.decode(answered[0, first["input_ids"].shape[1]:], skip_special_tokens=True)
        follow_up = build_inputs(processor, [user_turn("Hello there, how are you today?", 0),
                                             {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                                             user_turn("And tomorrow?", 0)], [])
        squatter = BatchRequest(dict(build_inputs(processor, [user_turn("Something else entirely", 0)], [])), 4,
                                min_new_tokens=4)
        late = BatchRequest(dict(follow_up), 4, min_new_tokens=4)
        runner.add(squatter)
        runner.add(late)
        assert late.sequence.preferred_block == 0 and late.sequence.cached > 0  # matched to the history when added
        while not runner.idle:
            runner.step()
        alone = generate(model, dict(follow_up), 4, min_new_tokens=4)
    assert late.sequence.generated == alone[0, follow_up["input_ids"].shape[1]:].tolist()
    # the squatter shares the chat template's opening with the history, never the whole first prompt
    assert runner.stats()["reused_tokens"] < first["input_ids"].shape[1] // 2


def test_prompts_grouped_for_prefill_are_right_padded_and_their_images_concatenated():
    from vismmoe_kt.engine.prefill_group import group_inputs

    a = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
         "pixel_values": torch.ones(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    b = {"input_ids": torch.tensor([[8]])}  # no attention mask: attention everywhere
    c = {"input_ids": torch.tensor([[9, 9]]), "attention_mask": torch.ones(1, 2, dtype=torch.long),
         "pixel_values": torch.zeros(8, 2), "image_grid_thw": torch.tensor([[1, 2, 4]])}
    out = group_inputs([a, b, c], pad_id=3)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3], [9, 9, 3]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert out["pixel_values"].shape == (12, 2) and out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    types = group_inputs([{**a, "mm_token_type_ids": torch.tensor([[0, 1, 0]])}, b], pad_id=3)["mm_token_type_ids"]
    assert types.tolist() == [[0, 1, 0], [0, 0, 0]]  # the text-only prompt: every token text
    with pytest.raises(ValueError, match="'pixel_values_videos' cannot be batched"):
        group_inputs([a, {**b, "pixel_values_videos": torch.ones(2, 2)}], pad_id=3)


def test_finished_requests_keep_their_images_unhashed_until_a_next_turn_needs_them(case, monkeypatch):
    """Hashing an image copies its pixels to the host: a finishing request must not do it inside the
    step every stream waits for. Its slot's history hashes them only when a new request's tokens
    could continue it."""
    from vismmoe_kt.engine import prompt_history, runner as runner_module
    from vismmoe_kt.engine.runner import ModelRunner
    from vismmoe_kt.engine.prompt_history import ImageKeys, may_continue

    hashed = []
    real = prompt_history.image_keys
    for module in (runner_module, prompt_history):
        monkeypatch.setattr(module, "image_keys", lambda inputs: hashed.append(1) or real(inputs))
    model, processor = load(case, "optimize_rules/qwen3vl-offload.yaml",
                            expert_budget=int(layer_bytes(SPECS["tiny-4x16"]) * 4), **CPU)
    requests = requests_for(processor)[:2]
    runner = ModelRunner(model, 2, max(r["input_ids"].shape[1] for r in requests) + 4, max_queue=2)
    with torch.no_grad():
        generate_batch(model, [dict(r) for r in requests], 4, runner=runner, min_new_tokens=4)
    assert len(runner.held) == 2 and not hashed  # histories kept, nothing hashed
    assert sorted(held.images.count() for held in runner.held.values()) == [1, 1] and not hashed
    # a different question: its tokens part before any image, so nothing is hashed either
    other = build_inputs(processor, [user_turn("Something else entirely?", 0)], [])
    with torch.no_grad():
        generate_batch(model, [dict(other)], 2, runner=runner, min_new_tokens=2)
    assert not hashed
    assert ImageKeys(requests[0]).get() == real(requests[0])
    image = 7
    assert may_continue([1, 2, image, 3], [1, 2, image, 3, 4], image)       # the history whole, then more
    assert not may_continue([1, 2, image, 3], [1, 2, 5], image)               # a held image would be cut
    assert not may_continue([1, 2], [9, 2, 3], image) and may_continue([1, 2], [1, 2, 3], None)
