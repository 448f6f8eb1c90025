"""ModelPass: what the model's forward under way computes, for operators that key state by sequence position.

The model runner (engine/runner.py) publishes one in the load context (`context.model_pass`) before each
prefill forward, and the decode step before each step; transformers' own loop gets one for its prompt.
A router operator that replaces the routers' choice by a routing source (operators/routing_source.py)
reads it to know which request, KV slot and positions its tokens are, so the engine never asks whether
such an operator exists: it says what it runs, whoever listens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class SlotRows(Protocol):
    """engine.slot_cache.SlotKVCache as a decode step's rows: their slots and every layer's lengths."""
    capacity: int
    device: torch.device
    dtype: torch.dtype
    active: torch.Tensor | None     # (R,) the step's rows' slots (device)
    lengths: torch.Tensor           # (L, slots) each slot's length per layer (device)

    @property
    def num_slots(self) -> int: ...


@dataclass(frozen=True)
class HostPrompt:
    """What a whole picture prompt's forward needs from its token ids, read on the host before it starts
    (engine/host_prompt.py), so that nothing in the forward waits for the device: the visual tokens' positions
    `visual_rows` (N,) and the M-RoPE `position_ids` (3, 1, T), both already on the model's device; their
    count and the decode steps' position offset as host numbers; the prompt's ids (1, T) on the host, for
    whoever else would read them back (a routing source's table)."""
    visual_rows: torch.Tensor
    visual_tokens: int
    position_ids: torch.Tensor
    rope_delta: int
    input_ids: torch.Tensor


@dataclass(frozen=True)
class PrefillRow:
    """One prompt of a prefill forward: its request (a new id is a new request), its KV slot (None:
    transformers' loop, one request), the prompt position the forward starts at, the tokens it runs,
    the whole prompt (1, T) and the tokens the request may generate after it; `host`: its facts read on
    the host where the forward runs without device waits (a whole picture prompt), else None."""
    request: int
    slot: int | None
    start: int
    length: int
    input_ids: torch.Tensor
    max_new_tokens: int
    host: HostPrompt | None = None


@dataclass(frozen=True)
class ModelPass:
    """A prefill of `prefill`'s prompts (several: right-padded to `width` tokens), or a decode step over the
    rows of `decode`; `cache`: the KV slots they live in (None under transformers' loop)."""
    prefill: tuple[PrefillRow, ...] = ()
    width: int = 0
    decode: SlotRows | None = None
    cache: SlotRows | None = None
