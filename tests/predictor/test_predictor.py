"""Lookahead predictor: Eq. 9 targets, training on a learnable synthetic trace, Hot Recall, save/load."""

import pytest
import torch

from vismmoe_kt.predictor.model import (LookaheadPredictor, PredictorConfig, hot_recall, paper_targets, recent_table,
                                        samples_from_steps, train, window_targets)


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
                          layer_heads=0, previous_token=False, recent=False)
    model = LookaheadPredictor(old)
    path = tmp_path / "old.pt"
    model.save(path)
    blob = torch.load(path, weights_only=True)
    for key in ("layer_heads", "previous_token", "recent", "recent_decay", "recent_width", "hidden_source"):
        del blob["config"][key]  # what an older version wrote
    assert not any(k.startswith("recent") for k in blob["state"])
    torch.save(blob, path)
    loaded = LookaheadPredictor.load(path)
    assert loaded.config.layer_heads == 0 and not loaded.config.previous_token
    assert not loaded.config.recent and loaded.config.hidden_source == "model"
    args = (torch.tensor([1]), torch.zeros(1, 3, 8), torch.randn(1, 4), torch.randn(1, 2))
    torch.testing.assert_close(loaded(*args), model.eval()(*args))
    recent = torch.rand(1, 2, 8)  # the runtime may pass the feature to any predictor: an old one ignores it
    torch.testing.assert_close(loaded(*args, None, recent), model(*args))


def test_serving_feeds_the_previous_token_as_training_does():
    """PredictorPrefetch builds the previous-token feature from the steps it observed (every MoE layer,
    a pinned prefix included) the way samples_from_steps builds it from a trace: none in a prefill or
    for the first decode token after it."""
    from types import SimpleNamespace

    from vismmoe_kt.predictor.prefetch import PredictorPrefetch

    config = PredictorConfig(num_layers=4, num_experts=6, hidden_size=2, visual_size=1, window=2, width=8)
    policy = PredictorPrefetch(LookaheadPredictor(config), top_b=4)
    runtime = SimpleNamespace(moe_layers=[0, 2, 4, 6], num_experts=6, device=torch.device("cpu"))

    def observe_step(used, tokens=1):
        for layer, experts in zip(runtime.moe_layers, used):
            policy.observe(runtime, layer, torch.tensor([sorted(experts)] * tokens))
    observe_step(({0, 1}, {1, 2}, {2, 3}, {3, 4}), tokens=3)  # a prefill
    assert policy._previous_token(runtime, 1, decoding=False).sum() == 0
    observe_step(({0}, {1, 2}, {3}, {4, 5}))
    assert policy._previous_token(runtime, 1, decoding=True).sum() == 0  # the first decode token: none
    previous = active({0}, {1, 2}, {3}, {4, 5})
    observe_step(({1}, {0, 2}, {4}, {5, 0}))
    assert torch.equal(policy._previous_token(runtime, 1, decoding=True)[0], window_targets(previous, 1, 2))
    assert torch.equal(policy._previous_token(runtime, 0, decoding=True)[0], window_targets(previous, 0, 2))


def test_recent_usage_feature_is_the_ema_of_the_request_s_decode_tokens():
    """recent (L, E): zeros when a request's decode starts, then lam * recent + (1 - lam) * each decode
    token's experts; the feature at layer l is rows l+1..l+W (zeros past the last layer)."""
    lam = 0.75
    config = PredictorConfig(num_layers=3, num_experts=6, hidden_size=2, visual_size=1, window=2, width=8,
                             recent_decay=lam)

    def step(phase, used, new=False):
        return {"active": active(*used), "hidden": torch.zeros(3, 2), "visual": torch.zeros(1), "phase": phase,
                "new_request": new}
    a, b, c = ({0}, {1}, {3}), ({0}, {2}, {4}), ({1}, {2}, {5})
    steps = [step("prefill", ({0, 1}, {1, 2}, {2, 3})), step("decode", a), step("decode", b), step("decode", c),
             step("prefill", ({4}, {4}, {4})), step("decode", ({5}, {5}, {5})), step("decode", a, new=True)]
    data = samples_from_steps(steps, config)  # 2 rows (layers 0, 1) per step
    assert data.recent.dtype == torch.float32 and data.recent.shape == (14, 2, 6)
    assert data.decode.tolist() == [False] * 2 + [True] * 6 + [False] * 2 + [True] * 4

    def rows(table, layer):  # rows layer+1 .. layer+2 of a (3, 6) table, zeros past the last layer
        out = torch.zeros(2, 6)
        for d in range(2):
            if layer + 1 + d < 3:
                out[d] = table[layer + 1 + d]
        return out
    A, B = active(*a).float(), active(*b).float()
    after_a = (1 - lam) * A
    after_b = lam * (1 - lam) * A + (1 - lam) * B
    assert data.recent[0:4].sum() == 0                  # the prefill, and the first decode token
    for layer in (0, 1):
        torch.testing.assert_close(data.recent[4 + layer], rows(after_a, layer))  # b sees a
        torch.testing.assert_close(data.recent[6 + layer], rows(after_b, layer))  # c sees a, then b
    assert data.recent[8:12].sum() == 0                 # a new prompt: the table starts again
    assert data.recent[12:14].sum() == 0                # a step flagged as a new request, too
    torch.testing.assert_close(recent_table([active(*a), active(*b)], lam), after_b)
    assert recent_table([active(*a), active(*b)], lam)[1].tolist() == [0, lam * (1 - lam), 1 - lam, 0, 0, 0]


