"""The lean decode path (vismmoe_kt.engine) against transformers' generation, on the CPU.

The CPU has no CUDA graphs; `graphs: replay` runs the same segment plumbing (fixed input and output
buffers, copies between segments) with an eager re-run in place of a graph replay, and `graphs: off`
runs every piece eagerly. Both must give the reference model's greedy tokens, all experts resident
or offloaded, with visual tokens pruned or not. Per decode step the path may read from the device once
per offloaded MoE layer, and must not allocate more as the sequence grows.
"""

from pathlib import Path

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from vismmoe_kt import load
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.engine.sampling import next_token
from vismmoe_kt.engine.graphs import ReplayCapture
from vismmoe_kt.engine.decoding import decode_engine
from vismmoe_kt.engine.slot_cache import CacheFullError, SlotKVCache
from vismmoe_kt.core.context import DecodeOptions
from vismmoe_kt.errors import LoadError, RuleError
from vismmoe_kt.operators.vis_experts import VisExperts
from vismmoe_kt.demo.tiny import SPECS

from conftest import layer_bytes, tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
TOKENS = 24


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir, ref, inputs = tiny_case(tmp_path_factory, "tiny-4x16", 1, "Describe the image.", (160, 128), 2)
    with torch.no_grad():
        expected = ref.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return model_dir, inputs, expected


def budget(layers):
    return int(layer_bytes(SPECS["tiny-4x16"]) * layers)


def decoder_of(model):
    return model.model.language_model


@pytest.mark.parametrize("layers,graphs", [(4, "off"), (4, "replay"), (2, "replay"), (2, "off")])
def test_lean_tokens_equal_the_reference(case, layers, graphs):
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(layers), graphs=graphs, **CPU)
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    stats = decoder_of(model).stats()
    assert stats["decode_steps"] == TOKENS - 1  # the first token comes from the prefill
    if graphs == "replay":
        assert stats["decode_graphed_steps"] == stats["decode_steps"] and stats["decode_check_failures"] == 0
        # graphed (the CPU twin) and eager steps agree to the bit, offloaded experts missing or not
        assert stats["decode_check_max_difference"] == 0.0
        # offloaded or not, the step is one segment: experts are read through the slab table
        assert stats["decode_segments_captured"] == 1
        assert stats["decode_eager_pieces_per_step"] == 0
        # the picture's vision tower: captured for its size at the first prompt, replayed at the next
        assert stats["decode_vision_graph_captures"] == 1 and stats["decode_vision_graph_replays"] == 0
        # another picture of that size (its own prompt: nothing of the first is reused) through the replay
        other = {**inputs, "pixel_values": inputs["pixel_values"].flip(0)}
        with torch.no_grad():
            want = generate(load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(layers),
                                 graphs="off", **CPU)[0], other, TOKENS)
            assert torch.equal(generate(model, other, TOKENS), want)
        stats = decoder_of(model).stats()
        assert stats["decode_vision_graph_replays"] == 1 and stats["decode_vision_graph_check_failures"] == 0


def test_lean_path_follows_pruned_layers(case):
    """With visual tokens pruned after layer 1, the layers' caches have different lengths; the lean
    path must give the tokens of transformers' loop over the same pruned model."""
    model_dir, inputs, _ = case
    kwargs = dict(expert_budget=budget(4), keep_ratio=0.5, prune_layer=1, **CPU)
    hf, _ = load(model_dir, "optimize_rules/qwen3vl.yaml", decode="hf", **kwargs)
    lean, _ = load(model_dir, "optimize_rules/qwen3vl.yaml", graphs="replay", **kwargs)
    with torch.no_grad():
        expected = generate(hf, inputs, TOKENS)
        tokens = generate(lean, inputs, TOKENS)
    assert decoder_of(lean).text_forward.counters.pruned_prefills == 1
    assert torch.equal(tokens, expected)
    cache = decode_engine(lean).cache
    assert cache.host_lengths[0] > cache.host_lengths[1] == cache.host_lengths[3]  # layer 0 keeps every token
    # another picture of that size: the tower replayed with the saliency recorder's hook in it, the pruning
    # ranked by that picture's own saliency (the tokens of the eager tower's)
    other = {**inputs, "pixel_values": inputs["pixel_values"].flip(0)}
    with torch.no_grad():
        assert torch.equal(generate(lean, other, TOKENS), generate(hf, other, TOKENS))
    stats = decoder_of(lean).stats()
    assert stats["decode_vision_graph_replays"] == 1 and stats["decode_vision_graph_captures"] == 1
    assert decoder_of(lean).text_forward.counters.pruned_prefills == 2


class DeviceReads(TorchDispatchMode):
    """Counts ops that make a CUDA device wait for the host (data-dependent shapes, scalar reads) and
    the bytes each op allocates (outputs not sharing an input's storage)."""
    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
               "aten::unique_dim", "aten::unique_consecutive", "aten::bincount", "aten::equal",
               "aten::is_nonzero")

    def __init__(self):
        super().__init__()
        self.syncing: list[str] = []
        self.allocated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in self.SYNCING:
            self.syncing.append(name)
        elif name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.syncing.append(f"{name} by a boolean mask")  # a nonzero inside the op, on a GPU a wait
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.allocated += o.untyped_storage().nbytes()
        return out


