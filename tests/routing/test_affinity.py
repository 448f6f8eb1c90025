"""The synthetic router's affinity what-if: off by default (bit for bit), concentrating with strength,
per-image preferences, chunking-invariant, labelled, and bad strengths refused clearly."""

import numpy as np
import pytest
import torch

from vismmoe_kt.errors import InputError
from vismmoe_kt.operators.routing_source import affinity_of, parse_spec
from vismmoe_kt.routing import SyntheticRouter, affinity_label, image_preference, synthetic_trace

T, VISUAL = 120, 100


def vision() -> torch.Tensor:
    mask = torch.zeros(T, dtype=torch.uint8)
    mask[8:8 + VISUAL] = 1
    return mask


def top_share(ids: torch.Tensor, experts: int, top: int) -> float:
    counts = torch.bincount(ids.reshape(-1), minlength=experts).float()
    return float(counts.sort(descending=True).values[:top].sum() / counts.sum())


def test_strength_zero_is_the_calibrated_router_bit_for_bit():
    plain = SyntheticRouter(6, 64, 8, seed=4).route(T, vision(), "prefill")
    off = SyntheticRouter(6, 64, 8, seed=4, affinity=0.0, image_seed=99).route(T, vision(), "prefill")
    assert torch.equal(plain.ids, off.ids) and torch.equal(plain.weights, off.weights)
    assert torch.equal(synthetic_trace(T, layers=6, experts=64, modality=vision(), seed=4, affinity=0),
                       plain.ids)


def test_strength_raises_the_visual_tokens_concentration_monotonically():
    shares = []
    for strength in (0.0, 0.2, 0.4, 0.8):
        ids = SyntheticRouter(6, 64, 8, seed=1, affinity=strength).prefill(modality=vision())
        shares.append(np.mean([top_share(ids[vision().bool(), layer], 64, 8) for layer in range(6)]))
    assert all(a < b for a, b in zip(shares, shares[1:])), shares
    text = [SyntheticRouter(6, 64, 8, seed=1, affinity=s).prefill(modality=vision())[~vision().bool()]
            for s in (0.0, 0.8)]
    assert torch.equal(text[0], text[1])  # text tokens never feel the term


def test_per_image_preferences_differ_and_are_deterministic():
    a, b = image_preference(1, 4, 32), image_preference(2, 4, 32)
    assert np.array_equal(a, image_preference(1, 4, 32)) and not np.allclose(a, b)
    one = SyntheticRouter(4, 32, 4, seed=0, affinity=0.9, image_seed=1).prefill(modality=vision())
    other = SyntheticRouter(4, 32, 4, seed=0, affinity=0.9, image_seed=2).prefill(modality=vision())
    assert not torch.equal(one, other)


def test_chunking_and_the_probabilities_agree_with_the_ids():
    whole = SyntheticRouter(4, 32, 4, seed=2, affinity=0.5)
    ids = whole.prefill(modality=vision())
    parts = SyntheticRouter(4, 32, 4, seed=2, affinity=0.5)
    chunked = torch.cat([parts.route(70, vision()[:70], "prefill").ids, parts.route(T - 70, vision()[70:], "prefill").ids])
    assert torch.equal(ids, chunked)
    twin = SyntheticRouter(4, 32, 4, seed=2, affinity=0.5)
    routing = twin.route(T, vision(), "prefill")  # what the routing source's probabilities are made from
    logits = twin.logits(2, routing.hidden[:, 2], vision().double(), twin.mixing_history())
    assert torch.equal(logits.topk(4, dim=-1).indices, ids[:, 2])


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "strong", True])
def test_bad_strengths_are_clear_errors(bad):
    with pytest.raises(ValueError, match="affinity strength must be a number in \\[0, 1\\]"):
        SyntheticRouter(2, 8, 2, affinity=bad)


def test_the_routing_spec_names_the_strength():
    assert parse_spec("synthetic:7:affinity=0.4") == ("synthetic", 7)
    assert affinity_of("synthetic:affinity=0.4") == 0.4 and affinity_of("synthetic:3") == 0.0
    assert affinity_of("model") == 0.0
    assert affinity_label(0.4) == "synthetic:affinity=0.4" and affinity_label(0.0) == "synthetic"
    for bad, message in (("synthetic:affinity=2", "affinity strength must be a number"),
                         ("synthetic:strength=0.4", "only :affinity=A is known")):
        with pytest.raises(InputError, match=message):
            parse_spec(bad)
