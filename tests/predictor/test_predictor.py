"""Lookahead predictor: Eq. 9 targets, training on a learnable synthetic trace, Hot Recall, save/load."""

import pytest
import torch

from vismmoe_kt.predictor.model import (LookaheadPredictor, PredictorConfig, hot_recall, paper_targets, samples_from_steps,
                                  train, window_targets)


def active(*layers, experts=6):
    out = torch.zeros(len(layers), experts, dtype=torch.bool)
    for i, used in enumerate(layers):
        out[i, list(used)] = True
    return out


def test_paper_targets_by_hand():
    a = active({0}, {1, 2}, {2, 3}, {3, 4}, {5})
    # layer 0, W = 3, gamma = 0.5: d=1 -> {1,2}: 1.0; d=2 -> {2,3}: 0.5; d=3 -> {3,4}: 0.25; max per expert
    assert paper_targets(a, 0, 3, 0.5).tolist() == [0.0, 1.0, 1.0, 0.5, 0.25, 0.0]
    # near the last layer the window is cut: layer 3, only d=1 exists
    assert paper_targets(a, 3, 5, 0.8).tolist() == [0, 0, 0, 0, 0, 1.0]
    assert window_targets(a, 3, 2).tolist() == [[0, 0, 0, 0, 0, 1.0], [0] * 6]
    with pytest.raises(ValueError, match="gamma"):
        paper_targets(a, 0, 3, 0.0)


def synthetic_steps(n, layers=6, experts=32, top=4, hidden=16, seed=0, world=0):
    """A learnable trace: each step has a hidden 'theme'; each layer's experts follow from the theme.
    `world` fixes the themes and their routes (shared by train and held-out data); `seed` the samples."""
    w = torch.Generator().manual_seed(1000 + world)
    table = torch.stack([torch.stack([torch.randperm(experts, generator=w)[:top] for _ in range(layers)]) for _ in range(8)])
    themes = torch.randn(8, hidden, generator=w)
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(n):
        theme = int(torch.randint(8, (1,), generator=g))
        a = torch.zeros(layers, experts, dtype=torch.bool)
        for layer in range(layers):
            a[layer, table[theme, layer]] = True
        steps.append({"active": a, "hidden": themes[theme].expand(layers, -1) + 0.1 * torch.randn(layers, hidden, generator=g),
                      "visual": themes[theme] * 0.5})
    return steps


@pytest.mark.parametrize("output", ["window", "vector"])
def test_trained_predictor_beats_random_and_history_only_is_measured(output):
    config = PredictorConfig(num_layers=6, num_experts=32, hidden_size=16, visual_size=16, window=3, width=64,
                             history_dim=32, output=output)
    train_data = samples_from_steps(synthetic_steps(300, seed=1), config)
    held_out = samples_from_steps(synthetic_steps(100, seed=2), config)
    logs = []
    model, log = train(config, train_data, held_out, epochs=60, budget=4, progress=logs.append)
    assert log[-1]["loss"] < log[0]["loss"] and logs == log
    ours, random = hot_recall(model, held_out, 4), hot_recall(None, held_out, 4)
    assert random < 0.25 and ours > random + 0.4  # a real margin, not noise
    history_only, _ = train(PredictorConfig(**{**config.__dict__, "use_features": False}), train_data, held_out,
                            epochs=20, budget=4)
    assert 0.0 <= hot_recall(history_only, held_out, 4) <= 1.0


def test_priorities_rank_layer_expert_pairs_within_the_window():
    config = PredictorConfig(num_layers=6, num_experts=4, hidden_size=2, visual_size=2, window=2, gamma=0.5)
    model = LookaheadPredictor(config)
    scores = torch.tensor([[10.0, -10, -10, -10], [-10, 10, -10, -10]])  # d=1: expert 0, d=2: expert 1
    items = model.priorities(2, scores, moe_layers=6, top=2)
    assert [key for key, _ in items] == [(3, 0), (4, 1)] and items[0][1] > items[1][1]
    assert model.priorities(5, scores, moe_layers=6, top=2) == []   # last layer: nothing ahead
    assert sorted(k for k, _ in model.priorities(4, scores, moe_layers=6, top=8)) == [(5, 0), (5, 1), (5, 2), (5, 3)]


def test_save_load_round_trip_and_shape_check(tmp_path):
    config = PredictorConfig(num_layers=4, num_experts=8, hidden_size=6, visual_size=5, window=2, width=16, history_dim=8)
    model = LookaheadPredictor(config).eval()
    path = tmp_path / "predictor.pt"
    model.save(path)
    again = LookaheadPredictor.load(path, expect={"num_layers": 4, "num_experts": 8, "hidden_size": 6})
    x = (torch.tensor([1, 2]), torch.rand(2, config.history_length, 8), torch.rand(2, 6), torch.rand(2, 5))
    assert torch.equal(model(*x), again(*x))
    with pytest.raises(ValueError, match="trained for num_experts=8, this model has 128"):
        LookaheadPredictor.load(path, expect={"num_experts": 128})
    (tmp_path / "junk.pt").write_bytes(b"not a predictor")
    with pytest.raises(ValueError, match="unreadable"):
        LookaheadPredictor.load(tmp_path / "junk.pt")