def run_steps(model, inputs, steps):
    """Prefill, then `steps` lean steps, each watched by its own DeviceReads."""
    engine = decode_engine(model)
    with torch.no_grad():
        generate(model, inputs, 1)  # prefill into the engine's cache
        token = torch.tensor([5])
        watched = []
        for _ in range(steps):
            with DeviceReads() as mode:
                logits = engine.step([0], token.view(1), torch.zeros(1, dtype=torch.long))
            watched.append(mode)
            token = next_token(logits, False, 1.0, 1.0)
    return engine, watched


def test_reservations_ahead_through_the_graph_self_check_keep_the_tokens(case, monkeypatch):
    """Landings reserved a step ahead, with misses (two layers' budget) and the graph self-check's nested
    step (replay): the nested `before` accounts every queued step first (`_flush`), and the tokens are the
    reference's."""
    from vismmoe_kt.runtime.decode_boundary import DecodeBoundary

    model_dir, inputs, expected = case
    flushes = []
    flush = DecodeBoundary._flush
    monkeypatch.setattr(DecodeBoundary, "_flush", lambda self: (flushes.append(1), flush(self))[1])
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), graphs="replay",
                    reservations="ahead", **CPU)
    runtime = model.vismmoe.context.offload_runtime
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    assert runtime.plan.reservations == "ahead" and flushes  # the self-check nested a step at least once
    assert runtime.summary()["decode_fetches"] > 0  # steps missed and landed
    stats = decoder_of(model).stats()
    assert stats["decode_graphed_steps"] == stats["decode_steps"] and stats["decode_check_failures"] == 0


def test_resident_step_neither_syncs_nor_grows(case):
    model_dir, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4), graphs="off", **CPU)
    engine, watched = run_steps(model, inputs, 6)
    buffers = [t.data_ptr() for t in engine.cache.keys + engine.cache.values]
    assert all(w.syncing == [] for w in watched), [w.syncing for w in watched]
    assert len({w.allocated for w in watched[1:]}) == 1  # the same bytes at every step: nothing grows
    assert [t.data_ptr() for t in engine.cache.keys + engine.cache.values] == buffers


def test_offloaded_step_with_misses_never_reads_the_device(case):
    """At a budget of 2 layers (one pinned, one of slabs for three) decode experts miss; the step still reads nothing back: misses
    are read from the host store by the experts themselves, the cache is kept between steps."""
    model_dir, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), graphs="off", **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    offloaded = len(runtime.moe_layers) - len(runtime.pinned)
    assert offloaded == 3
    before = runtime.host_reads
    _, watched = run_steps(model, inputs, 4)
    assert runtime.host_reads - before == offloaded  # the prefill's reads (one per offloaded layer), none after
    assert all(w.syncing == [] for w in watched), [w.syncing for w in watched]
    decode = [runtime.counters["decode"][layer] for layer in runtime.moe_layers if layer not in runtime.pinned]
    assert sum(c.misses for c in decode) > 0  # the steps did miss
    assert runtime.copy_counters["decode"].bytes_host_reads == sum(c.misses for c in decode) * runtime.store.block_bytes


def test_old_placement_path_reads_the_device_once_per_offloaded_layer(case):
    """The detector above can fail: decode outside the lean engine's hooks (the placement path)
    reads each offloaded layer's routing back."""
    model_dir, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), graphs="off", **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    runtime.table_enabled = False
    offloaded = len(runtime.moe_layers) - len(runtime.pinned)
    _, watched = run_steps(model, inputs, 2)
    assert all(w.syncing == ["aten::_unique2"] * offloaded for w in watched), [w.syncing for w in watched]


class BrokenCapture(ReplayCapture):
    def capture(self, run):
        raise RuntimeError("operation not permitted when stream is capturing")


class WrongReplay(ReplayCapture):
    def capture(self, run):
        replay, outputs = super().capture(run)

        def wrong():
            replay()
            outputs[0].add_(1.0)
        return wrong, outputs


@pytest.mark.parametrize("backend,counter", [(BrokenCapture, "capture_failures"), (WrongReplay, "check_failures")])
def test_graph_trouble_falls_back_to_eager_and_says_so(case, backend, counter):
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), graphs="replay", **CPU)
    engine = decode_engine(model)
    engine.runner_for(inputs["input_ids"].shape[1] + TOKENS)
    engine.step.backend = backend()
    with pytest.warns(RuntimeWarning, match="decode runs without graphs"), torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    stats = engine.stats()
    assert stats[counter] == 1 and stats["graphed_steps"] == 0 and stats["graphs"] == "off"
    if backend is WrongReplay:  # captured twice before giving up, and the reason gives the size of the error
        assert stats["check_retries"] == 1 and stats["check_max_difference"] >= 1.0
        assert "differ from the eager step by" in stats["reason_eager"]


class WrongOnce(WrongReplay):
    """A capture that is wrong the first time only (a transient fault)."""
    def __init__(self):
        self.captures = 0

    def capture(self, run):
        self.captures += 1
        return (WrongReplay.capture if self.captures == 1 else ReplayCapture.capture)(self, run)


def test_a_transient_check_failure_captures_again_and_keeps_graphs(case):
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), graphs="replay", **CPU)
    engine = decode_engine(model)
    engine.runner_for(inputs["input_ids"].shape[1] + TOKENS)
    engine.step.backend = WrongOnce()
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    stats = engine.stats()
    assert stats["check_retries"] == 1 and stats["check_failures"] == 0
    assert stats["graphed_steps"] == stats["steps"] and stats["graphs"] == "replay"


