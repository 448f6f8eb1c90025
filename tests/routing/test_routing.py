"""The synthetic router against the published Qwen3-30B-A3B routing statistics, its determinism and lazy
use, and the statistics themselves on hand-made traces.

Tolerances: calibrated statistics are checked on held-out seeds (the fit used seeds 0-15 and 1000+),
against the published figure widened by about the spread between prompts (stated per assertion).
"""

import itertools

import numpy as np
import pytest
import torch

from vismmoe_kt.routing import (SyntheticRouter, hot_set_jaccard, resolve_knobs, synthetic_routing, synthetic_trace,
                                trace_stats)
from vismmoe_kt.routing import targets
from vismmoe_kt.routing.calibration import DEFAULT_CALIBRATION, depth_interp, load_calibration
from vismmoe_kt.routing.stats import reuse_distances, reuse_shares, selection_mask

E = 128
PROMPTS, TOKENS = 8, 512


@pytest.fixture(scope="module")
def decode_prompts():
    """8 held-out prompts of 512 decode tokens, one corpus: the fit's per-prompt setting."""
    traces = [synthetic_trace(TOKENS, seed=500 + s) for s in range(PROMPTS)]
    return traces, trace_stats(torch.cat(traces), E, request_ids=torch.arange(PROMPTS).repeat_interleave(TOKENS))


def test_packaged_calibration_is_the_default():
    table = load_calibration()
    assert table["layers"] == 48 and table["experts"] == 128 and table["top_k"] == 8
    knobs = resolve_knobs(48)
    assert knobs.source == str(DEFAULT_CALIBRATION)
    assert np.allclose(knobs.rho, table["per_layer"]["rho"])


def test_decode_overlap_matches_the_published_profile(decode_prompts):
    traces, stats = decode_prompts
    overlap = np.array(stats["per_layer"]["overlap"])
    assert stats["overall"]["overlap"] == pytest.approx(0.43, abs=0.05)
    per_prompt = [np.mean(trace_stats(t, E)["per_layer"]["overlap"]) for t in traces]
    assert all(0.35 <= p <= 0.51 for p in per_prompt)           # the published per-prompt range
    assert overlap[0] < 0.15                                      # layer 0 ~ 8%: nearly independent tokens
    assert 0.50 <= overlap[6:8].mean() <= 0.65                    # 55-60%, +-0.05
    assert 0.50 <= overlap[18:32].mean() <= 0.65
    assert overlap[47] == pytest.approx(0.21, abs=0.08)
    # the published shape: low at the ends, high plateaus in between
    assert overlap[0] < overlap[47] < overlap[18:32].mean()


def test_reuse_distances_match(decode_prompts):
    _, stats = decode_prompts
    o = stats["overall"]
    assert 1.0 <= o["reuse_median"] <= 3.0                        # 2 +- 1
    assert o["reuse_next"] == pytest.approx(0.45, abs=0.06)
    assert o["reuse_within8"] == pytest.approx(0.80, abs=0.05)


def test_per_prompt_concentration_matches(decode_prompts):
    _, stats = decode_prompts
    entropy, top16 = np.array(stats["per_layer"]["entropy"]), np.array(stats["per_layer"]["top16_share"])
    assert 0.62 <= entropy[1:].mean() <= 0.82                     # published 0.62-0.81 (+0.01)
    assert 0.54 <= top16[1:].mean() <= 0.62                       # published 0.54-0.62
    assert entropy[0] == pytest.approx(0.875, abs=0.03) and entropy[0] == entropy.max()   # layer 0 most diffuse
    assert top16[0] == pytest.approx(0.41, abs=0.04) and top16[0] == top16.min()
    # a per-prompt hot set exists at all: far from uniform routing (top-16 share 16/128 = 0.125)
    assert top16.min() > 0.3


