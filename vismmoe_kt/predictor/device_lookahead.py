"""DeviceLookahead: VisMMOE's lookahead predictor inside a captured decode step (no host work).

Shapes: L MoE layers (rows), E experts, K experts per token, W window, R history length, B budget.

The offload runtime calls it at every MoE layer of a slab-table decode step (runtime/executors/step_lookahead.py,
on a side stream while the layer's experts compute):

    predicts_at(row)                 whether the step runs the predictor at this row (every `stride`-th
                                     row: each run covers W rows ahead, so S <= W leaves no gap)
    candidates(row, hidden, routed)  -> (rows (B,), experts (B,)) long device tensors: the top-B
                                        (layer row + d, expert) pairs by sigmoid(score) * gamma**(d-1),
                                        expert -1 where the predictor's probability is below
                                        `min_probability` (a prefetch it does not believe in wastes
                                        PCIe bandwidth the misses need)
    end_step(routed)                 after the last layer: the previous-token and recent-usage features
    start_decode(visual)             a request's decode begins: features zeroed, h_v taken

Features are Eq. 7's, built on the device from what the step records (`routed` (L, K): this step's
experts per row, written by the layers before this one) exactly as training builds them from traces
(model.py): the routing history of rows row-R+1..row, the hidden state (the model's, or with
`hidden_source: synthetic` the routing source's latent, through `hidden_of`), the visual summary,
the previous token's experts and the recent-usage table at rows row+1..row+W. Everything is a fixed
sequence of device ops over buffers allocated here, so a CUDA graph replays it.
A graph self-check that runs a step twice advances `recent` twice; that changes only what is
prefetched, never a result.
"""

from __future__ import annotations

from typing import Callable

import torch

from .model import LookaheadPredictor

MIN_PROBABILITY = 0.5  # ours (the paper prefetches the top B unconditionally): see the module docstring


class DeviceLookahead:
    def __init__(self, predictor: LookaheadPredictor, top_b: int, device: torch.device,
                 min_probability: float = MIN_PROBABILITY,
                 hidden_of: Callable[[int, torch.Tensor], torch.Tensor] | None = None, stride: int = 1):
        c = predictor.config
        if not 1 <= stride <= c.window:
            raise ValueError(f"prefetch_stride {stride} must be between 1 and the predictor's window ({c.window}): "
                             "its predictions reach that many layers ahead")
        self.stride = stride
        self.predictor, self.config, self.top_b = predictor.eval(), c, int(top_b)
        self.min_probability, self.hidden_of = float(min_probability), hidden_of
        self.layers, self.experts, self.window = c.num_layers, c.num_experts, c.window
        kw = dict(dtype=torch.float32, device=device)
        self.rows = [torch.tensor([row], dtype=torch.long, device=device) for row in range(c.num_layers)]
        # W zero rows past the last layer: rows l+1 .. l+W is always a plain slice
        self.previous = torch.zeros(c.num_layers + c.window, c.num_experts, **kw)
        self.recent = torch.zeros(c.num_layers + c.window, c.num_experts, **kw)
        self.visual = torch.zeros(1, c.visual_size, **kw)
        self._past_rows = [(torch.arange(row - c.history_length + 1, row + 1, device=device).clamp(min=0),
                            torch.arange(row - c.history_length + 1, row + 1, device=device)[:, None] >= 0)
                           for row in range(c.num_layers)]

    def predicts_at(self, row: int) -> bool:
        return row % self.stride == 0

    def start_decode(self, visual: torch.Tensor | None) -> None:
        self.previous.zero_()
        self.recent.zero_()
        # a predictor of synthetic routing learnt from the router's latent alone: the random-weight
        # model's visual summary means nothing to it (and has the model's size, not the latent's)
        if visual is None or getattr(self.config, "hidden_source", "model") == "synthetic":
            self.visual.zero_()
        else:
            self.visual.copy_(visual.reshape(1, -1).float())

    def _used(self, routed: torch.Tensor) -> torch.Tensor:
        """(rows, E) 0/1 of the experts in `routed` (rows, K)."""
        out = torch.zeros(routed.shape[0], self.experts, dtype=torch.float32, device=routed.device)
        return out.scatter_(1, routed, 1.0)

    @torch.no_grad()
    def candidates(self, row: int, hidden: torch.Tensor, routed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.config, self.window
        rows, before_start = self._past_rows[row]
        past = self._used(routed.index_select(0, rows)) * before_start  # (R, E), zero rows before layer 0
        state = self.hidden_of(row, hidden) if self.hidden_of is not None else hidden
        state = state.reshape(1, -1).float()
        ahead = slice(row + 1, row + 1 + w)
        extra = {"recent": self.recent[ahead][None]} if getattr(c, "recent", False) else {}
        scores = self.predictor(self.rows[row], past[None], state, self.visual,
                                self.previous[ahead][None] if c.previous_token else None, **extra)[0]
        values, flat = self.predictor.top_pairs(row, scores, self.layers, self.top_b)  # value: probability * decay
        distance = flat // self.experts
        believed = values >= self.min_probability * self.predictor.decay.flatten().index_select(0, distance)
        return row + 1 + distance, torch.where(believed, flat % self.experts, -1)

    @torch.no_grad()
    def end_step(self, routed: torch.Tensor) -> None:
        used = self._used(routed)
        decay = getattr(self.config, "recent_decay", 0.0)
        self.recent[:self.layers].mul_(decay).add_(used, alpha=1.0 - decay)
        self.previous[:self.layers].copy_(used)