def test_cache_reuse_across_requests_and_growth(case):
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4), graphs="replay", **CPU)
    with torch.no_grad():
        first = generate(model, inputs, TOKENS)
        engine = decode_engine(model)
        cache = engine.cache
        again = generate(model, inputs, TOKENS)
        assert engine.cache is cache  # same buffers, same captured segments
        longer = generate(model, inputs, cache.capacity)  # needs more room: a new, larger cache
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert engine.cache.capacity > cache.capacity
    assert torch.equal(longer[:, :expected.shape[1]], expected)
    # one capture in the first cache; in the larger one, one per attention span the longer request reached
    assert engine.stats()["captured_shapes"] == [(1, 256), (1, 512)]
    assert engine.stats()["segments_captured"] == 3
    steps = engine.stats()["steps"]
    engine.discard(engine.single)  # as a failed step leaves it: no live runner until the next request
    assert engine.stats()["segments_captured"] == 3 and engine.stats()["steps"] == steps  # the totals stay


def test_a_slot_refuses_overflow_and_tracks_layers_apart():
    cache = SlotKVCache(layers=2, slots=1, kv_heads=1, head_dim=4, capacity=5, dtype=torch.float32, device="cpu")
    view = cache.slot_view(0)
    keys, _ = view.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), 0)
    assert keys.shape[2] == 3 and view.get_seq_length(0) == 3 and view.get_seq_length(1) == 0
    with pytest.raises(CacheFullError, match="layer 0 needs 6 positions, the cache holds 5"):
        view.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), 0)
    view.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 1)
    cache.begin_decode([0])
    masks = cache.decode_masks(torch.float32)
    assert masks.shape == (2, 1, 1, 1, 5)
    assert (masks[0, 0, 0, 0] == 0).tolist() == [True, True, True, True, False]  # 3 filled + the slot written now
    assert (masks[1, 0, 0, 0] == 0).tolist() == [True, True, False, False, False]


def test_sampling_respects_top_p_and_greedy():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    assert next_token(logits, False, 1.0, 1.0).item() == logits.argmax().item()
    draws = {next_token(logits, True, 1.0, 1e-6).item() for _ in range(20)}
    assert draws == {logits.argmax().item()}  # a tiny nucleus holds only the most likely token
    wide = {next_token(logits, True, 5.0, 1.0).item() for _ in range(50)}
    assert len(wide) > 5


def test_graphs_off_as_yaml_reads_it(tiny_dir):
    """`--set graphs=off` and a bare `graphs: off` in a rule file arrive as the boolean False."""
    from vismmoe_kt.apps.flags import parse_set

    model, _ = load(tiny_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4),
                    **parse_set(["graphs=off"]), **CPU)
    assert model.vismmoe.context.decode.graphs == "off"


def test_bad_decode_options_are_clear_errors(tiny_dir):
    with pytest.raises(LoadError, match=r"decode 'fast' is not one of: lean, hf"):
        load(tiny_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4), decode="fast", **CPU)
    with pytest.raises(LoadError, match=r"graphs 'always' is not one of: auto, cuda, replay, off"):
        load(tiny_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4), graphs="always", **CPU)


def test_old_rule_files_with_decode_kwargs_still_load_with_a_warning(tiny_dir, tmp_path):
    """`decode`/`graphs` were VisDecoder kwargs; they are engine options now. An old rule file keeps
    working (the values become the engine's options) and says what to do; explicit options win."""
    old = tmp_path / "old.yaml"
    text = open("optimize_rules/qwen3vl-offload.yaml").read()
    old.write_text(text.replace("      compression: none", "      compression: none\n      decode: hf\n      graphs: off", 1))
    with pytest.warns(DeprecationWarning, match="engine options now"):
        model, _ = load(tiny_dir, str(old), expert_budget=budget(4), **CPU)
    assert model.vismmoe.context.decode == DecodeOptions("hf", "off") and decode_engine(model) is None
    with pytest.warns(DeprecationWarning):
        model, _ = load(tiny_dir, str(old), expert_budget=budget(4), decode="lean", **CPU)
    assert model.vismmoe.context.decode == DecodeOptions("lean", "off") and decode_engine(model) is not None


def test_profile_breaks_a_step_down_per_layer(case):
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), **CPU)
    engine = decode_engine(model)
    engine.profiling = True
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    profile = engine.profile()
    assert profile["steps"] == TOKENS - 1
    columns = profile["seconds_per_step"]
    assert set(columns) == {"embed", "attention", "experts", "head"}
    assert set(columns["attention"]) == set(columns["experts"]) == {"0", "1", "2", "3"}
    assert all(t > 0 for column in columns.values() for t in column.values())


def test_realb_operator_runs_between_segments(case):
    """MixedPrecisionExperts (host-side control) is not capturable: it runs eagerly between the
    captured segments and sees decode tokens as text (BF16 in mode realb: the reference tokens)."""
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-realb.yaml", graphs="replay", **CPU)
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    stats = decoder_of(model).stats()
    assert stats["decode_eager_pieces_per_step"] == 4 and stats["decode_segments_captured"] == 5


