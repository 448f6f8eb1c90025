"""The benchmark's requests: one image of a given size and a short prompt (batch 1), so visual tokens
dominate the prompt as in the paper's Table 1."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vismmoe_kt.engine.inputs import build_inputs, user_turn

PROMPT = "Describe the image."


def make_request(processor, size: int, device: torch.device | str) -> dict:
    """Processor outputs for one random `size` x `size` image and PROMPT, on `device`."""
    image = Image.fromarray(np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8))
    return build_inputs(processor, [user_turn(PROMPT, 1)], [image], device)


def text_request(processor, tokens: int, device: torch.device | str) -> dict:
    """Processor outputs for a text-only prompt of at most `tokens` tokens (the template included), the longest
    such: seeded words, the same every run. What llama.cpp's `pp N` measures, without a picture's vision tower."""
    words = np.random.default_rng(tokens).choice(FILLER, size=4 * tokens)

    def request(count: int) -> dict:
        return build_inputs(processor, [user_turn(" ".join(words[:count]), 0)], [], device)

    low, high = 0, len(words)  # the most words whose prompt still fits
    while low < high:
        middle = (low + high + 1) // 2
        if request(middle)["input_ids"].shape[1] <= tokens:
            low = middle
        else:
            high = middle - 1
    if low == 0:
        raise ValueError(f"a text prompt of {tokens} tokens: the chat template alone takes more")
    return request(low)


FILLER = ("the", "red", "square", "left", "of", "a", "small", "blue", "circle", "above", "three", "green", "lines",
          "and", "one", "word", "reads", "seven", "near", "corner", "picture", "shows", "two", "large", "shapes")


def count_tokens(request: dict, image_token_id: int) -> tuple[int, int]:
    """(prompt tokens, visual tokens among them)."""
    ids = request["input_ids"][0]
    return int(ids.numel()), int((ids == image_token_id).sum())
