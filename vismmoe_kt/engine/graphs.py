"""Replaying a decode segment from fixed buffers: CUDA graphs, and a CPU twin with the same contract.

A segment is a run of decode pieces with no host logic (vismmoe_kt.engine.decode_step). Captured once,
it reads its inputs from the tensors it was captured with and writes its outputs to the tensors the
capture returned; replaying it launches the whole run at once. Whatever runs between two segments
(offloaded experts, CPU experts) must copy its results into the next segment's input tensors.

`CudaGraphCapture` records a `torch.cuda.CUDAGraph`; all segments of a step, and the steps an engine
makes for larger caches, share one memory pool (the engine's), so a conversation that outgrows its
cache captures again into memory the old graphs gave back.
`ReplayCapture` is the CPU twin: it keeps the same fixed input and output tensors and re-runs the
segment eagerly into them, so the plumbing between segments (which buffer feeds which) is exercised
by the CPU tests exactly as the CUDA path uses it. Both run a segment once before its capture is
replayed, a warm-up whose results are dropped (`warming_up`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..core.context import GRAPH_MODES

State = tuple[torch.Tensor, ...]
_warmup = threading.local()


def warming_up() -> bool:
    """Whether the segment running now is a capture's first run, whose results are dropped (the replay
    right after computes them again). An expert-parallel exchange inside a captured segment skips
    it, so each announced step runs its collectives once on every rank: the replay's."""
    return getattr(_warmup, "active", False)


@contextmanager
def _warming_up() -> Iterator[None]:
    _warmup.active = True
    try:
        yield
    finally:
        _warmup.active = False


class ReplayCapture:
    name = "replay"

    def reset(self) -> None:
        pass

    def capture(self, run: Callable[[], State]) -> tuple[Callable[[], None], State]:
        with _warming_up():  # the caller replays at once: these values are overwritten
            fresh = run()
        with torch.inference_mode(False):  # fixed output tensors, like a graph's pool, written by every replay
            outputs = tuple(t.clone() for t in fresh)  # whether or not it runs in inference mode

        def replay() -> None:
            for fixed, fresh in zip(outputs, run()):
                fixed.copy_(fresh)
        return replay, outputs


class CudaGraphCapture:
    name = "cuda"

    def __init__(self, device: torch.device, pool=None):
        self.device = device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []  # kept alive: a replayed graph must not be freed

    def reset(self) -> None:
        """Drop the graphs captured so far (before capturing the step again)."""
        self.graphs.clear()

    def capture(self, run: Callable[[], State]) -> tuple[Callable[[], None], State]:
        # warm-up on a side stream first, as torch requires (lazy inits, cuBLAS workspaces)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), _warming_up():
            run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the offload runtime's transfer worker keeps copying on its own stream and
        # thread while a segment is captured; only this thread's work belongs to the graph
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = run()
        self.graphs.append(graph)
        return graph.replay, tuple(outputs)


def capture_backend(mode: str, device: torch.device, pool=None):
    """`cuda`, `replay`, or None (eager) for a graphs setting of auto | cuda | replay | off; `pool`: a
    CUDA graph memory pool to share (torch.cuda.graph_pool_handle())."""
    if mode == "off":
        return None
    if mode == "replay":
        return ReplayCapture()
    if mode in ("auto", "cuda"):
        if device.type == "cuda":
            return CudaGraphCapture(device, pool)
        if mode == "cuda":
            raise ValueError(f"graphs: cuda needs the decoder on a CUDA device, it runs on {device}")
        return None
    raise ValueError(f"graphs {mode!r} is not one of: {', '.join(GRAPH_MODES)}")