@pytest.mark.parametrize("rules,extra", [("optimize_rules/qwen3vl-offload.yaml", {"expert_budget": budget(2)}),
                                         ("optimize_rules/qwen3vl.yaml", {"expert_budget": budget(4), "keep_ratio": 0.5,
                                                                           "prune_layer": 1})])
def test_chat_turns_reuse_the_cached_history(case, tiny_dir, rules, extra):
    """A follow-up question prefills only the new tokens (the vision tower runs once), and the
    replies equal those of transformers' loop re-reading the whole conversation each turn."""
    from conftest import make_image
    from vismmoe_kt.engine.chat import ChatSession

    model_dir = case[0]
    replies, towers = {}, {}
    for decode in ("hf", "lean"):
        model, processor = load(model_dir, rules, decode=decode, graphs="replay", **extra, **CPU)
        calls = []
        model.model.visual.register_forward_hook(lambda *a: calls.append(1))
        session = ChatSession(model, processor, max_new_tokens=12, greedy=True)
        with torch.no_grad():
            first, timings = session.ask("Describe the image.", [make_image(120, 96, 3)], out=_Sink())
            turns = [first, session.ask("What colour is it?", out=_Sink())[0],
                     session.ask("And the shape?", out=_Sink())[0]]
        replies[decode], towers[decode] = turns, len(calls)
        if decode == "lean":
            stats = decoder_of(model).stats()
            assert stats["decode_reused_prefixes"] == 2
            # each later turn kept at least the whole first prompt (image included)
            assert stats["decode_reused_tokens"] >= 2 * timings.prompt_tokens
            engine = decode_engine(model)  # every layer holds the history minus what pruning left out
            history = engine.single.held[0]
            held, pruned = len(history.ids), len(history.pruned)
            assert engine.cache.host_lengths == [[held]] + [[held - pruned]] * 3
            assert (pruned > 0) == ("keep_ratio" in extra)
    assert replies["lean"] == replies["hf"]
    assert towers == {"hf": 3, "lean": 1}


class _Sink:
    def write(self, text):
        pass

    def flush(self):
        pass



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_equal_the_model_modules(dtype):
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (Qwen3VLMoeTextRMSNorm,
                                                                        Qwen3VLMoeTextTopKRouter)

    from vismmoe_kt.demo.tiny import build_tiny_model
    from vismmoe_kt.engine.fused_ops import rms_norm, route
    from vismmoe_kt.models import adapter_for

    torch.manual_seed(0)
    norm = Qwen3VLMoeTextRMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data.normal_()
    x = torch.randn(5, 64, dtype=dtype) * 3
    adapter = adapter_for("qwen3_vl_moe")
    fused = rms_norm(*adapter.rms_norm_params(norm), x)
    assert torch.allclose(fused.float(), norm(x).float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    config = build_tiny_model("tiny-4x16", seed=0)[0].config.text_config
    gate = Qwen3VLMoeTextTopKRouter(config).to(dtype)
    gate.weight.data.normal_()
    _, ref_weights, ref_ids = gate(x)
    weights, ids = route(*adapter.fused_router(gate), x)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(weights.float(), ref_weights.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_min_new_tokens_decodes_past_the_end_token(case):
    """Benchmarks decode a fixed count: with min_new_tokens the end-of-sequence token does not stop it."""
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4), **CPU)
    model.generation_config.eos_token_id = int(expected[0, inputs["input_ids"].shape[1] + 2])  # the 3rd token
    with torch.no_grad():
        short = generate(model, inputs, TOKENS)
        full = generate(model, inputs, TOKENS, min_new_tokens=TOKENS)
    prompt = inputs["input_ids"].shape[1]
    assert short.shape[1] - prompt <= 3 and torch.equal(full, expected)


def _first_logits(monkeypatch):
    """Record the logits each generate() call samples its first token from."""
    import vismmoe_kt.engine.sampling as sampling

    seen, original = [], sampling.next_token

    def recording(logits, *args):
        seen.append(logits.detach().clone())
        return original(logits, *args)
    monkeypatch.setattr(sampling, "next_token", recording)
    return seen


def test_a_different_image_of_the_same_size_is_never_reused(case, monkeypatch):
    """Two images of one size give identical token ids; the cache must tell them apart by content."""
    from conftest import make_image

    model_dir, inputs, _ = case
    model, processor = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), **CPU)
    ref, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), decode="hf", **CPU)
    other = processor(text=[processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
        add_generation_prompt=True, tokenize=False)], images=[make_image(160, 128, 7)], return_tensors="pt")
    assert torch.equal(other["input_ids"], inputs["input_ids"])  # the same tokens, another picture
    with torch.no_grad():
        generate(model, inputs, 4)
        tokens = generate(model, other, TOKENS)
        expected = generate(ref, other, TOKENS)
    assert decoder_of(model).stats()["decode_reused_prefixes"] == 0
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("rules,extra,reused", [
    ("optimize_rules/qwen3vl-offload.yaml", {"expert_budget": budget(2)}, 2),
    # pruning picks among all visual tokens at once: the turn that adds an image is prefilled whole
    ("optimize_rules/qwen3vl.yaml", {"expert_budget": budget(4), "keep_ratio": 0.5, "prune_layer": 1}, 1)])