def test_corpus_hot_ratio_and_hot_sets_of_different_kinds():
    corpus = torch.cat([synthetic_trace(128, seed=3000 + s) for s in range(64)])   # one corpus, many prompts
    assert trace_stats(corpus, E)["overall"]["corpus_hot_ratio"] == pytest.approx(2.7, abs=0.3)
    kinds = [synthetic_trace(256, seed=600 + s, corpus_seed=20 + s) for s in range(6)]  # one prompt per kind
    same = [synthetic_trace(256, seed=600 + s) for s in range(6)]
    pairs = list(itertools.combinations(range(6), 2))
    across = np.mean([hot_set_jaccard(kinds[a], kinds[b], E)["mean"] for a, b in pairs])
    within = np.mean([hot_set_jaccard(same[a], same[b], E)["mean"] for a, b in pairs])
    assert 0.03 <= across <= 0.09                                 # published 0.03-0.07 (+0.02)
    assert within > across                                        # one corpus shares its skew


def test_vision_prefill_is_long_tailed():
    modality = torch.ones(1024, dtype=torch.uint8)
    ratios = np.mean([trace_stats(synthetic_trace(1024, phase="prefill", modality=modality, seed=700 + s), E,
                                  modality=modality, phase=torch.zeros(1024))["per_layer"]["vision_max_mean"]
                      for s in range(2)], axis=0)
    assert 2.0 <= ratios.min() and ratios.max() <= 12.0           # published 2-12x per layer
    assert ratios.mean() == pytest.approx(5.5, abs=1.0)           # published 5-6x
    # text tokens pooled over a corpus are nearer uniform than vision tokens
    text = torch.cat([synthetic_trace(128, seed=800 + s) for s in range(16)])
    assert trace_stats(text, E)["overall"]["corpus_hot_ratio"] < ratios.mean()


def test_seeds_make_it_deterministic():
    a_ids, a_w = synthetic_routing(200, seed=11)
    b_ids, b_w = synthetic_routing(200, seed=11)
    assert torch.equal(a_ids, b_ids) and torch.equal(a_w, b_w)
    assert not torch.equal(a_ids, synthetic_trace(200, seed=12))
    assert not torch.equal(a_ids, synthetic_trace(200, seed=11, corpus_seed=1))
    assert a_ids.shape == (200, 48, 8) and a_ids.dtype == torch.int64
    assert int(a_ids.min()) >= 0 and int(a_ids.max()) < E
    assert (a_ids.sort(-1).values.diff(dim=-1) > 0).all()        # k distinct experts per token and layer
    # phase is recorded only: the same tokens route the same way
    assert torch.equal(synthetic_trace(50, phase="prefill", seed=11), a_ids[:50])


def test_weights_are_qwen3_style_renormalised_softmax():
    router = SyntheticRouter(layers=6, experts=64, top_k=4, seed=2)
    routing = router.route(30)
    assert torch.allclose(routing.weights.sum(-1), torch.ones(30, 6))
    assert (routing.weights.diff(dim=-1) <= 0).all()              # highest logit first
    logits = router.logits(3, routing.hidden[:, 3])               # [T, E]
    top = logits.topk(4, dim=-1)
    assert torch.equal(top.indices, routing.ids[:, 3])
    assert torch.allclose(torch.softmax(top.values, -1).float(), routing.weights[:, 3])


