"""The protocols of what rooms above `core` put in the load context (core/context.py).

The context is `core`'s, and core may import only errors, models and runtime (tests/
test_architecture.py), so an object made by the engine, the vision room or an operator is named here
by what its readers use, as a `typing.Protocol`; its class (named beside each protocol) satisfies it
structurally, checked by tests/core/test_context_types.py. Core is the lowest room that needs these
names, and every room that reads the context (engine, operators, parallel) sits above it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class SaliencySource(Protocol):
    """vision.saliency.SaliencyRecorder: the vision tower's visual-token saliency, recorded when
    `enabled` (a VisDecoder that prunes by it turns it on), taken once per prefill."""

    enabled: bool

    def take(self) -> torch.Tensor | None: ...


class PrefillForward(Protocol):
    """engine.text_forward.TextForward: the text model's forward that is ours (a VisDecoder rule), which
    batched generation also runs a chunk of a prompt, or a group of prompts, at a time."""

    def __call__(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                 past_key_values: Any = None, inputs_embeds: Any = None, use_cache: Any = None,
                 visual_pos_masks: Any = None, deepstack_visual_embeds: Any = None, **kwargs: Any) -> Any: ...

    def prefill_parts(self, run: Any) -> dict[str, Any]: ...

    def prefill_chunk(self, parts: dict[str, Any], start: int, end: int, past_key_values: Any) -> torch.Tensor: ...

    def modality_of(self, parts: dict[str, Any], start: int = 0, end: int | None = None) -> dict[str, Any]: ...


class DecodeState(Protocol):
    """engine.lean_engine.LeanEngine: the engine's decode state for the model; operators report its
    counters with their own."""

    def stats(self) -> dict[str, Any]: ...


class RoutingTable(Protocol):
    """engine.routing_source.RoutingSource: a routing source whose tables replace the routers' choice
    (`replaces`), read by the decode steps on the device and, for a predictor calibrated on synthetic
    routing, by the expert operators (`latent`)."""

    @property
    def replaces(self) -> bool: ...

    def reserve(self, positions: int, device: torch.device, dtype: torch.dtype, latent_dim: int = 0) -> None: ...

    def reserve_slots(self, slots: int, capacity: int, device: torch.device, dtype: torch.dtype) -> None: ...

    def begin(self, input_ids: torch.Tensor, max_new_tokens: int, start: int = 0, slot: int | None = None) -> None: ...

    def begin_rows(self, slots: list[int], lengths: list[int], width: int) -> None: ...

    def resume_slot_prefill(self, slot: int) -> None: ...

    def end_slot_prefill(self) -> None: ...

    def decode_route(self, index: int, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def batch_decode_route(self, index: int, slots: torch.Tensor,
                           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode_probabilities(self, index: int, position: torch.Tensor) -> torch.Tensor: ...

    def latent(self, index: int) -> torch.Tensor: ...