def test_a_turn_with_a_new_image_runs_the_vision_tower_on_it_alone(case, monkeypatch, rules, extra, reused):
    """Turn 2 adds an image, turn 3 none: the lean path's first-token logits of every turn equal a
    fresh full forward over the whole conversation, and the vision tower only ever sees new images."""
    from conftest import make_image

    model_dir = case[0]
    sampled = _first_logits(monkeypatch)
    model, processor = load(model_dir, rules, graphs="replay", **extra, **CPU)
    fresh, _ = load(model_dir, rules, decode="hf", **extra, **CPU)
    rows = []
    model.model.visual.register_forward_hook(lambda m, args, out: rows.append(int(args[0].shape[0])))
    turns = [("Describe the image.", make_image(120, 96, 3)), ("And this one?", make_image(64, 64, 4)),
             ("Which is brighter?", None)]
    messages, images = [], []
    with torch.no_grad():
        for text, image in turns:
            images += [image] if image is not None else []
            content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": text}]
            messages.append({"role": "user", "content": content})
            prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = processor(text=[prompt], images=images, return_tensors="pt")
            sampled.clear()
            out = generate(model, inputs, 8)
            expected = fresh(**inputs).logits[:, -1]
            assert (sampled[0] - expected).abs().max().item() <= 1e-4
            reply = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    assert decoder_of(model).stats()["decode_reused_prefixes"] == reused
    first, second = inputs["image_grid_thw"].prod(dim=-1).tolist()  # pixel rows of each image
    assert rows == ([first, second] if reused == 2 else [first, first + second])


def test_the_public_generate_is_the_lean_path(case):
    import vismmoe_kt

    model_dir, inputs, expected = case
    model, _ = vismmoe_kt.load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), **CPU)
    with torch.no_grad():
        assert torch.equal(vismmoe_kt.generate(model, inputs, TOKENS), expected)
    assert decoder_of(model).stats()["decode_steps"] == TOKENS - 1


def tiny_predictor(path) -> None:
    """An untrained lookahead predictor for tiny-4x16 (window 2), saved at `path`."""
    from vismmoe_kt.predictor.model import LookaheadPredictor, PredictorConfig

    spec = SPECS["tiny-4x16"]
    config = PredictorConfig(num_layers=spec.layers, num_experts=spec.experts, hidden_size=spec.hidden,
                             visual_size=spec.hidden, window=2, width=32, history_dim=16)
    torch.manual_seed(0)
    LookaheadPredictor(config).save(path)


def test_lookahead_prefetch_inside_table_steps(case, tmp_path):
    """With a predictor, table steps prefetch the next layers' likely experts on the device (a side
    stream on CUDA): the tokens stay the reference's, graphed and eager steps agree to the bit,
    prefetches land and are counted, and a step still reads nothing back from the device."""
    tiny_predictor(tmp_path / "predictor.pt")
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), graphs="replay",
                    predictor=str(tmp_path / "predictor.pt"), prefetch_topk=6, prefetch_min_probability=0.0, **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    assert runtime.table_enabled and runtime.lookahead is not None
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    stats = decoder_of(model).stats()
    assert stats["decode_graphed_steps"] == stats["decode_steps"] and stats["decode_check_max_difference"] == 0.0
    summary = runtime.summary()
    assert summary["decode_prefetches"] > 0  # an untrained predictor's top pairs, believed at probability 0
    assert summary["decode_prefetch_used"] + summary["decode_prefetch_wasted"] <= summary["decode_prefetches"]
    _, watched = run_steps(model, inputs, 3)
    assert all(w.syncing == [] for w in watched), [w.syncing for w in watched]


def test_offloaded_steps_average_the_routers_probabilities_for_eviction(case):
    """Each table step hands every MoE layer's full router softmax to the runtime: after n decode
    steps a row's average sums to 1 - 0.8**n (it starts at zeros), and the slab cache ranks by it."""
    from vismmoe_kt.runtime.offload import ROUTER_KEEP

    model_dir, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2), graphs="off", **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    with torch.no_grad():
        generate(model, inputs, 6)  # the prefill's token, then 5 decode steps
    expected = 1 - ROUTER_KEEP ** 5
    torch.testing.assert_close(runtime.table.usage.sum(dim=1), torch.full((len(runtime.moe_layers),), expected))
    runtime.before_step()  # the boundary reads the last step's records back
    assert set(runtime.cache.usage) == set(runtime.moe_layers)


@pytest.mark.parametrize("miss_policy,cost", [("cpu", None), ("auto", {"fetch_seconds": 1.0, "cpu_seconds_fixed": 0.5,
                                                                      "cpu_seconds_per_token": 0.1})])
