"""Several fresh prompts as one right-padded batch, for a prefill forward that serves them all.

The model runner (runner.py) prefills the prompts that wait together in one forward: their
per-token rows right-padded to the longest (causal attention from an empty cache keeps each prompt
from its padding), their images concatenated in order so the vision tower runs once on them all.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models import ModelAdapter

# what a prompt's inputs may hold to join a group: per-token rows and images (videos prefill alone)
PER_TOKEN_INPUTS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids"})
GROUPABLE_INPUTS = PER_TOKEN_INPUTS | {"pixel_values", "image_grid_thw"}


def groupable(inputs: dict[str, torch.Tensor], adapter: ModelAdapter) -> bool:
    """Whether a prompt's inputs can join a prefill group (what `group_inputs` batches)."""
    return set(inputs.keys()) <= GROUPABLE_INPUTS | set(family_per_token_inputs(adapter))


def family_per_token_inputs(adapter: ModelAdapter) -> tuple[str, ...]:
    """Per-token inputs a family's model takes beyond PER_TOKEN_INPUTS: the experts' modality argument
    (0 for text, like `mm_token_type_ids`)."""
    return tuple(name for name in (adapter.modality_argument(),) if name)


def group_inputs(inputs: list[dict[str, torch.Tensor]], pad_id: int, per_token: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Several prompts' processor outputs as one batch: per-token rows (PER_TOKEN_INPUTS and `per_token`)
    right-padded to the longest (`pad_id`, attention mask 0), the images' patches and grids concatenated in
    the prompts' order. A prompt without a per-token row the others have gets its default: attention
    everywhere, every token text (the processor leaves `mm_token_type_ids` out of text-only prompts in some
    versions)."""
    width = max(int(i["input_ids"].shape[1]) for i in inputs)
    out: dict[str, torch.Tensor] = {}
    for key in sorted({k for i in inputs for k in i.keys()}):
        present = [i[key] for i in inputs if key in i]
        if key in PER_TOKEN_INPUTS or key in per_token:
            default = {"attention_mask": 1, "mm_token_type_ids": 0, **{name: 0 for name in per_token}}
            rows = [i[key] if key in i else torch.full_like(i["input_ids"], default[key]) for i in inputs]
            fill = pad_id if key == "input_ids" else 0
            out[key] = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in rows])
        elif key in GROUPABLE_INPUTS:
            out[key] = torch.cat(present)
        else:
            raise ValueError(f"prompts grouped for prefill: input {key!r} cannot be batched")
    if "attention_mask" not in out:
        out["attention_mask"] = torch.stack([
            torch.arange(width, device=out["input_ids"].device) < i["input_ids"].shape[1] for i in inputs]).long()
    return out


def padding_token(model: Any, adapter: ModelAdapter) -> int:
    """A token id for padding: the config's pad token, else 0; never the image placeholder."""
    config = model.config
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(adapter.text_config(config), "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    return pad if pad != adapter.image_token_id(config) else pad + 1
