"""Algorithm 1 on hand-computed cases, and its baselines."""

import pytest
import torch

from vismmoe_kt.vision.compression import affinity_select, random_select, saliency_select, select


def masks(*rows, experts=6):
    out = torch.zeros(len(rows), experts, dtype=torch.bool)
    for i, row in enumerate(rows):
        out[i, list(row)] = True
    return out


def test_hand_computed_case():
    # N = 6, beta = 0.5 -> keep 3, alpha = 1/6 -> core = 1 token (the most salient: token 2)
    saliency = torch.tensor([0.0, 0.5, 1.0, 0.9, 0.8, 0.2])
    m = masks({0, 1}, {0, 1}, {0, 1}, {4, 5}, {0, 4}, {1})
    # normalised s = saliency (already in [0, 1]); target = {0, 1}
    # Delta: t0 0, t1 0, t3 2/2 = 1, t4 1/2, t5 0
    # p = s - 2 Delta: t0 0.0, t1 0.5, t3 -1.1, t4 -0.2, t5 0.2  -> extra = t1, t5
    assert affinity_select(saliency, m, keep_ratio=0.5, salient_ratio=1 / 6).tolist() == [1, 2, 5]
    # saliency alone keeps the three most salient: 2, 3, 4
    assert saliency_select(saliency, 0.5).tolist() == [2, 3, 4]


def test_the_tradeoff_weight_matters():
    saliency = torch.tensor([0.0, 0.5, 1.0, 0.9, 0.8, 0.2])
    m = masks({0, 1}, {0, 1}, {0, 1}, {4, 5}, {0, 4}, {1})
    # lambda = 0: pure saliency after the core
    assert affinity_select(saliency, m, 0.5, 1 / 6, tradeoff=0.0).tolist() == [2, 3, 4]


def test_ties_go_to_the_lower_index():
    saliency = torch.ones(5)                      # all equal: normalised to zeros
    m = masks({0}, {0}, {0}, {0}, {0}, experts=2)  # all experts shared: Delta = 0 for everyone
    assert affinity_select(saliency, m, keep_ratio=0.6, salient_ratio=0.2).tolist() == [0, 1, 2]
    assert saliency_select(saliency, 0.6).tolist() == [0, 1, 2]


def test_alpha_equal_beta_keeps_only_the_core():
    saliency = torch.tensor([0.3, 0.9, 0.1, 0.7])
    m = masks({0}, {1}, {2}, {3}, experts=4)
    assert affinity_select(saliency, m, keep_ratio=0.5, salient_ratio=0.5).tolist() == [1, 3]


def test_beta_one_keeps_everything_and_n_one():
    saliency = torch.tensor([0.3, 0.9, 0.1])
    m = masks({0}, {1}, {2}, experts=3)
    assert affinity_select(saliency, m, 1.0, 0.4).tolist() == [0, 1, 2]
    assert affinity_select(torch.tensor([5.0]), masks({1}, experts=3), 0.5, 0.2).tolist() == [0]


def test_tokens_without_experts_count_as_no_expansion():
    saliency = torch.tensor([1.0, 0.0, 0.1])
    m = masks({0}, set(), {3}, experts=4)  # token 1 routed nowhere we saw: Delta 0
    assert affinity_select(saliency, m, keep_ratio=2 / 3, salient_ratio=1 / 3).tolist() == [0, 1]


@pytest.mark.parametrize("kwargs,message", [
    (dict(keep_ratio=0.0, salient_ratio=0.1), "keep_ratio"),
    (dict(keep_ratio=1.5, salient_ratio=0.1), "keep_ratio"),
    (dict(keep_ratio=0.5, salient_ratio=0.6), "salient_ratio"),
    (dict(keep_ratio=0.5, salient_ratio=0.0), "salient_ratio"),
])
def test_invalid_ratios(kwargs, message):
    with pytest.raises(ValueError, match=message):
        affinity_select(torch.rand(4), masks({0}, {1}, {0}, {1}, experts=2), **kwargs)


def test_invalid_shapes():
    with pytest.raises(ValueError, match=r"saliency must be \(N,\)"):
        affinity_select(torch.rand(4), torch.zeros(3, 2, dtype=torch.bool), 0.5, 0.2)
    with pytest.raises(ValueError, match="no visual tokens"):
        saliency_select(torch.rand(0), 0.5)


def test_random_is_seeded_and_sized():
    a, b = random_select(10, 0.5, seed=3), random_select(10, 0.5, seed=3)
    assert torch.equal(a, b) and len(a) == 5 and a.tolist() == sorted(set(a.tolist()))
    assert not torch.equal(a, random_select(10, 0.5, seed=4))


def test_select_dispatch():
    saliency, m = torch.tensor([0.1, 0.9, 0.5, 0.3]), masks({0}, {1}, {2}, {3}, experts=4)
    assert select("none", saliency, m, 0.5, 0.2).tolist() == [0, 1, 2, 3]
    assert select("affinity", saliency, m, 1.0, 0.4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="compression 'zip' is not one of"):
        select("zip", saliency, m, 0.5, 0.2)


def test_affinity_touches_no_more_experts_than_saliency():
    """Fixture with a known answer: a compact cluster of tokens sharing the core's experts versus
    salient outliers each bringing two new experts."""
    saliency = torch.tensor([1.0, 0.55, 0.5, 0.45, 0.6, 0.58, 0.57, 0.0])
    m = masks({0, 1}, {0, 1}, {0}, {1}, {2, 3}, {4, 5}, {6, 7}, {0, 1}, experts=8)
    def touched(idx):
        return int(m[idx].any(dim=0).sum())
    aff = affinity_select(saliency, m, keep_ratio=0.5, salient_ratio=0.125)
    sal = saliency_select(saliency, 0.5)
    assert touched(aff) == 2 and touched(sal) == 8