def test_hybrid_decode_through_the_table_splits_misses_with_the_cpu(case, miss_policy, cost):
    """Hybrid mode in table decode: the last cpu_quota[m] of a layer's m misses are computed by the
    CPU backend (no landing, no host read), the rest read through as before; every step is captured
    (the graphs' CPU twin) and the tokens are the reference's. `auto` with one copy at 1 s and one CPU
    expert at 0.6 s: one miss goes to the CPU, two split one and one, three send two to the CPU."""
    model_dir, inputs, expected = case
    extra = {"cost_model": cost} if cost else {}
    model, _ = load(model_dir, "optimize_rules/qwen3vl.yaml", expert_budget=budget(2), graphs="replay",
                    miss_policy=miss_policy, keep_ratio=1.0, **extra, **CPU)  # the hybrid rule file, no pruning
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    assert runtime.table_enabled
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    stats = decoder_of(model).stats()
    assert stats["decode_graphed_steps"] == stats["decode_steps"] == TOKENS - 1
    decode = [runtime.counters["decode"][layer] for layer in runtime.moe_layers if layer not in runtime.pinned]
    cpu, misses = sum(c.cpu for c in decode), sum(c.misses + c.late for c in decode)
    assert cpu > 0 and sum(c.cpu_pairs for c in decode) == cpu
    expected_quota = [0, 1, 2, 3] if miss_policy == "cpu" else [0, 1, 1, 2]
    assert runtime.table.cpu_quota.tolist()[:4] == expected_quota
    if miss_policy == "cpu":
        assert misses == 0 and runtime.copy_counters["decode"].bytes_host_reads == 0
    else:
        assert misses > 0
        assert runtime.copy_counters["decode"].bytes_host_reads == misses * runtime.store.block_bytes


