"""The offload runtime's answers to the engine's questions that its step methods do not already give.

The engine talks to the expert runtime through core/expert_runtime.py's `ExpertRuntime` protocol
(runtime/ may not import core: OffloadRuntime implements it structurally, and
tests/core/test_context_types.py checks it). Most members are OffloadRuntime's own step methods; the
ones here are small queries over its state, so the engine asks instead of reading `pinned`,
`moe_layers` or `batch_table` itself.
"""

from __future__ import annotations

import torch


class EngineQueries:
    """Mixed into OffloadRuntime, whose fields these read."""

    moe_layers: list[int]
    pinned: set[int]
    visual_summary: torch.Tensor | None
    batch_table: bool  # OffloadRuntime's property

    def steps_chainable(self) -> bool:
        """A decode step may be queued before the host reads the one before it. The step hooks still run
        in the steps' order (the table's upkeep before a step reads the records of the one before, which
        waits for that step alone, never for the step's tokens; with reservations ahead it waits for
        nothing), so the cache sees the same steps; a step the engine takes back (a row stopped) stays in
        the counters and what it landed stays resident."""
        return True

    def batch_needs_exact_rows(self) -> bool:
        """A batched step runs as exactly its rows, no padding: offloaded layers look each row's experts
        up in the table, and a padding row would fetch experts nobody asked for."""
        return self.batch_table and len(self.pinned) < len(self.moe_layers)

    def offloaded_layers(self) -> list[int]:
        """The MoE layers whose experts are not pinned on the GPU, in order."""
        return [layer for layer in self.moe_layers if layer not in self.pinned]

    def set_visual_summary(self, summary: torch.Tensor) -> None:
        """h_v of the image prefill under way: the lookahead predictor reads it as decode starts."""
        self.visual_summary = summary