def test_router_lazily_matches_the_trace():
    # a prompt of text, 70 vision tokens and text again, then 70 decode tokens: crosses noise blocks
    modality = torch.cat([torch.zeros(20), torch.ones(70), torch.zeros(10)]).to(torch.uint8)
    phase = torch.cat([torch.zeros(100), torch.ones(70)]).to(torch.uint8)
    full_modality = torch.cat([modality, torch.zeros(70, dtype=torch.uint8)])
    ids, weights = synthetic_routing(170, layers=12, experts=64, top_k=4, phase=phase, modality=full_modality, seed=9)

    router = SyntheticRouter(layers=12, experts=64, top_k=4, seed=9)
    assert torch.equal(router.prefill(modality=modality), ids[:100])
    for t in range(100, 140):
        assert torch.equal(router.decode(), ids[t])
    # ask for a later token at one layer: the tokens in between are decoded on demand
    assert torch.equal(router.ids(169, 5), ids[169, 5])
    assert router.tokens == 170 and torch.equal(router.ids(120, 2), ids[120, 2])
    history_ids, history_weights = router.history()
    assert torch.equal(history_ids, ids) and torch.equal(history_weights, weights)
    assert router.modality.tolist() == full_modality.tolist() and router.phase.tolist() == phase.tolist()
    assert torch.equal(router.weights(150), weights[150])


def test_next_layer_router_predicts_with_skill_set_by_coupling():
    def recall(coupling):
        router = SyntheticRouter(layers=8, experts=E, top_k=8, seed=4, coupling=coupling)
        routing = router.route(400)
        hits = []
        for layer in range(2, 7):
            predicted = router.next_layer_logits(routing.hidden[:, layer], layer).topk(8, -1).indices
            actual = routing.ids[:, layer + 1]
            hits.append((predicted[:, :, None] == actual[:, None, :]).any(-1).float().mean())
        return float(torch.stack(hits).mean())

    strong, weak = recall(0.95), recall(0.3)
    assert strong > weak + 0.1
    # even weakly coupled, the next layer's router knows the request's hot set: above chance (8/128)
    assert weak > 2 * 8 / E
    with pytest.raises(ValueError, match="next layer"):
        SyntheticRouter(layers=4).next_layer_logits(torch.zeros(32), 3)


def test_other_shapes_interpolate_the_table_over_depth():
    ids = synthetic_trace(64, layers=24, experts=64, top_k=4, seed=1)
    assert ids.shape == (64, 24, 4) and int(ids.max()) < 64
    table = load_calibration()["per_layer"]["rho"]
    knobs = resolve_knobs(24)
    assert knobs.rho[0] == pytest.approx(table[0]) and knobs.rho[-1] == pytest.approx(table[-1])
    assert np.allclose(knobs.rho, np.interp(np.linspace(0, 1, 24), np.linspace(0, 1, 48), table))
    assert depth_interp([1.0, 3.0], 3).tolist() == [1.0, 2.0, 3.0]
    # overrides: a scalar for every layer, or a short profile interpolated over depth
    assert resolve_knobs(48, rho=0.3).rho.tolist() == [0.3] * 48
    assert resolve_knobs(5, hot=[0.0, 4.0]).hot.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(TypeError, match="unknown routing knobs"):
        synthetic_trace(4, temprature=2.0)
    with pytest.raises(ValueError, match="rho"):
        synthetic_trace(4, rho=1.0)
    with pytest.raises(ValueError, match="top_k"):
        synthetic_trace(4, experts=4, top_k=8)
    with pytest.raises(ValueError, match="modality has 3 entries"):
        synthetic_trace(4, modality=torch.ones(3))


def test_targets_profile_is_consistent():
    profile = targets.overlap_profile()
    assert profile.mean() == pytest.approx(targets.OVERLAP_MEAN)
    assert profile[0] == 0.08 and profile[47] == 0.21 and (profile[18:32] == targets.PLATEAU).all()


# ---- the statistics on hand-made traces ----------------------------------------------------------------