def test_hybrid_steps_without_cpu_work_are_captured_without_the_cpu_calls(case):
    """While the cost model sends no miss to the CPU, the step is captured without the CPU's calls
    (each would cost the GPU two host functions per layer); once it sends some, a second capture
    holds them, and going back replays the first without capturing again. Tokens stay the reference's."""
    from vismmoe_kt.runtime.cost_model import CostModel, CostTracker

    model_dir, inputs, expected = case
    slow_cpu = {"fetch_seconds": 1.0, "cpu_seconds_fixed": 5.0, "cpu_seconds_per_token": 0.1}
    model, _ = load(model_dir, "optimize_rules/qwen3vl.yaml", expert_budget=budget(2), graphs="replay",
                    miss_policy="auto", keep_ratio=1.0, cost_model=slow_cpu, **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    calls = []  # the decode steps' CPU calls (the prefill's placement path may call the CPU too)
    begin = runtime.cpu_join.begin
    runtime.cpu_join.begin = lambda layer, *a: (calls.append(layer), begin(layer, *a))[1]
    engine = decode_engine(model)

    def pairs_on_cpu() -> int:
        return sum(c.cpu for c in runtime.counters["decode"].values())

    def decode() -> tuple[torch.Tensor, int, int]:
        calls_before, pairs_before = len(calls), pairs_on_cpu()
        with torch.no_grad():
            tokens = generate(model, inputs, TOKENS)
        runtime.before_step()  # the boundary counts the last step's records (then stands down: no step runs)
        runtime.after_step()
        return tokens, len(calls) - calls_before, pairs_on_cpu() - pairs_before

    tokens, cpu_calls, _ = decode()
    assert torch.equal(tokens, expected) and cpu_calls == 0 and not runtime.graph_variant()
    assert engine.stats()["segments_captured"] == 1
    runtime.miss.cost = CostTracker(CostModel(1.0, 0.5, 0.1), pinned=True)  # now the CPU is worth calling
    tokens, cpu_calls, cpu_pairs = decode()
    assert torch.equal(tokens, expected) and cpu_calls > 0 and cpu_pairs > 0 and runtime.graph_variant()
    assert engine.stats()["segments_captured"] == 2
    runtime.miss.cost = CostTracker(CostModel(**slow_cpu), pinned=True)
    tokens, cpu_calls, _ = decode()
    assert torch.equal(tokens, expected) and cpu_calls == 0
    stats = engine.stats()
    assert stats["segments_captured"] == 2 and stats["graphed_steps"] == stats["steps"]


def test_a_measured_quota_alternates_captured_variants_and_each_replays_what_it_captured(case):
    """With a measured (unpinned) cost model the trial alternates steps with and without the CPU's
    share; the capture's self-check (a nested step) keeps the quota it was captured with, and every
    replay runs under the variant its capture saw (a backend that checks it, since the CPU twin
    re-runs the Python and would not show a mis-filed graph)."""
    from vismmoe_kt.runtime.cost_model import CostModel, CostTracker

    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl.yaml", expert_budget=budget(2), graphs="replay",
                    miss_policy="auto", keep_ratio=1.0, **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    # sends misses to the CPU (a link 100x slower than the CPU: the prefill's measured copies cannot undo
    # that); not pinned, so the trial runs
    runtime.miss.cost = CostTracker(CostModel(100.0, 0.5, 0.1))

    class KeyedReplay(ReplayCapture):
        seen: list = []

        def capture(self, run):
            key = runtime.graph_variant()
            replay, outputs = super().capture(run)

            def checked():
                assert runtime.graph_variant() == key, "a graph replayed under the other variant"
                self.seen.append(key)
                replay()
            return checked, outputs

    engine = decode_engine(model)
    engine.runner_for(inputs["input_ids"].shape[1] + TOKENS)
    engine.step.backend = KeyedReplay()
    asked = []
    choose = runtime.miss.trial.choose
    runtime.miss.trial.choose = lambda quota: (asked.append(1), choose(quota))[1]
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    stats = engine.stats()
    assert stats["segments_captured"] == 2 and stats["check_failures"] == 0 and stats["graphed_steps"] == stats["steps"]
    assert len(asked) == stats["steps"]  # once per step: the self-checks' nested steps do not ask again
    assert set(KeyedReplay.seen) == {"cpu pairs", ""}  # both variants replayed, each under its own key


@pytest.mark.parametrize("stride", [1, 2])
def test_lookahead_stride_runs_the_predictor_at_every_sth_layer(case, tmp_path, stride):
    """`prefetch_stride: S` runs the predictor at MoE rows 0, S, 2S, ... of each step (its window of W
    rows ahead covers the rows between), so a step launches 1/S of its kernels; tokens stay the
    reference's. A stride beyond the window would leave rows no prediction reaches: an error."""
    tiny_predictor(tmp_path / "predictor.pt")
    model_dir, inputs, expected = case
    kwargs = dict(expert_budget=budget(2), graphs="off", predictor=str(tmp_path / "predictor.pt"), prefetch_topk=6,
                  prefetch_min_probability=0.0, **CPU)
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", prefetch_stride=stride, **kwargs)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    rows = []
    candidates = runtime.lookahead.candidates
    runtime.lookahead.candidates = lambda row, *a: (rows.append(row), candidates(row, *a))[1]
    with torch.no_grad():
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    steps = decoder_of(model).stats()["decode_steps"]
    last = SPECS["tiny-4x16"].layers - 1  # the last row closes the step (no prediction: nothing lies ahead)
    assert sorted(set(rows)) == [r for r in range(last) if r % stride == 0]
    assert len(rows) == steps * len([r for r in range(last) if r % stride == 0])
    assert runtime.summary()["decode_prefetches"] > 0
    with pytest.raises(RuleError, match=r"prefetch_stride 3 must be between 1 and the predictor's window \(2\)"):
        load(model_dir, "optimize_rules/qwen3vl-offload.yaml", prefetch_stride=3, **kwargs)
    with pytest.raises(RuleError, match="prefetch_stride must be a whole number >= 1"):
        load(model_dir, "optimize_rules/qwen3vl-offload.yaml", prefetch_stride=0, **kwargs)


def test_a_budget_for_every_expert_fills_the_slabs_and_decodes_settled_in_its_own_graph(case):
    """A budget that holds every offloaded expert: the plan fills the slabs, so as decode first starts the
    experts no prompt routed to are copied in (once), and decode is settled from its first step: its steps
    (a graph of their own: no lookup, staging or records) give the reference's tokens, count every pair a
    hit and read nothing from the host."""
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(5), pinned_layers=1,
                    graphs="replay", **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    offloaded = runtime.offloaded_layers()
    assert offloaded and runtime.num_slabs >= len(offloaded) * runtime.num_experts
    assert runtime.plan.fill_slabs and any(line.startswith("fill: ") for line in runtime.plan.describe())
    variants = []
    before = runtime.before_step
    runtime.before_step = lambda: (before(), variants.append(runtime.graph_variant()))[0]
    with torch.no_grad():
        for run in range(2):  # the first run fills; the second finds nothing cold
            hits = sum(c.hits for c in runtime.counters["decode"].values())
            tokens = generate(model, inputs, TOKENS)
            assert torch.equal(tokens, expected)
            assert variants and set(variants) == {"settled"}
            assert len(runtime.cache.where) == len(offloaded) * runtime.num_experts
            # every pair of every step a hit: whole steps' worth, at least one per step seen (the capture's
            # self-check and a step launched ahead then taken back are counted too)
            counted = sum(c.hits for c in runtime.counters["decode"].values()) - hits
            per_step = len(offloaded) * runtime.top_k
            assert counted % per_step == 0 and len(variants) <= counted // per_step <= len(variants) + 1
            variants.clear()
    assert sum(c.misses + c.late for c in runtime.counters["decode"].values()) == 0
    assert runtime.summary()["bytes_host_reads_decode"] == 0 and runtime.summary()["decode_settled"]
    stats = decoder_of(model).stats()
    assert stats["decode_check_failures"] == 0 and stats["decode_check_max_difference"] == 0.0


def test_a_budget_short_of_every_expert_does_not_fill(case):
    """One slab short of every offloaded expert: nothing is filled, decode's misses read the host as before."""
    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(2.5), pinned_layers=1,
                    graphs="replay", **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    assert runtime.num_slabs < len(runtime.offloaded_layers()) * runtime.num_experts and not runtime.plan.fill_slabs
    with torch.no_grad():
        assert torch.equal(generate(model, inputs, TOKENS), expected)
    assert not runtime.summary()["decode_settled"]
    decode = runtime.counters["decode"].values()
    assert sum(c.misses + c.late for c in decode) > 0  # decode still misses: nothing filled the cold experts
    assert len(runtime.cache.where) <= runtime.num_slabs


def test_a_picture_prompt_runs_from_its_host_facts_without_reading_the_device(case, monkeypatch):
    """A fresh picture prompt's positions and visual rows are read on the host before its forward (host_prompt.py):
    the forward itself then reads nothing back (the model's own forward reads several times, which the same
    detector sees), and its tokens stay the reference model's."""
    from vismmoe_kt.engine import runner as runner_module

    model_dir, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4), graphs="replay", **CPU)
    watched, rows = [], []
    forward = runner_module.ModelRunner._forward_from_host

    def watching(self, inputs, host, view):
        rows.append(self.engine.context.model_pass.prefill[0].host)
        with DeviceReads() as mode:
            out = forward(self, inputs, host, view)
        watched.append(mode.syncing)
        return out
    monkeypatch.setattr(runner_module.ModelRunner, "_forward_from_host", watching)
    with torch.no_grad():
        generate(model, inputs, 2)  # the vision tower's first picture of this size: eager, then captured
        decode_engine(model).forget()  # the prompt again, whole (not a next turn continuing the first's history)
        tokens = generate(model, inputs, TOKENS)
    assert torch.equal(tokens, expected)
    assert len(watched) == 2 and watched[1] == [], watched
    host = rows[1]  # the facts the ModelPass carried: transformers' own positions and the image tokens' rows
    positions, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                  image_grid_thw=inputs["image_grid_thw"])
    assert torch.equal(host.position_ids, positions) and host.rope_delta == int(delta)
    image = torch.nonzero(inputs["input_ids"][0] == model.config.image_token_id, as_tuple=True)[0]
    assert torch.equal(host.visual_rows, image) and host.visual_tokens == image.numel() > 0
    with torch.no_grad(), DeviceReads() as mode:  # the model's own forward of the same prompt
        model(**inputs, use_cache=False)
    assert "aten::_local_scalar_dense" in mode.syncing


