"""A prompt's vision tower replayed as one CUDA graph per picture size.

Shapes: S patches (every image's, packed), C the patches' input width, grid (images, 3) each image's
temporal, height and width in patches.

A picture runs every block of the vision encoder once (27 for Qwen3-VL-30B-A3B) as transformers' modules:
several hundred kernels for a 448 px image, each launched by Python, for about 0.65 TFLOP of device work
(29 ms for the tower in a prompt on the H200, 2026-12-04), and on top the grid's own tensors (where each
patch samples the learned position table, its rotary positions, the images' bounds) made on the host from
the grid at every call, with waits. Everything in it but the pixels is fixed by the grid, and a deployment
sees few picture sizes. So per grid (and pixel shape and dtype):

    first picture   the tower runs eagerly (its result is returned); the grid's tensors are made once
                    (`ModelAdapter.vision_graph_inputs`: the values transformers' forward would compute, which
                    it takes as precomputed arguments); the tower is captured reading a fixed pixel buffer
                    with them, replayed once, and its outputs checked against the eager run's (a few units of
                    the dtype's rounding); a mismatch or a capture error leaves that grid eager, and says why
    later pictures  the pixels copied into the buffer, one replay, the outputs cloned (a chunked prefill may
                    hold a picture's features while the next picture's replay writes the buffers)

The graphs share one memory pool and at most MAX_GRIDS of them are kept (the oldest goes). A call the graph
cannot stand for runs the tower's own forward: gradients or training, arguments beyond `return_dict` and
`use_cache` (attentions, hidden states asked for), or a hook on a module inside the tower that a replay would
skip. A hook whose owner is a `RecordsInputs` (the saliency recorder, while compression asks for saliency)
only keeps tensors the forward computes: the graph returns those beside the tower's outputs and hands a
replay's values back to the owner, so the tower is replayed with it (a grid's key says which owners were
hooked). On the CPU `graphs: replay` (graphs.ReplayCapture) runs the same plumbing eagerly, which is what
the tests check.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils import _pytree

from ..models import ModelAdapter
from .decode_step import logits_difference
from .graphs import State, capture_backend

MAX_GRIDS = 4  # picture sizes whose graphs are kept (each holds its activations' memory in the pool)
# arguments the model's forward passes the tower that change nothing a replay computes (part of a grid's key)
PASSIVE_ARGUMENTS = {"return_dict", "use_cache"}


@runtime_checkable
class RecordsInputs(Protocol):
    """The owner of a hook inside the tower that a replay can stand for: the hook keeps tensors the forward
    computes, launching nothing and reading nothing on the host."""

    def recorded(self) -> list[torch.Tensor] | None:
        """What the last forward kept, as tensors (None: nothing, or what it kept cannot be returned)."""

    def restore(self, tensors: list[torch.Tensor]) -> None:
        """Take `tensors` (a replay's values of what `recorded` gave) as what the last forward kept."""


@dataclass
class VisionGraphCounters:
    replays: int = 0            # pictures served by a replay
    captures: int = 0           # grids captured (and checked)
    eager_calls: int = 0        # calls run by the tower's own forward
    check_failures: int = 0     # captures whose outputs differed from the eager run: that grid stays eager
    capture_failures: int = 0
    check_max_difference: float = 0.0
    reason_eager: str = ""      # the last reason a grid was left eager


@dataclass
class _Grid:
    pixels: torch.Tensor        # the buffer the graph reads
    replay: Callable[[], None]
    outputs: State              # the tensor leaves the graph writes, in the eager output's order
    spec: Any                   # how the leaves make the tower's output again (torch pytree)
    recorded: list[int]         # after the tower's leaves in `outputs`: how many each hook's owner kept, in order
    # the grid's tensors the graph reads (made outside its pool): held as long as the graph, or the allocator
    # would hand their memory to whatever runs next and a replay would read that
    inputs: dict[str, Any]
    grid_thw: torch.Tensor


class GraphedVisionTower:
    """A replacement forward for the vision tower: `(hidden_states (S, C), grid_thw, **kwargs)` -> the tower's
    own output. `backend`: makes one capture per grid (graphs.CudaGraphCapture sharing a pool, or ReplayCapture)."""

    def __init__(self, tower: nn.Module, adapter: ModelAdapter, backend: Callable[[], Any]):
        self.tower, self.adapter, self.backend = tower, adapter, backend
        self.own_forward = tower.forward
        self.grids: OrderedDict[tuple, _Grid | None] = OrderedDict()  # None: this grid runs eagerly
        self.counters = VisionGraphCounters()

    def recorders(self, kwargs: dict) -> tuple[RecordsInputs, ...] | None:
        """The owners of the hooks inside the tower, for inference with nothing asked beyond the output; None
        where a replay cannot stand for the call (training, gradients, more asked, a hook it would skip)."""
        if self.tower.training or torch.is_grad_enabled() or set(kwargs) - PASSIVE_ARGUMENTS:
            return None
        owners = []
        for module in self.tower.modules():
            if module is self.tower:
                continue
            for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
                owner = getattr(hook, "__self__", None)
                if not isinstance(owner, RecordsInputs):
                    return None
                owners.append(owner)
        return tuple(owners)

    def __call__(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        owners = self.recorders(kwargs)
        if owners is None:
            return self._eager(hidden_states, grid_thw, kwargs)
        key = (tuple(tuple(row) for row in grid_thw.tolist()), tuple(hidden_states.shape), hidden_states.dtype,
               tuple(sorted(kwargs.items())), tuple(id(owner) for owner in owners))
        if key not in self.grids:
            return self._first(key, hidden_states, grid_thw, kwargs, owners)
        self.grids.move_to_end(key)
        grid = self.grids[key]
        if grid is None:
            return self._eager(hidden_states, grid_thw, kwargs)
        grid.pixels.copy_(hidden_states)
        grid.replay()
        self.counters.replays += 1
        values = [t.clone() for t in grid.outputs]
        tower_leaves = start = len(values) - sum(grid.recorded)
        for owner, count in zip(owners, grid.recorded):  # each owner gets this picture's values of what it keeps
            owner.restore(values[start:start + count])
            start += count
        return _pytree.tree_unflatten(values[:tower_leaves], grid.spec)

    def _eager(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, kwargs: dict) -> Any:
        self.counters.eager_calls += 1
        return self.own_forward(hidden_states, grid_thw=grid_thw, **kwargs)

    def _first(self, key: tuple, hidden_states: torch.Tensor, grid_thw: torch.Tensor, kwargs: dict,
               owners: tuple[RecordsInputs, ...]) -> Any:
        """A grid's first picture: eager, then the capture, checked against it. The hooks' owners keep the eager
        run's records whatever the capture's runs left them."""
        eager = self._eager(hidden_states, grid_thw, kwargs)
        if len(self.grids) >= MAX_GRIDS:
            self.grids.popitem(last=False)
        self.grids[key] = None
        inputs = self.adapter.vision_graph_inputs(self.tower, grid_thw)
        if inputs is None:
            self.counters.reason_eager = "the adapter cannot give this tower's grid tensors"
            return eager
        leaves, spec = _pytree.tree_flatten(eager)
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            self.counters.reason_eager = "the tower's output holds more than tensors"
            return eager
        records = [owner.recorded() for owner in owners]
        if any(record is None for record in records):
            self.counters.reason_eager = "a hook inside the tower kept nothing a replay could return"
            return eager
        with torch.inference_mode(False):  # a buffer later pictures copy into under no_grad or inference mode alike
            pixels = hidden_states.clone()

        def run() -> State:
            # the helpers pop what they take: a fresh dict each run
            out = self.own_forward(pixels, grid_thw=grid_thw, **kwargs, **inputs)
            return tuple(_pytree.tree_flatten(out)[0]) + tuple(t for owner in owners for t in owner.recorded())

        try:
            replay, outputs = self.backend().capture(run)
            replay()
        except Exception as error:  # capture errors (a host read inside the tower): this grid stays eager
            self.counters.capture_failures += 1
            self.counters.reason_eager = f"capture failed: {type(error).__name__}: {error}"
            return self._restored(eager, owners, records)
        self.counters.captures += 1
        difference, failure = _compare(outputs, leaves + [t for record in records for t in record])
        self.counters.check_max_difference = max(self.counters.check_max_difference, difference)
        if failure is not None:
            self.counters.check_failures += 1
            self.counters.reason_eager = failure
            return self._restored(eager, owners, records)
        self.grids[key] = _Grid(pixels, replay, outputs, spec, [len(record) for record in records], inputs, grid_thw)
        return self._restored(eager, owners, records)

    @staticmethod
    def _restored(eager: Any, owners: tuple[RecordsInputs, ...], records: list) -> Any:
        for owner, record in zip(owners, records):
            owner.restore(record)
        return eager

    def stats(self) -> dict[str, Any]:
        out = asdict(self.counters)
        if not out["reason_eager"]:
            out.pop("reason_eager")
        out["grids"] = sum(grid is not None for grid in self.grids.values())
        return out


def _compare(graphed: State, eager: list[torch.Tensor]) -> tuple[float, str | None]:
    """(the largest difference over the outputs, why the replay fails the check or None): each output within the
    decode step's self-check tolerance at its own scale (the same kernels run: a correct graph differs by
    library-level reordering at most)."""
    if len(graphed) != len(eager):
        return float("inf"), f"the replay gave {len(graphed)} outputs, the eager tower {len(eager)}"
    worst = 0.0
    for index, (g, e) in enumerate(zip(graphed, eager)):
        if g.shape != e.shape or g.dtype != e.dtype:
            return float("inf"), f"output {index} of the replay is {g.dtype} {tuple(g.shape)}, eagerly " \
                                 f"{e.dtype} {tuple(e.shape)}"
        if not e.numel():
            continue
        if not e.is_floating_point():  # a hook's integer record (an image's bounds): exactly the eager run's
            if not torch.equal(g, e):
                return float("inf"), f"output {index} of the replay differed from the eager tower"
            continue
        difference, tolerance = logits_difference(g, e)
        worst = max(worst, difference)
        if difference > tolerance:
            return worst, f"output {index} of the replay differed from the eager tower by {difference:.3g} " \
                          f"(tolerance {tolerance:.3g})"
    return worst, None


def install(adapter: ModelAdapter, model: nn.Module, mode: str) -> GraphedVisionTower | None:
    """Give the model's vision tower the replayed forward where the adapter allows it and graphs run (`mode`: the
    decode engine's graphs setting, graphs.capture_backend's); the forward installed, or None."""
    if mode == "off" or not adapter.vision_tower_replayable():
        return None
    tower = adapter.vision_tower(model)
    # an operator that wraps the tower (a rule's VisionSaliency, which passes every call through): the tower inside
    while getattr(tower, "is_injected_operator", False) and isinstance(getattr(tower, "orig_module", None), nn.Module):
        tower = tower.orig_module
    if "forward" in vars(tower):  # something replaced it already
        return None
    device = next(tower.parameters()).device
    if mode != "replay" and device.type != "cuda":
        return None
    pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None  # the towers' graphs share one
    graphed = GraphedVisionTower(tower, adapter, lambda: capture_backend(mode, device, pool))
    tower.forward = graphed
    return graphed
