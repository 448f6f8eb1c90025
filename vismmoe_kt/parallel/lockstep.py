"""Data parallel over the expert-parallel group: every rank serves requests of its own.

Each MoE layer's experts are split over the ranks, so each pass of the language model through the MoE
layers (a prefill, a chunk of one, a decode step, batched or not) enters every layer's exchange on
every rank, in layer order. With one front end, rank 0 leads and the others follow it (launch.py).
Here every rank has work of its own, and the ranks keep in step by themselves:

* before each pass, a rank that runs one says so in one all-reduce (a maximum): whether it runs a
  decode step, lean or batched, whose exchanges are the fixed-size ones, and its rows
  (context.ep_fixed_rows; announced by the step's hooks, as the graphs do not run the layers'
  Python), or any other pass (announced by the first expert-parallel layer's forward pre-hook: a
  whole prompt, a chunk). Every rank decides from the same answers which kind runs now; when both
  are asked for, they take turns. The ranks whose kind waits serve the running passes with no
  tokens, then ask again.
* a rank that has no work left calls `drain`. It joins the same all-reduces with zeros and serves
  each pass another rank runs, of its kind, until an all-reduce finds every rank idle. All ranks
  leave at that one collective.

So on every rank the collectives come in the same order: an all-reduce, then the layers' exchanges of
the kind it chose, until the final all-reduce of zeros.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..core.context import context_of_model
from .expert_parallel import guarded
from .launch import Group, expert_parallel_operators


FIXED, FREE = "fixed", "free"  # a decode step, lean or batched (fixed-size exchanges); any other pass


class GroupStopped(RuntimeError):
    """A rank of the group asked to stop (a server shutting down): every rank stops at the same round."""


@guarded
def _passes(fixed: int, free: int, rows: int, stop: int, device: torch.device) -> tuple[bool, bool, int, bool]:
    """Whether any rank runs a decode step (fixed-size exchanges), whether any runs another pass, the
    most rows any decode step brings, and whether any rank stops, now (one all-reduce, the maximum)."""
    asked = torch.tensor([fixed, free, rows, stop], dtype=torch.long, device=device)
    dist.all_reduce(asked, op=dist.ReduceOp.MAX)
    fixed, free, rows, stop = asked.tolist()  # one read of the answers
    return bool(fixed), bool(free), rows, bool(stop)


class Lockstep:
    """Keeps this rank's passes in step with the group's (see the module docstring). Use as a context
    manager around this rank's own work: leaving it drains. Work that raised does not drain: a pass
    cut short leaves the group's collectives out of order, and the other ranks learn of it from the
    group's timeout (a PeerLostError there)."""

    def __init__(self, model: Any, group: Group):
        self.ops = expert_parallel_operators(model)
        self.context = context_of_model(model)
        self.device = torch.device(group.device)
        shape = model.vismmoe.adapter.moe_shape(model.config)
        dtype = model.get_input_embeddings().weight.dtype
        self._empty = (torch.zeros(0, shape.hidden, dtype=dtype, device=self.device),
                       torch.zeros(0, shape.top_k, dtype=torch.long, device=self.device),
                       torch.zeros(0, shape.top_k, dtype=dtype, device=self.device))
        self._idle = False
        self._last: str | None = None  # the kind of the last round's pass (the same on every rank)
        self._stop_asked = False
        self.stopped = False  # a rank asked to stop: no more rounds
        self.passes = 0        # this rank's own passes
        self.idle_passes = 0   # passes of other ranks this rank served with no tokens
        self._hook = self.ops[0].register_forward_pre_hook(self._before_pass)
        self._step_hook = (self._before_step, self._after_step)
        self.context.ep_step_hooks.append(self._step_hook)

    def _before_pass(self, module: Any, args: Any) -> None:
        """A pass that exchanges like a prefill (one rank's pass may meet another's of any size)."""
        if self._idle or self.context.ep_fixed_rows:  # drain's own calls; a decode step's layers (announced)
            return
        self._wait_for_turn(FREE, 0)
        self.passes += 1

    def _before_step(self, rows: int) -> None:
        """A decode step of `rows` rows: it runs with the ranks that run decode steps too, the exchanges
        sized for the most rows any of them brings."""
        self.context.ep_fixed_rows = self.context.ep_step_rows = self._wait_for_turn(FIXED, rows)
        self.passes += 1

    def _after_step(self) -> None:
        self.context.ep_fixed_rows = 0

    def _round(self, want: str | None, rows: int) -> tuple[str | None, int]:
        """One all-reduce: the kind of pass every rank runs now (None: every rank is idle) and, for
        decode steps, their rows. Both kinds asked for: they take turns, from the same answers and
        the same history on every rank. Raises GroupStopped once any rank asked to stop."""
        if self.stopped:
            raise GroupStopped("the expert-parallel group has stopped")
        fixed, free, most, stop = _passes(int(want == FIXED), int(want == FREE), rows, int(self._stop_asked),
                                          self.device)
        if stop:
            self.stopped = True
            raise GroupStopped("a rank of the expert-parallel group stopped")
        if fixed and free:
            kind = FIXED if self._last == FREE else FREE
        else:
            kind = FIXED if fixed else FREE if free else None
        self._last = kind
        return kind, most

    def _wait_for_turn(self, want: str, rows: int) -> int:
        """Serve other ranks' passes of the other kind until this rank's kind runs; its rows."""
        while True:
            kind, most = self._round(want, rows)
            if kind == want:
                return most
            self._serve(most if kind == FIXED else 0)

    def _serve(self, fixed_rows: int) -> None:
        """This rank's expert-parallel layers with no tokens of its own, in another rank's pass."""
        self._idle, self.context.ep_fixed_rows = True, fixed_rows
        try:
            with torch.inference_mode():
                for op in self.ops:
                    op(*self._empty)
        finally:
            self._idle, self.context.ep_fixed_rows = False, 0
        self.idle_passes += 1

    def tick(self) -> bool:
        """One round while this rank has nothing to run (a server waiting for requests): serve the pass
        another rank runs, if any. Whether one ran."""
        kind, most = self._round(None, 0)
        if kind is not None:
            self._serve(most if kind == FIXED else 0)
        return kind is not None

    def ask_to_stop(self) -> None:
        """Stop the group at the next round (any thread; the rounds themselves run on the work's thread)."""
        self._stop_asked = True

    def drain(self) -> None:
        """Serve the other ranks' passes until every rank is idle."""
        if self.stopped:
            return
        while True:
            kind, most = self._round(None, 0)
            if kind is None:
                return
            self._serve(most if kind == FIXED else 0)

    def __enter__(self) -> "Lockstep":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        try:
            if kind is None:
                self.drain()
        finally:
            self._hook.remove()
            if self._step_hook in self.context.ep_step_hooks:
                self.context.ep_step_hooks.remove(self._step_hook)