class WindowReads(DeviceReads):
    """DeviceReads while `open`, plus the host reads no dispatched op shows on the CPU (.tolist, .cpu, .numpy), and
    the copies a GPU makes wait that the CPU does not make at all: a Python value made a tensor (`torch.tensor`, and
    `x[rows] = 1.0`, whose scalar CUDA copies from pageable host memory, waiting for everything queued)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.open = False
        for name in ("tolist", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._watching(name, getattr(torch.Tensor, name)))

    def _watching(self, name, method):
        def watched(tensor, *args, **kwargs):
            if self.open:
                self.syncing.append(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)
        return watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.open:
            return func(*args, **(kwargs or {}))
        if func._schema.name == "aten::lift_fresh":  # a Python value made a tensor: on a GPU, a pageable copy
            self.syncing.append("a host value made a tensor")  # that waits for the stream (`x[i] = 1.0` too)
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("compression,source", [("affinity", "vision"), ("saliency", "vision"), ("random", "vision"),
                                                ("affinity", "llm")])
def test_a_picture_prompt_prunes_from_its_host_facts_without_reading_the_device(case, monkeypatch, compression, source):
    """The default rules prune visual tokens after the pinned prefix. From the prompt's host facts the prune (the
    saliency, vision tower's or FastV's, the choice, the kept rows and DeepStack features) reads nothing back, so on a
    GPU the host goes on issuing layers instead of waiting for the tower and the prefix; it keeps what the
    device-reading path keeps (transformers' own call of the model, no host facts)."""
    model_dir, inputs, _ = case
    rules = yaml.safe_load(Path("optimize_rules/qwen3vl.yaml").read_text())
    for rule in rules:
        if rule["replace"]["class"].endswith(".VisDecoder"):
            rule["replace"]["kwargs"]["saliency_source"] = source
    model, _ = load(model_dir, rules, expert_budget=budget(2), miss_policy="wait", compression=compression, **CPU)
    forward = model.vismmoe.context.text_forward
    reads = WindowReads(monkeypatch)
    hosts, chosen, keep_for_real, prefix_for_real = [], [], forward._keep, forward._prefix_attention

    def keep(visual, prefix, host):
        hosts.append(host is not None)
        reads.open = True  # until the first pruned layer starts
        chosen.append(keep_for_real(visual, prefix, host))
        return chosen[-1]

    def prefix_attention(*args):  # FastV's saliency, a layer before the prune
        reads.open = True
        try:
            return prefix_for_real(*args)
        finally:
            reads.open = False

    monkeypatch.setattr(forward, "_keep", keep)
    monkeypatch.setattr(forward, "_prefix_attention", prefix_attention)
    forward.layers[forward._prune_at()].register_forward_pre_hook(lambda *_: setattr(reads, "open", False))
    with torch.no_grad():
        with reads:
            generate(model, inputs, 2)
        model(**inputs)
    assert hosts == [True, False] and reads.syncing == []
    (from_host, kept), (from_device, _) = chosen
    assert torch.equal(from_device, from_host)
    visual = inputs["input_ids"][0] == model.config.image_token_id
    assert int(visual[from_host].sum()) == int(visual.sum()) // 2  # keep_ratio 0.5 of the rule file
    # the kept visual tokens' indices among the visual tokens, in order: what DeepStack's features are taken by
    assert torch.equal(kept, torch.cumsum(visual.long(), 0)[from_host][visual[from_host]] - 1)
    stats = forward.stats()
    assert 0 < stats["prefix_experts_visual_kept"] <= stats["prefix_experts_visual_all"]


def test_a_picture_prompt_whose_ids_miss_its_pictures_is_a_clear_error(case):
    from vismmoe_kt.engine.host_prompt import host_prompt
    from vismmoe_kt.errors import InputError
    from vismmoe_kt.models import adapter_for

    model_dir, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget(4), **CPU)
    adapter = adapter_for(model.config.model_type)
    ids = inputs["input_ids"].clone()
    ids[0, torch.nonzero(ids[0] == model.config.image_token_id)[0]] = 0  # one image token fewer
    with pytest.raises(InputError, match="image tokens but its pictures' grids give"):
        host_prompt(model, adapter, {**inputs, "input_ids": ids})
    text = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    assert host_prompt(model, adapter, text) is None  # no picture: the model's own forward reads nothing back
