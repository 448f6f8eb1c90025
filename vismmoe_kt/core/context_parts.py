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
    """engine.decoding.Decoding: the engine's decode state for the model; operators report its
    counters with their own."""

    def stats(self) -> dict[str, Any]: ...


class RoutingTable(Protocol):
    """operators.routing_source.RoutingSource: a routing source whose tables replace the routers' choice
    (`replaces`; its operators sit on the routers), read by the expert operators for a predictor
    calibrated on synthetic routing (`latent`)."""

    @property
    def replaces(self) -> bool: ...

    def latent(self, index: int) -> torch.Tensor: ...