def test_generation_with_the_predictor_matches_the_reference(tmp_path, reference, image_inputs, tiny_dir):
    """Prediction changes what is copied when, never the result: smallest budget, evictions every step."""
    from vismmoe_kt import load
    from vismmoe_kt.core.stats import collect_stats
    from vismmoe_kt.demo.tiny import SPECS

    spec = SPECS["tiny-4x16"]
    config = PredictorConfig(num_layers=spec.layers, num_experts=spec.experts, hidden_size=spec.hidden,
                             visual_size=spec.hidden, window=2, width=32, history_dim=16)
    LookaheadPredictor(config).save(tmp_path / "predictor.pt")
    from conftest import layer_bytes

    layer = layer_bytes(spec)
    model, _ = load(tiny_dir, "optimize_rules/qwen3vl.yaml", generate_device="cpu", prefill_device="cpu", progress=False,
                    expert_budget=2 * layer, keep_ratio=1.0, miss_policy="wait", predictor=str(tmp_path / "predictor.pt"),
                    prefetch_topk=6)
    with torch.no_grad():
        tokens = model.generate(**image_inputs, max_new_tokens=32, do_sample=False)
        expected = reference[0].generate(**image_inputs, max_new_tokens=32, do_sample=False)
    assert torch.equal(tokens, expected)
    stats = collect_stats(model)["operators"]["VisExperts"]
    assert stats["prefetches"] > 0 and stats["evictions"] > 0


def test_a_predictor_for_another_model_is_refused(tmp_path, tiny_dir):
    from vismmoe_kt import load
    from vismmoe_kt.errors import RuleError

    config = PredictorConfig(num_layers=4, num_experts=128, hidden_size=64, visual_size=64)
    LookaheadPredictor(config).save(tmp_path / "other.pt")
    with pytest.raises(RuleError, match="trained for num_experts=128, this model has 16"):
        load(tiny_dir, "optimize_rules/qwen3vl.yaml", generate_device="cpu", prefill_device="cpu", progress=False,
             predictor=str(tmp_path / "other.pt"))


def test_previous_token_feature_follows_requests():
    """The previous decode token's experts at l+1..l+W: zeros after a prefill step or at a new request."""
    config = PredictorConfig(num_layers=3, num_experts=6, hidden_size=2, visual_size=1, window=2, width=8)
    def step(phase, used, new=False):
        return {"active": active(*used), "hidden": torch.zeros(3, 2), "visual": torch.zeros(1), "phase": phase,
                "new_request": new}
    steps = [step("prefill", ({0}, {1}, {2})), step("decode", ({0}, {1}, {3})), step("decode", ({0}, {2}, {4})),
             step("decode", ({5}, {5}, {5}), new=True)]
    data = samples_from_steps(steps, config)  # 2 rows (layers 0, 1) per step
    assert data.previous[0:4].sum() == 0  # step 0: a prefill; step 1: follows the prefill
    # step 2, layer 0: the previous token used expert 1 at layer 1 and expert 3 at layer 2
    assert data.previous[4].tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]]
    assert data.previous[6:8].sum() == 0  # a new request


def test_predictors_saved_before_the_new_features_still_load(tmp_path):
    old = PredictorConfig(num_layers=4, num_experts=8, hidden_size=4, visual_size=2, window=2, width=16,
                          layer_heads=0, previous_token=False)
    model = LookaheadPredictor(old)
    path = tmp_path / "old.pt"
    model.save(path)
    blob = torch.load(path, weights_only=True)
    for key in ("layer_heads", "previous_token"):  # what an older version wrote
        del blob["config"][key]
    torch.save(blob, path)
    loaded = LookaheadPredictor.load(path)
    assert loaded.config.layer_heads == 0 and not loaded.config.previous_token
    args = (torch.tensor([1]), torch.zeros(1, 3, 8), torch.randn(1, 4), torch.randn(1, 2))
    torch.testing.assert_close(loaded(*args), model.eval()(*args))


def test_serving_feeds_the_previous_token_as_training_does():
    """PredictorPrefetch builds the previous-token feature from the runtime's decode history the way
    samples_from_steps builds it from a trace."""
    from types import SimpleNamespace

    from vismmoe_kt.predictor.prefetch import PredictorPrefetch

    config = PredictorConfig(num_layers=4, num_experts=6, hidden_size=2, visual_size=1, window=2, width=8)
    policy = PredictorPrefetch(LookaheadPredictor(config), top_b=4)
    previous = active({0}, {1, 2}, {3}, {4, 5})
    runtime = SimpleNamespace(moe_layers=[0, 2, 4, 6], num_experts=6, device=torch.device("cpu"),
                              last_routed={0: [0], 2: [1, 2], 4: [3], 6: [4, 5]})
    served = policy._previous_token(runtime, 1, decoding=True)[0]
    assert torch.equal(served, window_targets(previous, 1, 2))
    assert policy._previous_token(runtime, 1, decoding=False).sum() == 0  # prefill: none
