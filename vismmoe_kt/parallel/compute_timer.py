"""Each call's own expert compute on this rank, timed, for ReaLB's straggler figures.

Under expert parallelism a layer's step ends when its slowest rank has computed the pairs it received:
the straggler time is that rank's compute minus the mean over ranks (ReaLB's measure of imbalance in
time, not in counts). A rank times only its own share (between the dispatch and the return exchange),
call by call. The ranks run every layer's exchange in the same order, so their lists line up and
`straggler_seconds` compares them call by call.

Off by default: timing reads the GPU's events back (a sync) when the figures are taken, never inside
a step. CUDA events on a GPU, the host clock on the CPU.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class ComputeTimer:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.enabled = False
        self._marks: list = []

    @contextmanager
    def __call__(self) -> Iterator[None]:
        # a CUDA graph's capture cannot record timing events (and its replays would not fill them)
        if not self.enabled or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            yield
            return
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._marks.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._marks.append(time.perf_counter() - began)

    def take(self) -> list[float]:
        """The seconds of each call since the last take, in call order (then forgets them)."""
        marks, self._marks = self._marks, []
        if marks and isinstance(marks[0], tuple):
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) / 1000 for start, end in marks]
        return list(marks)


def straggler_seconds(per_rank: list[list[list[float]]]) -> dict[str, float]:
    """per_rank[r][l][c]: rank r's compute in layer l's call c. Totals over layers and calls: each rank's
    compute, and the straggler time (per call, the slowest rank's compute minus the mean)."""
    ranks = len(per_rank)
    totals = [sum(sum(calls) for calls in layers) for layers in per_rank]
    straggler = 0.0
    for layer in range(len(per_rank[0])):
        calls = min(len(per_rank[r][layer]) for r in range(ranks))
        for c in range(calls):
            times = [per_rank[r][layer][c] for r in range(ranks)]
            straggler += max(times) - sum(times) / ranks
    mean = sum(totals) / ranks
    return {"moe_compute_s_per_rank": totals, "straggler_s": straggler,
            "straggler_share": straggler / mean if mean > 0 else 0.0}
