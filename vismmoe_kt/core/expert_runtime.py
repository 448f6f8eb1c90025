"""ExpertRuntime: what the engine and the load context need from a model's expert runtime.

The protocol lives in `core`, the lowest room that names it: the load context (core/context.py)
holds the runtime as `context.offload_runtime`, and the engine (above core) reads it from there. The
engine may not import `runtime`, and `runtime` (below core) may not import core, so the runtime
implements the protocol structurally, without naming it (OffloadRuntime, runtime/offload.py, with its
engine-facing queries in runtime/engine_queries.py); tests/core/test_context_types.py checks that it
has every member with a compatible signature. A runtime with nothing to do for a member answers with
no effect (False, None, nothing offloaded), never by lacking it: the engine does not probe.

Members, by who calls them:
    prepare_steps                before any decode step: steps of up to `max_rows` tokens will run
    begin_prompt                 a prefill forward whose routers of this runtime's experts will see `tokens`
                                 tokens is about to run, before its vision tower: a runtime that copies
                                 experts in may start on the prompt's first offloaded layer (the runner
                                 begins each expert set's runtime: context.expert_set_runtimes too)
    begin_step, end_step         around every decode step of `rows` tokens (one request: one row): the
                                 runtime binds the executor for them and keeps its cache between steps
    graph_variant                what a captured decode step depends on beyond its tensors
    router_sink                  a device-side sink for each MoE layer's router probabilities, or None
    averages_router              whether that sink still keeps averages (a routing source hands a step
                                 no probabilities once it does not: no softmax a layer for nobody)
    decode_capturable, batch_capturable
                                 whether a layer's (batched) decode forward is device work only; the
                                 expert operators answer the engine's capture question with these
    steps_chainable              a decode step may be queued before the host has read the one before
                                 it: the step hooks keep no host state that a step's results change
    batch_needs_exact_rows       a step of several rows looks each row's experts up in the decode
                                 table: no padding rows
    offloaded_layers             the MoE layers not pinned on the GPU, in order (prefill's pruning
                                 starts at the first one, or after the first MoE layer where none
                                 is pinned: `prune_layer: auto`)
    set_visual_summary           h_v, the mean visual embedding of an image prefill (the lookahead
                                 predictor's input)
"""

from __future__ import annotations

from typing import Callable, Hashable, Protocol

import torch


class ExpertRuntime(Protocol):
    def prepare_steps(self, max_rows: int) -> None: ...

    def begin_prompt(self, tokens: int) -> None: ...

    def begin_step(self, rows: int) -> None: ...

    def end_step(self) -> None: ...

    def graph_variant(self) -> Hashable: ...

    def router_sink(self) -> Callable[[int, torch.Tensor], None] | None: ...

    def averages_router(self) -> bool: ...

    def decode_capturable(self, layer: int) -> bool: ...

    def batch_capturable(self, layer: int) -> bool: ...

    def steps_chainable(self) -> bool: ...

    def batch_needs_exact_rows(self) -> bool: ...

    def offloaded_layers(self) -> list[int]: ...

    def set_visual_summary(self, summary: torch.Tensor) -> None: ...
