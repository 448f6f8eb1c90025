"""Eager GPU timing for the measurement modules: CUDA events around each run, the median."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def median_seconds(run: Callable[[], Any], repeats: int, device: torch.device | str = "cuda") -> float:
    """Median seconds of `run` over `repeats` runs: CUDA events on a GPU (the device's own clock, no
    host sync inside the region), the host clock elsewhere."""
    times = []
    for _ in range(repeats):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return statistics.median(times)
