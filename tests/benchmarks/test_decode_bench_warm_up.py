"""benchmarks/decode_bench.py's warm-up: requests before the reps until one captures no new decode graph, so that
no rep pays a capture (a trial settling mid-request changes the step's variant, and the spans that request had
already passed are captured in the next one), the reps then replaying the same requests' routing whatever the count;
and a prompt benchmark's configuration without a GGUF loading the synthetic model with decode_bench's own
arguments."""

import types

import pytest

from benchmarks import decode_bench
from benchmarks.bench import prompt_setup


@pytest.mark.parametrize("captured_after,runs", [
    ([0], 1),            # eager decode: nothing is ever captured, one request suffices
    ([2, 2], 2),         # every variant captured in the first request: the second captures nothing
    ([3, 4, 4], 3),      # the trial settled in the first: the next request captured the variant's other span
    ([2, 3, 4], decode_bench.WARM_UPS),  # still capturing: stops at WARM_UPS requests
])
def test_warm_up_repeats_while_a_request_captured_a_graph(monkeypatch, captured_after, runs):
    counts = iter([0] + captured_after)
    state = {"captured": next(counts), "requests": 0}

    def fake_generate(model, inputs, tokens):
        assert tokens == 127  # each warm-up has the measured length
        state["requests"] += 1
        model.vismmoe.context.routing.requests += 1  # the routing source's seed moves on with every request
        state["captured"] = next(counts)

    monkeypatch.setattr(decode_bench, "timed_generate", fake_generate)
    monkeypatch.setattr(decode_bench, "_captured", lambda model: state["captured"])
    routing = types.SimpleNamespace(requests=0)
    model = types.SimpleNamespace(vismmoe=types.SimpleNamespace(context=types.SimpleNamespace(routing=routing)))
    assert decode_bench.warm_up(model, {}, 127) == runs
    assert state["requests"] == runs
    # whatever the count, the reps replay the same requests' routing in every configuration
    assert routing.requests == decode_bench.WARM_UPS


def test_a_configuration_without_a_gguf_loads_the_synthetic_model_with_decode_bench_arguments(monkeypatch):
    seen = {}

    def fake_load(args, config):  # decode_bench.load_model reads these for the synthetic model
        seen.update(layers=args.layers, dtype=args.dtype, narrow=args.narrow, rules=config.rule_file)
        return "model", "processor"

    monkeypatch.setattr(prompt_setup, "load_model", fake_load)
    args = types.SimpleNamespace(device="cpu", routing="synthetic", tiny=None, layers=2,
                                 config="lru:expert_budget=6GiB,store_dtype=q4_k")
    assert prompt_setup.load_prompt_model(None, args, "test-") == ("model", "processor")
    assert seen == {"layers": 2, "dtype": "bfloat16", "narrow": False, "rules": "optimize_rules/qwen3vl-lru.yaml"}
