"""The lookahead predictor inside a table step: at every MoE layer it scores the next layers' experts
on a side stream, and the likely ones not resident are copied into landing slots of their layers
while the compute stream runs on (the side stream joins it before the step ends: still one graph).

The predictor: candidates(row, hidden, routed) -> (rows, experts) device tensors, end_step(routed) and
start_decode(visual), device work only (predictor/device_lookahead.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..residency import Residency


class StepLookahead:
    def __init__(self, res: Residency, predictor: Any):
        self.res, self.predictor = res, predictor
        self.host_addresses: torch.Tensor | None = None  # (rows,) each offloaded layer's mapped store: prefetch copies
        self._host_blocks: list[torch.Tensor | None] = []  # per row: its store blocks (None: pinned), the twin's source
        cuda = res.device.type == "cuda"
        self._side: Any = None  # the side stream (CUDA), made in `prepare`
        # bound once: the device is fixed, and the last row closes the step where the others predict
        scored, closed = (self._scored_on_side, self._close_on_side) if cuda else (self._scored_here, self._closed)
        self._at_row: list[Callable[[int, torch.Tensor], None]] = [scored] * (len(res.moe_layers) - 1) + [closed]

    def prepare(self, visual: torch.Tensor | None) -> None:
        """As decode starts (outside any capture): the side stream, each row's mapped store address,
        and the predictor's per-request features reset."""
        res = self.res
        if res.device.type == "cuda" and self._side is None:
            self._side = torch.cuda.Stream(res.device)
        if self.host_addresses is None:  # every layer is loaded by now; the store never moves
            self._host_blocks = [res.store.layers.get(layer) for layer in res.moe_layers]
            addresses = [blocks.data_ptr() if blocks is not None else 0 for blocks in self._host_blocks]
            self.host_addresses = torch.tensor(addresses, dtype=torch.long, device=res.device)
        self.predictor.start_decode(visual)

    def look_ahead(self, row: int, hidden: torch.Tensor) -> None:
        """Score the next layers' experts and prefetch the likely ones, on the side stream; at the
        last layer, join it (a captured step must end on one stream) and close the step's features."""
        self._at_row[row](row, hidden)

    def _closed(self, row: int, hidden: torch.Tensor) -> None:
        self.predictor.end_step(self.res.table.routed)

    def _close_on_side(self, row: int, hidden: torch.Tensor) -> None:
        torch.cuda.current_stream(self.res.device).wait_stream(self._side)
        self._closed(row, hidden)

    def _scored_here(self, row: int, hidden: torch.Tensor) -> None:
        """On the CPU: the torch twin's prefetch, from the store blocks."""
        lookahead, table = self.predictor, self.res.table
        if lookahead.predicts_at(row):  # `prefetch_stride`: else the last run's window covers this row
            rows, experts = lookahead.candidates(row, hidden, table.routed)
            table.prefetch(rows, experts, self.res.pool, self._host_blocks, False)

    def _scored_on_side(self, row: int, hidden: torch.Tensor) -> None:
        lookahead, table, res = self.predictor, self.res.table, self.res
        if not lookahead.predicts_at(row):  # `prefetch_stride`: the last run's window covers this row
            return
        self._side.wait_stream(torch.cuda.current_stream(res.device))
        hidden.record_stream(self._side)  # the compute stream may free it while the side stream reads
        with torch.cuda.stream(self._side):
            rows, experts = lookahead.candidates(row, hidden, table.routed)
            table.prefetch(rows, experts, res.pool, self._host_blocks, True, self.host_addresses)