def test_recent_usage_reaches_the_scores_and_none_means_zeros():
    config = PredictorConfig(num_layers=4, num_experts=8, hidden_size=3, visual_size=2, window=2, width=16,
                             history_dim=8)
    torch.manual_seed(0)
    model = LookaheadPredictor(config).eval()
    args = (torch.tensor([1, 2]), torch.zeros(2, 3, 8), torch.randn(2, 3), torch.randn(2, 2), torch.zeros(2, 2, 8))
    zeros = torch.zeros(2, 2, 8)
    recent = torch.zeros(2, 2, 8)
    recent[:, :, 3] = 0.5
    with torch.no_grad():
        torch.testing.assert_close(model(*args), model(*args, zeros))
        assert not torch.allclose(model(*args, recent), model(*args, zeros))
        assert model(*args, recent).shape == (2, 2, 8)
    without = LookaheadPredictor(PredictorConfig(**{**config.__dict__, "recent": False})).eval()
    assert not hasattr(without, "recent_net")
    with torch.no_grad():
        torch.testing.assert_close(without(*args, recent), without(*args))  # a predictor without it ignores it


def test_bad_recent_decay_and_hidden_source_are_refused():
    base = dict(num_layers=4, num_experts=8, hidden_size=3, visual_size=2)
    with pytest.raises(ValueError, match="recent_decay"):
        LookaheadPredictor(PredictorConfig(**base, recent_decay=1.0))
    with pytest.raises(ValueError, match="hidden_source"):
        LookaheadPredictor(PredictorConfig(**base, hidden_source="latent"))


def test_a_predictor_with_recent_usage_round_trips(tmp_path):
    config = PredictorConfig(num_layers=4, num_experts=8, hidden_size=3, visual_size=1, window=2, width=16,
                             history_dim=8, recent_decay=0.5, hidden_source="synthetic")
    model = LookaheadPredictor(config).eval()
    model.save(tmp_path / "p.pt")
    again = LookaheadPredictor.load(tmp_path / "p.pt")
    assert again.config == config
    args = (torch.tensor([0, 2]), torch.zeros(2, 3, 8), torch.randn(2, 3), torch.zeros(2, 1), torch.zeros(2, 2, 8),
            torch.rand(2, 2, 8))
    with torch.no_grad():
        assert torch.equal(model(*args), again(*args))


def test_serving_keeps_the_recent_usage_table_as_training_builds_it():
    """PredictorPrefetch folds each decode step into its table as samples_from_steps does, and a prompt
    empties it."""
    from types import SimpleNamespace

    from vismmoe_kt.predictor.prefetch import PredictorPrefetch

    config = PredictorConfig(num_layers=4, num_experts=6, hidden_size=2, visual_size=1, window=2, width=8,
                             recent_decay=0.6)
    policy = PredictorPrefetch(LookaheadPredictor(config), top_b=4)
    runtime = SimpleNamespace(moe_layers=[0, 2, 4, 6], num_experts=6, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    prompt = [torch.randint(6, (5, 2), generator=g) for _ in range(4)]  # 5 tokens, top-2, per layer
    tokens = [[torch.randint(6, (1, 2), generator=g) for _ in range(4)] for _ in range(4)]
    steps = [{"active": torch.stack([torch.zeros(6, dtype=torch.bool).index_fill_(0, ids.flatten(), True)
                                     for ids in routed]),
              "hidden": torch.zeros(4, 2), "visual": torch.zeros(1), "phase": phase}
             for phase, routed in [("prefill", prompt)] + [("decode", t) for t in tokens]]
    data = samples_from_steps(steps, config)
    for s, (_, routed) in enumerate([("prefill", prompt)] + [("decode", t) for t in tokens]):
        for index, ids in enumerate(routed):
            policy.observe(runtime, runtime.moe_layers[index], ids)
            if index < 3:  # the feature the policy would feed at this layer
                served = policy._recent[index + 1:index + 3]
                torch.testing.assert_close(served, data.recent[3 * s + index])
    assert data.recent[-3:].abs().sum() > 0
    policy.observe(runtime, 0, prompt[0])  # a new prompt
    assert policy._recent.sum() == 0
