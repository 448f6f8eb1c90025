"""Copy bandwidth measured in the same run as the configurations, for the physical bound.

On a GPU: page-locked host memory to the device (what every expert fetch does). Without one: a plain
host memcpy, the only copy there is. The figure is bytes copied / seconds (read once, written once).
"""

from __future__ import annotations

import time

import torch


def measure_copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> dict:
    """{"bytes_per_s", "kind", "bytes"}: the best of `repeats` copies of `nbytes` (after one warm-up)."""
    cuda = device.type == "cuda"
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    source.fill_(1)  # touch every page, so the first timed copy does not pay for faulting them in
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for attempt in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if attempt:  # the first copy is the warm-up
            best = min(best, elapsed)
    kind = "pinned host->device copy" if cuda else "host memcpy (no GPU)"
    return {"bytes_per_s": nbytes / best, "kind": kind, "bytes": nbytes}
