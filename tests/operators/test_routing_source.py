"""Routing sources on a loaded model: `model` changes nothing, a trace is replayed exactly (prefill and
decode, lean path and transformers' loop), synthetic routing ignores the generated tokens, and a pruned
prefill's later layers get the kept positions' rows (re-routed ones under the affinity what-if)."""

import pytest
import torch

from conftest import layer_bytes
from vismmoe_kt import load
from vismmoe_kt.apps.cli import main
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.operators.source_router import install_routing
from vismmoe_kt.errors import InputError
from vismmoe_kt.routing import SyntheticRouter, load_trace, save_trace, synthetic_trace
from vismmoe_kt.routing.affinity import Survivors
from vismmoe_kt.runtime.offload import OffloadRuntime

CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False)
TOKENS = 6
SPEC = SPECS["tiny-4x16"]


def offload(tiny_dir, **extra):
    return load(tiny_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=2 * layer_bytes(SPEC), **CPU, **extra)


@pytest.fixture
def seen(monkeypatch):
    """Every (layer, rows of expert ids) the offload runtime is asked to compute, in order."""
    calls = []
    original = OffloadRuntime.run_layer

    def spy(self, layer, hidden, top_k_index, top_k_weights, act):
        calls.append((layer, top_k_index.detach().clone()))
        return original(self, layer, hidden, top_k_index, top_k_weights, act)
    monkeypatch.setattr(OffloadRuntime, "run_layer", spy)
    return calls


def test_model_routing_changes_nothing(tiny_dir, image_inputs):
    plain, _ = offload(tiny_dir)
    routed, _ = offload(tiny_dir)
    install_routing(routed, "model")
    with torch.no_grad():
        assert torch.equal(generate(plain, image_inputs, TOKENS), generate(routed, image_inputs, TOKENS))
        assert torch.equal(plain(**image_inputs).logits, routed(**image_inputs).logits)


