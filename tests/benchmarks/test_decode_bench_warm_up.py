"""benchmarks/decode_bench.py's warm-up: requests before the reps until one captures no new decode graph, so that
no rep pays a capture (a trial settling mid-request changes the step's variant, and the spans that request had
already passed are captured in the next one), the reps then replaying the same requests' routing whatever the count;
and a prompt benchmark's configuration without a GGUF loading the synthetic model with decode_bench's own
arguments."""

import types

import pytest

from benchmarks.bench import prompt_setup, timing


class FakeRouting:
    """A routing source's request counter (what seeds the synthetic routing), moved on by requests and by skip."""

    def __init__(self, requests: int):
        self.requests = requests

    def skip(self, count: int) -> None:
        assert count >= 0
        self.requests += count


def fake_model(requests: int = 0):
    """What warm_up reads of a loaded model: its context's routing source."""
    context = types.SimpleNamespace(routing=FakeRouting(requests))
    return types.SimpleNamespace(vismmoe=types.SimpleNamespace(context=context))


def run_warm_up(monkeypatch, model, captured_after, **kwargs):
    counts = iter(captured_after)
    state = {"captured": 0, "requests": 0}

    def fake_generate(model, inputs, tokens):
        assert tokens == 127  # each warm-up has the measured length
        state["requests"] += 1
        model.vismmoe.context.routing.requests += 1  # the routing source's seed moves on with every request
        state["captured"] = next(counts)

    monkeypatch.setattr(timing, "timed_generate", fake_generate)
    monkeypatch.setattr(timing, "captured_segments", lambda model: state["captured"])
    ran = timing.warm_up(model, {}, 127, **kwargs)
    assert state["requests"] == ran
    return ran


@pytest.mark.parametrize("captured_after,runs", [
    ([0], 1),            # eager decode: nothing is ever captured, one request suffices
    ([2, 2], 2),         # every variant captured in the first request: the second captures nothing
    ([3, 4, 4], 3),      # the trial settled in the first: the next request captured the variant's other span
    ([2, 3, 4], 1 + timing.EXTRA_WARM_UPS),  # still capturing: stops after the extra ones
])
def test_decode_bench_warms_up_while_a_request_captured_a_graph(monkeypatch, captured_after, runs):
    model = fake_model()
    assert run_warm_up(monkeypatch, model, captured_after, at_least=1, extra=timing.EXTRA_WARM_UPS) == runs
    # whatever the count, the reps replay the same requests' routing in every configuration
    assert model.vismmoe.context.routing.requests == 1 + timing.EXTRA_WARM_UPS


def test_the_bench_runs_its_warm_ups_then_more_while_they_capture(monkeypatch):
    """`vismmoe-kt bench --warmup 2`: two requests even without a capture; a third and fourth while capturing; the
    routing counted on from where the size's warm-ups began; --warmup 0 runs nothing and leaves the routing."""
    model = fake_model(requests=5)  # an earlier image size's requests
    assert run_warm_up(monkeypatch, model, [2, 2], at_least=2, extra=2) == 2
    assert model.vismmoe.context.routing.requests == 5 + 4
    model = fake_model()
    assert run_warm_up(monkeypatch, model, [2, 3, 4, 4], at_least=2, extra=2) == 4
    model = fake_model(requests=3)
    assert run_warm_up(monkeypatch, model, [], at_least=0) == 0
    assert model.vismmoe.context.routing.requests == 3


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


@pytest.mark.parametrize("graphs,runs", [("replay", 2), ("off", 1)])
def test_a_real_models_warm_up_stops_once_a_request_captured_nothing(tiny_dir, image_inputs, graphs, runs):
    """On a tiny model (the engine's real counters): graphed decode captures in the first request and not in the
    second; eager decode captures nothing, so one request is enough."""
    from vismmoe_kt import load

    model, _ = load(tiny_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget="1GiB", graphs=graphs,
                    generate_device="cpu", prefill_device="cpu", progress=False)
    assert timing.warm_up(model, dict(image_inputs), 3) == runs
    assert (timing.captured_segments(model) > 0) == (graphs == "replay")
