"""Sampling below MIN_TEMPERATURE is greedy, on the lean path (next_token) and in what both server engines
are handed (Sampling.of), whatever the logits' dtype: 1e-38 once overflowed to inf in transformers' loop."""

import pytest
import torch

from vismmoe_kt.engine.sampling import MIN_TEMPERATURE, Sampling, next_token, samples


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-38, 5e-324, MIN_TEMPERATURE / 2])
def test_a_tiny_temperature_is_the_greedy_token(dtype, temperature):
    torch.manual_seed(0)
    logits = (torch.randn(1, 4096) * 8).to(dtype)
    assert torch.equal(next_token(logits, True, temperature, 0.9), logits.argmax(dim=-1))
    assert torch.equal(next_token(logits, True, temperature, 1.0), logits.argmax(dim=-1))


def test_the_threshold_decides_for_both_engines():
    assert Sampling.of(1e-38, 0.5) == Sampling.of(0, None) == Sampling.of(None, 0.9) == Sampling()
    assert Sampling.of(MIN_TEMPERATURE, None) == Sampling(True, MIN_TEMPERATURE, 1.0)
    assert not samples(True, 1e-38) and samples(True, None) and not samples(False, 1.0)


def test_sampling_at_the_threshold_stays_finite():
    logits = torch.tensor([[30.0, 29.999, -1e4, float("-inf")]], dtype=torch.float32)
    torch.manual_seed(0)
    tokens = {int(next_token(logits, True, MIN_TEMPERATURE, 1.0)) for _ in range(20)}
    assert tokens <= {0, 1}
