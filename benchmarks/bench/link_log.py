"""The host-to-device link during a prompt: every batch of expert copies the offload runtime issues, when the host
issued it and when the copy stream ran it, on the prompt's clock. From them, how long the link was busy, and
where it sat idle between the first copy and the last: either the host had not issued the next batch yet
(`host`), or the batch was issued and waited on the device for the compute still reading the slabs it
overwrites (`waiting`). A streamed prompt is bound by its copies, so an idle link is time the prompt loses.

Measurement only: it wraps the runtime's transfer object's issuing methods for as long as it is installed and
reads the CUDA events the runtime itself records around each batch (on the CPU, where copies run as they are
issued, the host's clock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# gaps shorter than this between one batch's end and the next one's start are the stream's own scheduling
GAP_MS = 0.02
# issuing methods of the runtime's Transfers that append one or more (begin, done, copies) to its counters
ISSUERS = ("_issue", "_fetch_dequantized")


@dataclass
class Batch:
    layers: tuple[int, ...]  # the layers whose experts it copies
    copies: int
    issued_s: float          # host clock as the runtime began issuing it
    returned_s: float        # host clock once issued (on the CPU the copies are done by then)
    events: tuple | None     # the runtime's CUDA (begin, done) events; None on the CPU


class LinkLog:
    """Install on an offload runtime's `transfers` (None, or a runtime without one: records nothing)."""

    def __init__(self, transfers: Any):
        self.transfers = transfers
        self.batches: list[Batch] = []
        self.armed = False
        self._undo: list = []
        if transfers is None:
            return
        for name in ISSUERS:
            if hasattr(transfers, name):
                self._wrap(name)

    def _wrap(self, name: str) -> None:
        transfers = self.transfers
        original = getattr(transfers, name)

        def issue(slabs, keys, *args, **kwargs):
            if not self.armed:
                return original(slabs, keys, *args, **kwargs)
            listed_before = len(transfers.counters.copy_events)  # the issuers append; only a summary resolves them
            issued = time.perf_counter()
            result = original(slabs, keys, *args, **kwargs)
            returned = time.perf_counter()
            if transfers.cuda:
                for begin, done, *copies in transfers.counters.copy_events[listed_before:]:
                    self.batches.append(Batch(_layers(keys), copies[0] if copies else len(slabs), issued, returned,
                                              (begin, done)))
            elif slabs:
                self.batches.append(Batch(_layers(keys), len(slabs), issued, returned, None))
            return result

        setattr(transfers, name, issue)
        self._undo.append(lambda: delattr(transfers, name))

    def start(self) -> None:
        self.batches, self.armed = [], True

    def stop(self, origin: tuple[float, Any]) -> list[dict]:
        """Each batch as {layers, copies, issued_ms, start_ms, end_ms} from `origin` (the host's clock and a CUDA
        event at the prompt's start, as StageClock keeps it; the event None on the CPU). The caller has
        synchronized the device."""
        self.armed = False
        host0, event0 = origin
        out = []
        for batch in self.batches:
            issued = (batch.issued_s - host0) * 1e3
            if batch.events is not None and event0 is not None:
                start, end = (event0.elapsed_time(event) for event in batch.events)
            else:
                start, end = issued, (batch.returned_s - host0) * 1e3
            out.append({"layers": list(batch.layers), "copies": batch.copies, "issued_ms": issued, "start_ms": start,
                        "end_ms": end})
        self.batches = []
        return out

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def _layers(keys) -> tuple[int, ...]:
    return tuple(sorted({layer for layer, _ in keys}))


def link_summary(batches: list[dict], gap_ms: float = GAP_MS) -> dict:
    """The link's busy time (the union of the batches' spans: the urgent and the prefetch stream may overlap),
    the span from the first copy's start to the last one's end, the idle time inside it split by cause, and the
    longest gaps (the layer of the batch after each, when it was issued, how long the link sat idle before it).
    The cause compares a host time with a device time: both count from the prompt's start, where the device is
    idle (the request before ended reading its last token), so the two clocks start together."""
    if not batches:
        return {"batches": 0, "copies": 0}
    ordered = sorted(batches, key=lambda b: b["start_ms"])
    busy = idle_host = idle_waiting = 0.0
    reach = ordered[0]["start_ms"]  # the latest end among the batches so far
    gaps = []
    for batch in ordered:
        gap = batch["start_ms"] - reach
        if gap > gap_ms:
            # issued after the link went idle: the host was late; issued before: the device held it back
            cause = "host" if batch["issued_ms"] >= reach else "waiting"
            if cause == "host":
                idle_host += gap
            else:
                idle_waiting += gap
            gaps.append({"before_layers": batch["layers"], "at_ms": reach, "idle_ms": gap, "cause": cause,
                         "issued_ms": batch["issued_ms"]})
        busy += max(0.0, batch["end_ms"] - max(batch["start_ms"], reach))
        reach = max(reach, batch["end_ms"])
    first, last = ordered[0]["start_ms"], reach
    return {"batches": len(batches), "copies": sum(b["copies"] for b in batches), "first_copy_ms": first,
            "last_copy_end_ms": last, "busy_ms": busy, "idle_ms": (last - first) - busy,
            "idle_host_ms": idle_host, "idle_waiting_ms": idle_waiting,
            "longest_gaps": sorted(gaps, key=lambda g: -g["idle_ms"])[:6]}