def test_overlap_and_reuse_by_hand():
    # one layer, k = 2, experts 0..4
    ids = torch.tensor([[0, 1], [1, 2], [3, 4], [1, 0]])[:, None, :]
    st = trace_stats(ids, 5)
    assert st["per_layer"]["overlap"][0] == pytest.approx((0.5 + 0.0 + 0.0) / 3)
    # reuses: 1 at t=1 (distance 1), 1 at t=3 (2), 0 at t=3 (3)
    assert reuse_distances(selection_mask(ids.numpy(), 5), np.ones(4, bool))[0].tolist() == [3, 1, 2]
    assert st["overall"]["reuse_median"] == 2.0
    assert st["overall"]["reuse_next"] == pytest.approx(1 / 3)
    assert st["overall"]["reuse_within8"] == 1.0
    # counts 2, 3, 1, 1, 1 of 8 selections over 5 experts
    p = np.array([2, 3, 1, 1, 1]) / 8
    assert st["per_layer"]["entropy"][0] == pytest.approx(-(p * np.log(p)).sum() / np.log(5))
    assert st["per_layer"]["hot_ratio"][0] == pytest.approx(3 / (8 / 5))


def test_request_boundaries_and_phases_are_respected():
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])[:, None, :]
    assert trace_stats(ids, 4)["overall"]["overlap"] == 1.0
    # two requests: the pair across the boundary is not a consecutive pair, no reuse crosses it
    st = trace_stats(ids, 4, request_ids=torch.tensor([0, 0, 1, 1]))
    assert st["overall"]["overlap"] == 1.0 and st["requests"] == 2
    assert reuse_distances(selection_mask(ids.numpy(), 4), np.ones(4, bool), np.array([0, 0, 1, 1]))[0].size == 4
    # prefill tokens are not decode pairs; vision prefill tokens feed the vision ratio
    varied = torch.tensor([[0, 1], [2, 3], [0, 1], [0, 1]])[:, None, :]
    st = trace_stats(varied, 4, modality=torch.tensor([1, 1, 0, 0]), phase=torch.tensor([0, 0, 1, 1]))
    assert st["overall"]["overlap"] == 1.0                        # only the decode pair (2, 3) counts
    assert st["per_layer"]["vision_max_mean"][0] == pytest.approx(1.0)  # experts 0-3 once each


def test_top16_share_and_jaccard_by_hand():
    experts = 40
    ids = torch.arange(16)[None, None, :].expand(3, 2, 16)        # always the same 16 experts
    st = trace_stats(ids, experts)
    assert st["per_layer"]["top16_share"] == [1.0, 1.0]
    assert st["per_layer"]["entropy"][0] == pytest.approx(np.log(16) / np.log(experts))
    other = (torch.arange(16) + 16)[None, None, :].expand(3, 2, 16)
    assert hot_set_jaccard(ids, ids, experts)["mean"] == 1.0
    assert hot_set_jaccard(ids, other, experts)["mean"] == 0.0
    half = (torch.arange(16) + 8)[None, None, :].expand(3, 2, 16)
    assert hot_set_jaccard(ids, half, experts)["mean"] == pytest.approx(8 / 24)


def test_vectorised_reuse_shares_agree_with_distances():
    ids = synthetic_trace(300, layers=4, experts=64, top_k=4, seed=3).numpy()
    mask = selection_mask(ids, 64)
    shares = reuse_shares(mask, (1, 8))
    for layer, d in enumerate(reuse_distances(mask, np.ones(300, bool))):
        assert shares[1][layer] == pytest.approx(np.mean(d == 1))
        assert shares[8][layer] == pytest.approx(np.mean(d <= 8))


def test_the_subpackage_imports_nothing_else_of_vismmoe_kt():
    """It sits at the bottom of the import graph: only torch, numpy, safetensors, the standard library
    and its own modules (checked in the source, and in a fresh interpreter)."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import vismmoe_kt.routing

    allowed = {"torch", "numpy", "safetensors", "__future__"} | set(sys.stdlib_module_names)
    for source in Path(vismmoe_kt.routing.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{source.name} imports from outside the subpackage"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    assert name.split(".")[0] in allowed, f"{source.name} imports {name}"
    code = ("import sys, vismmoe_kt.routing; "
            "print(sorted(m for m in sys.modules if m.startswith('vismmoe_kt') and 'routing' not in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['vismmoe_kt']"
