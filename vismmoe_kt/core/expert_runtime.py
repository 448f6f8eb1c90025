"""ExpertRuntime: what the engine and the load context need from a model's expert runtime.

The protocol lives in `core`, the lowest room that names it: the load context (core/context.py)
holds the runtime as `context.offload_runtime`, and the engine (above core) reads it from there. The
engine may not import `runtime`, and `runtime` (below core) may not import core, so the runtime
implements the protocol structurally, without naming it (OffloadRuntime, runtime/offload.py, with its
engine-facing queries in runtime/engine_queries.py); tests/core/test_context_types.py checks that it
has every member with a compatible signature. A runtime with nothing to do for a member answers with
no effect (False, None, nothing offloaded), never by lacking it: the engine does not probe.

Members, by who calls them:
    before_step, after_step      the lean decode step's hooks (the cache's upkeep between steps;
                                 registered by the operator that makes the runtime, run by the engine)
    graph_variant                what a captured decode step depends on beyond its tensors
    router_sink                  a device-side sink for each MoE layer's router probabilities, or None
    decode_capturable, batch_capturable
                                 whether a layer's (batched) decode forward is device work only; the
                                 expert operators answer the engine's capture question with these
    batch_uses_table             a batched step's offloaded layers go through the decode table (its
                                 step hooks then run around the batched step too)
    batch_needs_exact_rows       ... and each row looks its experts up there: no padding rows
    prepare_batch, begin_batch_step, end_batch_step
                                 around batched decode steps of up to `max_rows` / `rows` tokens
    offloaded_layers             the MoE layers not pinned on the GPU, in order (prefill's pruning
                                 starts at the first one: `prune_layer: auto`)
    set_visual_summary           h_v, the mean visual embedding of an image prefill (the lookahead
                                 predictor's input)
"""

from __future__ import annotations

from typing import Callable, Hashable, Protocol

import torch


class ExpertRuntime(Protocol):
    def before_step(self) -> None: ...

    def after_step(self) -> None: ...

    def graph_variant(self) -> Hashable: ...

    def router_sink(self) -> Callable[[int, torch.Tensor], None] | None: ...

    def decode_capturable(self, layer: int) -> bool: ...

    def batch_capturable(self, layer: int) -> bool: ...

    def batch_uses_table(self) -> bool: ...

    def batch_needs_exact_rows(self) -> bool: ...

    def prepare_batch(self, max_rows: int) -> None: ...

    def begin_batch_step(self, rows: int = 0) -> None: ...

    def end_batch_step(self) -> None: ...

    def offloaded_layers(self) -> list[int]: ...

    def set_visual_summary(self, summary: torch.Tensor) -> None: ...
