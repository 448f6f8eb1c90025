"""Data parallel over the expert-parallel group: every rank serves requests of its own.

Each MoE layer's experts are split over the ranks, so each pass of the language model through the MoE
layers (a prefill, a chunk of one, a decode step, batched or not) enters every layer's exchange on
every rank, in layer order. With one front end, rank 0 leads and the others follow it (launch.py).
Here every rank has work of its own, and the ranks keep in step by themselves:

* before each pass, a rank that runs one says so: one all-reduce (a sum of 1s), issued by the first
  expert-parallel layer's forward pre-hook. Every pass goes through that layer, however the engine
  reached it: a whole prompt, a chunk, a lean or batched decode step, or a step the graph check runs twice.
* a rank that has no work left calls `drain`. It joins the same all-reduce with 0, and when the sum
  says another rank is running a pass, it runs its expert-parallel layers with no tokens of its own,
  serving its experts to that pass. It leaves when an all-reduce finds every rank idle. All ranks
  leave at that one collective.

So on every rank the collectives come in the same order: an all-reduce, then the layers' exchanges,
until the final all-reduce of zeros. A rank that stays busy never waits for the others longer than a
pass's own exchanges make it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .expert_parallel import guarded
from .launch import Group, expert_parallel_operators


@guarded
def _running(count: torch.Tensor) -> int:
    """The number of ranks running a pass now (this one's `count` included: 1 or 0)."""
    dist.all_reduce(count)
    return int(count.item())


class Lockstep:
    """Keeps this rank's passes in step with the group's (see the module docstring). Use as a context
    manager around this rank's own work: leaving it drains. Work that raised does not drain: a pass
    cut short leaves the group's collectives out of order, and the other ranks learn of it from the
    group's timeout (a PeerLostError there)."""

    def __init__(self, model: Any, group: Group):
        self.ops = expert_parallel_operators(model)
        self.device = torch.device(group.device)
        shape = model.vismmoe.adapter.moe_shape(model.config)
        dtype = model.get_input_embeddings().weight.dtype
        self._empty = (torch.zeros(0, shape.hidden, dtype=dtype, device=self.device),
                       torch.zeros(0, shape.top_k, dtype=torch.long, device=self.device),
                       torch.zeros(0, shape.top_k, dtype=dtype, device=self.device))
        self._idle = False
        self.passes = 0        # this rank's own passes
        self.idle_passes = 0   # passes of other ranks this rank served with no tokens
        self._hook = self.ops[0].register_forward_pre_hook(self._announce)

    def _announce(self, module: Any, args: Any) -> None:
        if not self._idle:  # drain's own calls of the layers are not passes of this rank
            _running(torch.ones(1, dtype=torch.long, device=self.device))
            self.passes += 1

    def drain(self) -> None:
        """Serve the other ranks' passes until every rank is idle."""
        self._idle = True
        try:
            with torch.inference_mode():
                while _running(torch.zeros(1, dtype=torch.long, device=self.device)):
                    for op in self.ops:
                        op(*self._empty)
                    self.idle_passes += 1
        finally:
            self._idle = False

    def __enter__(self) -> "Lockstep":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        try:
            if kind is None:
                self.drain()
        finally:
            self._hook.remove()
