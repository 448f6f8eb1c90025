"""What every generation shares, one request or many: sampling a token, the stop ids, the context check,
and the inputs of a prompt's continuation on top of a cached history."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError
from ..models import ModelAdapter
from .prompt_history import ImageKey


# Temperatures below this decode greedily, on every path. Logits divided by a smaller one overflow:
# transformers' generation loop (the serial server engine, the CLI without our decode engine) divides by the
# temperature as given, so 1e-38 makes the scores inf and the probabilities nan; and long before that the
# softmax is one-hot (a logit gap of 0.001 over 1e-5 is e^-100), so greedy is the answer sampling tends to.
MIN_TEMPERATURE = 1e-5


def samples(do_sample: bool, temperature: float | None) -> bool:
    """Whether a request samples: asked to, at a temperature (None: the caller's default of 1) not below
    MIN_TEMPERATURE (0 is greedy, as OpenAI's and Ollama's APIs mean it)."""
    return bool(do_sample) and (temperature is None or float(temperature) >= MIN_TEMPERATURE)


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def of(cls, temperature: float | None, top_p: float | None) -> "Sampling":
        """A request's sampling: greedy at temperature 0, None or below MIN_TEMPERATURE."""
        if not temperature or not samples(True, temperature):
            return cls()
        return cls(True, float(temperature), 1.0 if top_p is None else float(top_p))


def next_token(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float) -> torch.Tensor:
    """(1, V) logits -> (1,) token id: greedy, or sampled with temperature and nucleus (top-p) filtering."""
    if not samples(do_sample, temperature):
        return logits.argmax(dim=-1)
    scores = logits.float() / float(temperature)
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p  # the most likely token always stays
        scores = scores.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
    return torch.multinomial(scores.softmax(dim=-1), 1)[:, 0]


def sample(logits: torch.Tensor, sampling: Sampling) -> int:
    return int(next_token(logits, sampling.do_sample, sampling.temperature, sampling.top_p))


def eos_ids(model: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return set() if eos is None else set([eos] if isinstance(eos, int) else eos)


def check_context(model: Any, adapter: ModelAdapter, prompt_tokens: int, max_new_tokens: int) -> None:
    """A clear error before any work where a request could outgrow the model's context as we serve it
    (`context_length`: Llama 4's attention chunk, else the model's positions), not a wrong token past it."""
    limit = adapter.context_length(model.config)
    if prompt_tokens + max_new_tokens > limit:
        raise InputError(f"a prompt of {prompt_tokens} tokens plus max_new_tokens={max_new_tokens} is over this "
                         f"model's context of {limit} tokens: shorten the prompt or ask for fewer tokens")


def continuation(model: Any, adapter: ModelAdapter, inputs: dict[str, torch.Tensor], start: int,
                 images: list[ImageKey], held_images: int) -> dict[str, torch.Tensor]:
    """The model inputs for the tokens from `start` on, the first `held_images` images being cached."""
    prompt = inputs["input_ids"]
    part = {"input_ids": prompt[:, start:]}
    if len(images) == held_images:
        return part  # text only: positions continue from the cached length plus the held rope offset
    rows = sum(k.patches() for k in images[:held_images])
    # M-RoPE positions of a new image depend on everything before it: take them from the whole prompt
    positions, deltas = adapter.rope_index(model, inputs)
    adapter.set_rope_delta(model, deltas)
    part.update(pixel_values=inputs["pixel_values"][rows:], image_grid_thw=inputs["image_grid_thw"][held_images:],
                position_ids=positions[:, :, start:])
    for name in ("mm_token_type_ids", adapter.modality_argument()):  # M-RoPE families' processors give the first
        if name in inputs:  # (Kimi K2.5's does not); a modality-separated family's experts need the second
            part[name] = inputs[name][:, start:]
    return part
