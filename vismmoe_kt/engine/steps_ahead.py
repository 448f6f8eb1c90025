"""Greedy decode steps launched one ahead: the device's next step is queued before the host reads this one's tokens.

A batch-1 decode step on a GPU is a few milliseconds of kernels. Between two steps the host reads the
sampled tokens (a device sync), tells the scheduler and the caller, and launches the next step; the
device idles meanwhile (about half a millisecond a step on an H200 with every expert resident, 15% of
the step). Where every row is greedy, the next step's input is the argmax the device already holds, so
the runner (runner.py) launches step t+1 from it before it reads step t's tokens: the host's work
between steps overlaps the device's, and the device runs step after step.

A step launched ahead is a guess that every row goes on. A row that stops (an end-of-sequence token, a
caller's stop, a cancel) or a plan that changes (a prompt to prefill) makes it wrong, and the runner
takes it back: `SlotKVCache.retract` moves each of its rows' lengths back one position (the key it
wrote at that position lies past the length and is written over by the next step there). A step may
only be launched ahead where nothing else of it outlives it (`DecodeStep.chainable`: every piece device
work only, no expert-runtime upkeep between steps), so the tokens are the ones the loop without it
gives; a routing source reads each row's table at the row's own cache length, so it follows the
retraction too.

Each launch reads its tokens back through page-locked memory and an event: the copy is queued right
after the step, and waiting on the event waits for that step only, not the one queued behind it. Two
buffers alternate, one for the step being read and one for the step launched ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LaunchedStep:
    """A decode step queued on the device: its rows and what the host reads of it."""
    ids: tuple[int, ...]   # the sequences of its rows, in row order
    slots: list[int]       # their KV slots
    logits: torch.Tensor   # (B, V): valid until the next step is launched (captured steps reuse their outputs)
    tokens: torch.Tensor   # (B,) each row's argmax, on the device: the next step's input when launched ahead
    host: torch.Tensor     # (B,) the argmax's copy in host memory, complete once `ready` is
    ready: Any             # a CUDA event recorded after the copy; None on the CPU (the copy is done)

    def greedy(self) -> list[int]:
        """Each row's argmax: waits for this step only."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class TokenReads:
    """Queues each launched step's argmax and its copy to the host; two buffers alternate (the step launched
    ahead writes one while the host reads the other)."""

    def __init__(self, rows: int, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self.buffers = [torch.zeros(rows, dtype=torch.long, pin_memory=self.on_cuda) for _ in range(2)]
        self.turn = 0

    def launched(self, ids: tuple[int, ...], slots: list[int], logits: torch.Tensor) -> LaunchedStep:
        tokens = logits.argmax(dim=-1)
        host = self.buffers[self.turn][:len(slots)]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=self.on_cuda)
        ready = None
        if self.on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(ids, list(slots), logits, tokens, host, ready)