@pytest.mark.parametrize("decode", ["lean", "hf"])
def test_a_trace_is_replayed_exactly(tiny_dir, image_inputs, tmp_path, seen, decode):
    prompt = image_inputs["input_ids"].shape[1]
    ids = synthetic_trace(prompt + TOKENS, layers=SPEC.layers, experts=SPEC.experts, top_k=SPEC.top_k, seed=3)
    path = tmp_path / "trace.safetensors"
    save_trace(path, ids)
    model, _ = offload(tiny_dir, decode=decode)
    install_routing(model, f"trace:{path}")
    with torch.no_grad():
        generate(model, image_inputs, TOKENS)
    file = load_trace(path).ids
    prefill = [(layer, rows) for layer, rows in seen if rows.shape[0] == prompt]
    decode_calls = [(layer, rows) for layer, rows in seen if rows.shape[0] == 1]
    assert len(prefill) == SPEC.layers and len(decode_calls) == SPEC.layers * (TOKENS - 1)
    for layer, rows in prefill:
        assert torch.equal(rows, file[:prompt, layer])
    for step, (layer, rows) in enumerate(decode_calls):
        assert torch.equal(rows[0], file[prompt + step // SPEC.layers, layer])


def test_synthetic_routing_does_not_depend_on_the_generated_tokens(tiny_dir, image_inputs):
    tables = []
    for sampling in ({"do_sample": False}, {"do_sample": True, "temperature": 1.5}):
        model, _ = offload(tiny_dir)
        source = install_routing(model, "synthetic:7")
        torch.manual_seed(0)
        with torch.no_grad():
            generate(model, image_inputs, TOKENS, **sampling)
        tables.append(source.history[0]["ids"])
    assert torch.equal(*tables)
    prompt = image_inputs["input_ids"].shape[1]
    visual = (image_inputs["input_ids"][0] == model.config.image_token_id).to(torch.uint8)
    expected = synthetic_trace(prompt, layers=SPEC.layers, experts=SPEC.experts, top_k=SPEC.top_k,
                               phase="prefill", modality=visual, seed=7)
    assert torch.equal(tables[0][:prompt], expected)  # the library's own routing of this prompt


def test_a_pruned_prefill_routes_the_kept_positions(tiny_dir, image_inputs, seen):
    model, _ = load(tiny_dir, "optimize_rules/qwen3vl.yaml", expert_budget=2 * layer_bytes(SPEC), miss_policy="wait",
                    **CPU)
    source = install_routing(model, "synthetic")
    with torch.no_grad():
        generate(model, image_inputs, 2)
    keep, prune_at = model.vismmoe.context.pruning.keep, model.vismmoe.context.pruning.prune_at
    table = source.history[0]["ids"]
    prefill = [(layer, rows) for layer, rows in seen if rows.shape[0] > 1]
    assert keep is not None and len(keep) < image_inputs["input_ids"].shape[1]
    for layer, rows in prefill:
        positions = keep if layer >= prune_at else torch.arange(image_inputs["input_ids"].shape[1])
        assert torch.equal(rows, table[positions, layer])

    # the prefix routing Algorithm 1 selects from is the source's choice, not the replaced router's own
    text_forward = next(m.text_forward for m in model.modules() if hasattr(m, "text_forward"))
    assert sorted(text_forward._routes) == list(range(prune_at))
    for layer in range(prune_at):
        got = text_forward._routes[layer]
        want = table[:got.shape[0], layer].to(got.device)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_bad_routing_specs_are_clear_errors(tiny_dir, tmp_path):
    model, _ = offload(tiny_dir)
    with pytest.raises(InputError, match="expected model, synthetic, synthetic:SEED or trace:PATH"):
        install_routing(model, "random")
    wrong = tmp_path / "wrong.safetensors"
    save_trace(wrong, synthetic_trace(10, layers=3, experts=SPEC.experts, top_k=SPEC.top_k))
    with pytest.raises(InputError, match="the routing trace has 3 layers"):
        install_routing(model, f"trace:{wrong}")
    with pytest.raises(InputError, match="no-such-file"):
        install_routing(model, f"trace:{tmp_path / 'no-such-file.npz'}")


def test_trace_record_then_stats(tmp_path, capsys):
    out = tmp_path / "demo-routing.safetensors"
    assert main(["trace", "record", "--demo", "--synthetic", "2", "--decode_tokens", "4", "--out", str(out)]) == 0
    trace = load_trace(out)
    assert trace.request_ids is not None and set(trace.request_ids.tolist()) == {0, 1}
    assert trace.layers == SPECS["demo-4x32"].layers and int(trace.phase.sum()) == 2 * 3  # 3 decode steps each
    assert main(["trace", "stats", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "consecutive-token overlap" in printed and "| 0.430 |" in printed  # the published figure beside it


def test_a_prepared_table_is_the_one_begin_would_make(tiny_dir, image_inputs, monkeypatch):
    """`prepare` makes the next request's synthetic table ahead (the benchmarks' clock then times the model
    alone): the request routes exactly as without it, one table is made, and a table prepared for another
    request is not taken."""
    from benchmarks.bench.timing import timed_generate
    from vismmoe_kt.operators.routing_source import RoutingSource

    plain, _ = offload(tiny_dir)
    ahead, _ = offload(tiny_dir)
    sources = [install_routing(plain, "synthetic:4"), install_routing(ahead, "synthetic:4")]
    made, original = [], RoutingSource._table
    monkeypatch.setattr(RoutingSource, "_table", lambda self, *a: made.append(self) or original(self, *a))
    with torch.no_grad():
        want = generate(plain, image_inputs, TOKENS)
        made.clear()
        sources[1].prepare(image_inputs["input_ids"], TOKENS)
        assert made == [sources[1]]
        got = generate(ahead, image_inputs, TOKENS)
        assert made == [sources[1]] and sources[1]._prepared is None  # begin took it, made none of its own
        sources[1].prepare(image_inputs["input_ids"][:, :-1], TOKENS)  # another request's length
        generate(plain, image_inputs, TOKENS)
        generate(ahead, image_inputs, TOKENS)
        timed_generate(plain, image_inputs, TOKENS - 1)
        timed_generate(ahead, image_inputs, TOKENS - 1)  # prepares before its clock, as the benchmarks run
    assert torch.equal(got, want)
    assert all(torch.equal(a["ids"], b["ids"]) for a, b in zip(*(s.history for s in sources)))
    assert len(sources[1].history) == 3


def test_a_routing_rule_routes_as_the_source_put_on_a_loaded_model(tiny_dir, image_inputs):
    """The rule `vismmoe-kt rules show --routing` prints (SourceRouter on every MoE router, first in the list)
    gives the tokens and the tables of the same source put on the loaded model."""
    import yaml

    from vismmoe_kt.core.placements import placement_rules, routing_rule
    from vismmoe_kt.core.rule_text import rule_text
    from vismmoe_kt.operators.source_router import SourceRouter

    rules = [routing_rule("qwen3vl", "synthetic:5"), *placement_rules("qwen3vl", "offload")]
    assert yaml.safe_load(rule_text("qwen3vl", "offload", "synthetic:5")) == rules
    by_rule, _ = load(tiny_dir, rules, expert_budget=2 * layer_bytes(SPEC), **CPU)
    routers = [m for m in by_rule.modules() if isinstance(m, SourceRouter)]
    assert len(routers) == SPEC.layers and len({id(r.source) for r in routers}) == 1
    put_on, _ = offload(tiny_dir)
    install_routing(put_on, "synthetic:5")
    with torch.no_grad():
        tokens = [generate(model, image_inputs, TOKENS) for model in (by_rule, put_on)]
    assert torch.equal(*tokens)
    tables = [model.vismmoe.context.routing.history[0]["ids"] for model in (by_rule, put_on)]
    assert torch.equal(*tables)

def test_rules_show_with_a_bad_routing_source_is_a_clear_error(capsys):
    assert main(["rules", "show", "--placement", "offload", "--demo", "--routing", "random"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error: --routing 'random': expected model, synthetic" in err


def test_the_affinity_what_if_reroutes_a_pruned_prefills_survivors(tiny_dir, image_inputs, seen):
    """`synthetic:affinity=A`: the prefix routes the table's rows; a pruned prefill's survivors are re-routed
    with their coherence raised by the share pruned (routing/affinity.py); the label names it."""
    model, _ = load(tiny_dir, "optimize_rules/qwen3vl.yaml", expert_budget=2 * layer_bytes(SPEC), miss_policy="wait",
                    **CPU)
    source = install_routing(model, "synthetic:affinity=0.8")
    assert source.spec == "synthetic:affinity=0.8" and source.affinity == 0.8
    with torch.no_grad():
        generate(model, image_inputs, 2)
    context = model.vismmoe.context
    keep, prune_at = context.pruning.keep, context.pruning.prune_at
    prompt = image_inputs["input_ids"].shape[1]
    table = source.history[0]["ids"]
    visual = model.vismmoe.adapter.image_token_mask(model.config, image_inputs["input_ids"][0]).cpu()
    router = SyntheticRouter(source.layers, source.experts, source.top_k, seed=0, affinity=0.8)
    routing = router.route(prompt, visual.to(torch.uint8), "prefill")
    assert torch.equal(routing.ids, table[:prompt])  # the table is the what-if router's
    survivors = Survivors(router, routing.hidden, visual)
    prefill = [(layer, rows) for layer, rows in seen if rows.shape[0] > 1]
    changed = 0
    for layer, rows in prefill:
        if layer < prune_at:
            assert torch.equal(rows, table[torch.arange(prompt), layer])
        else:
            assert torch.equal(rows, survivors.rows(layer, keep)[0])
            changed += int((rows != table[keep, layer]).any(-1).sum())
    assert prefill and changed > 0  # some survivors moved toward their image's experts


def test_a_prefill_gathers_its_tables_rows_once_for_every_layer(tiny_dir, image_inputs, seen):
    """An unpruned prefill's layers route the same positions: their rows of the routing table are gathered at the
    first layer for all (each layer's a contiguous slice), not by two gathers a layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, _ = offload(tiny_dir)
    source = install_routing(model, "synthetic:5")

    class TableReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tables = [t.untyped_storage().data_ptr() for t in (source.slot_ids, source.slot_weights) if t is not None]
            if func._schema.name == "aten::index" and isinstance(args[0], torch.Tensor) \
                    and args[0].untyped_storage().data_ptr() in tables:
                self.reads += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), TableReads() as mode:
        generate(model, image_inputs, 1)  # the prompt alone
    assert mode.reads == 2  # ids and weights, once each, for the model's SPEC.layers layers
    prompt = image_inputs["input_ids"].shape[1]
    table = source.slot_ids[0, :prompt]  # and each layer got its own column of them
    assert [layer for layer, _ in seen] == list(range(SPEC.layers))
    for layer, rows in seen:
        assert torch.equal(rows, table[:, layer])


def test_once_lru_is_kept_a_routed_step_computes_no_router_probabilities(tiny_dir, image_inputs, monkeypatch):
    """`eviction: auto` keeping lru stops the router's averages; a routing source then hands the steps no logits,
    so no layer computes a softmax over every expert for nobody. The tokens are those of a fixed ranking."""
    from vismmoe_kt.runtime.eviction import EvictionTrial

    class LruFaster:  # the trial's clock: a step under lru 20 ms, under VisMMOE's ranking 30
        def __init__(self):
            self.now, self.trial = 0.0, None

        def __call__(self):
            self.now += 0.020 if self.trial.current.name == "lru" else 0.030
            return self.now

    fixed, _ = offload(tiny_dir)
    install_routing(fixed, "synthetic")
    with torch.no_grad():
        expected = generate(fixed, image_inputs, 16, min_new_tokens=16)
    model, _ = offload(tiny_dir)
    source = install_routing(model, "synthetic")
    runtime = model.vismmoe.context.offload_runtime
    assert runtime.router_sink() is not None  # the offload file's VisMMOE ranking averages the router
    clock = LruFaster()
    trial = clock.trial = runtime.boundary.eviction = EvictionTrial(samples=2, clock=clock)
    softmaxes = []
    probabilities = model.vismmoe.adapter.router_probabilities
    monkeypatch.setattr(model.vismmoe.adapter, "router_probabilities",
                        lambda logits: (softmaxes.append(trial.reads_usage), probabilities(logits))[1])
    with torch.no_grad():
        assert torch.equal(generate(model, image_inputs, 16, min_new_tokens=16), expected)
    assert trial.trial.outcome() is not None and not trial.reads_usage  # lru kept within the decode
    assert True in softmaxes and False not in softmaxes  # softmaxes while averaging, none after
    assert source._step_rows[4] is None and not runtime.averages_router()


@pytest.mark.parametrize("routing", ["synthetic:4", "trace"])
def test_skipping_requests_routes_the_next_as_if_they_had_run(tiny_dir, image_inputs, tmp_path, routing):
    """`skip(n)`: a benchmark whose configurations ran different numbers of warm-up requests replays the same
    measured request in each: the synthetic seed moves on, and a trace without request ids is read on by n
    requests as long as the last one."""
    if routing == "trace":
        prompt = image_inputs["input_ids"].shape[1]
        path = tmp_path / "trace.safetensors"
        save_trace(path, synthetic_trace(7 * (prompt + TOKENS) + 5, layers=SPEC.layers, experts=SPEC.experts,
                                         top_k=SPEC.top_k, seed=3))
        routing = f"trace:{path}"
    ran, skipped = offload(tiny_dir)[0], offload(tiny_dir)[0]
    sources = [install_routing(ran, routing), install_routing(skipped, routing)]
    with torch.no_grad():
        for _ in range(3):
            generate(ran, image_inputs, TOKENS)
        generate(skipped, image_inputs, TOKENS)
        sources[1].skip(2)
        generate(ran, image_inputs, TOKENS)
        generate(skipped, image_inputs, TOKENS)
    assert torch.equal(sources[0].history[-1]["ids"], sources[1].history[-1]["ids"])
    assert not torch.equal(sources[0].history[-1]["ids"], sources[1].history[0]["ids"])  # a request of its own
    with pytest.raises(ValueError, match="a count of requests, 0 or more, not -1"):
        sources[1].skip(-1)
