"""Prefetch policies: which logical experts to copy ahead of need, handed to the runtime.

After each MoE layer the runtime asks its policy for the coming layers' experts and hands the list
(with priorities, higher sooner) to the transfer worker, which replaces its queue with it. Policies:
- `HistoryPrefetch` (here): the experts the next `window` offloaded layers used in the previous
  decode step (never the prompt's routing, which touches most experts), at most K per layer,
  priority gamma**(d-1) at distance d. Decode tokens reuse many of the previous token's
  experts, so yesterday's routing is a fair guess of today's.
- `PredictorPrefetch` (vismmoe_kt.predictor.prefetch): VisMMOE's lookahead predictor's top-B
  (layer, expert) pairs, from the routing so far, the hidden state and the visual summary.
The runtime builds none of them: the operator that creates the runtime hands one in.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class PrefetchPolicy(Protocol):
    #: whether a pinned layer's decode forward stays device work only under this policy (CUDA graphs)
    capturable: bool

    def observe(self, runtime: Any, layer: int, top_k_index: torch.Tensor) -> None:
        """Every MoE layer's routing, before its experts are placed."""

    def after_layer(self, runtime: Any, layer: int, hidden: torch.Tensor) -> None:
        """Queue prefetches for the layers to come (calls `runtime.prefetch` or the transfer worker)."""


class HistoryPrefetch:
    capturable = True

    def __init__(self, window: int, gamma: float):
        self.window, self.gamma = window, gamma

    def observe(self, runtime: Any, layer: int, top_k_index: torch.Tensor) -> None:
        pass  # the runtime keeps `last_routed` itself

    def after_layer(self, runtime: Any, layer: int, hidden: torch.Tensor) -> None:
        if self.window <= 0:
            return
        order = runtime.moe_layers
        start = order.index(layer)
        items = []
        distance = 0
        for step in range(1, len(order)):
            ahead = order[(start + step) % len(order)]
            if ahead in runtime.pinned:
                continue
            distance += 1
            if distance > self.window:
                break
            priority = self.gamma ** (distance - 1)
            # bounded per layer: one decode token's experts
            items += [((ahead, e), priority) for e in runtime.last_routed.get(ahead, [])[:runtime.top_k]]
        if items:
            runtime.prefetch(items)
