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


def count_tokens(request: dict, image_token_id: int) -> tuple[int, int]:
    """(prompt tokens, visual tokens among them)."""
    ids = request["input_ids"][0]
    return int(ids.numel()), int((ids == image_token_id).sum())
