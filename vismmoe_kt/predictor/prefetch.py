"""PredictorPrefetch: the lookahead predictor as the offload runtime's prefetch policy.

After each MoE layer it runs the predictor on the compute stream (VisMMOE Eq. 7's features: the
routing history of this step, the layer's mean hidden state, the visual summary h_v) and queues its
top-B (layer, expert) pairs for the coming layers. On CUDA the priorities reach the host by an
asynchronous copy that the transfer worker waits for, so the compute thread never stops for them.
"""

from __future__ import annotations

from typing import Any

import torch

from .model import LookaheadPredictor, history


class PredictorPrefetch:
    capturable = False  # host logic between layers: a replayed graph would skip it

    def __init__(self, predictor: LookaheadPredictor, top_b: int, hidden_of=None):
        self.predictor, self.top_b = predictor, top_b
        # (MoE-layer index, hidden (T, H)) -> (1, H') the predictor's hidden-state feature; None: the mean
        # of the layer's tokens (a `hidden_source: synthetic` predictor reads the routing source's latent)
        self.hidden_of = hidden_of
        self._step_active: torch.Tensor | None = None  # (MoE layers, E): experts used so far in this step
        self._step_decodes = False  # the step in _step_active is a decode step (one token)
        # the request's recent expert usage (model.py `recent_table`): zeroed by a prefill, then after each
        # decode step recent = decay * recent + (1 - decay) * its experts (W zero rows past the last layer)
        self._recent: torch.Tensor | None = None
        self._previous_active: torch.Tensor | None = None  # (MoE layers, E): the last decode step's experts

    @classmethod
    def load(cls, path: str, top_b: int, num_layers: int, num_experts: int, hidden_size: int,
             device: torch.device) -> "PredictorPrefetch":
        """The predictor file for this model; one calibrated on synthetic routing (hidden_source:
        synthetic) reads a latent of its own size, so only its layers and experts must match."""
        predictor = LookaheadPredictor.load(path, expect={"num_layers": num_layers, "num_experts": num_experts})
        if getattr(predictor.config, "hidden_source", "model") == "model" and predictor.config.hidden_size != hidden_size:
            raise ValueError(f"predictor {path} was trained for hidden_size={predictor.config.hidden_size}, "
                             f"this model has {hidden_size}")
        return cls(predictor.to(device), top_b)

    def observe(self, runtime: Any, layer: int, top_k_index: torch.Tensor) -> None:
        """The predictor's routing history: which experts each MoE layer used so far in this step."""
        index = runtime.moe_layers.index(layer)
        if self._step_active is None or index == 0:
            decoding = top_k_index.shape[0] == 1
            self._fold_recent(decoding, top_k_index.device)
            # the previous decode token's experts at every layer, pinned ones included (as training has them)
            follows = decoding and self._step_active is not None and self._step_decodes
            self._previous_active = self._step_active if follows else None
            self._step_active = torch.zeros(len(runtime.moe_layers), runtime.num_experts, device=top_k_index.device)
            self._step_decodes = top_k_index.shape[0] == 1
        self._step_active[index].index_fill_(0, top_k_index.flatten(), 1.0)

    def _fold_recent(self, decoding: bool, device: torch.device) -> None:
        """A step begins: the finished step, if it decoded, enters the recent-usage table; a prefill empties it."""
        c = self.predictor.config
        if not getattr(c, "recent", False):
            return
        if self._recent is None or not decoding or self._recent.device != device:
            self._recent = torch.zeros(c.num_layers + c.window, c.num_experts, device=device)
        elif self._step_active is not None and self._step_decodes:
            self._recent[:c.num_layers].mul_(c.recent_decay).add_(self._step_active, alpha=1 - c.recent_decay)

    def _previous_token(self, runtime: Any, index: int, decoding: bool) -> torch.Tensor:
        """(1, W, E): the experts the previous decode token used at MoE layers index+1 .. index+W
        (zeros in prefill, for a request's first decode token and past the last layer), like training's."""
        c = self.predictor.config
        out = torch.zeros(1, c.window, runtime.num_experts, device=runtime.device)
        if decoding and self._previous_active is not None:
            ahead = self._previous_active[index + 1:index + 1 + c.window]
            out[0, :ahead.shape[0]] = ahead
        return out

    def after_layer(self, runtime: Any, layer: int, hidden: torch.Tensor) -> None:
        c, device = self.predictor.config, runtime.device
        index = runtime.moe_layers.index(layer)
        past = history(self._step_active, index, c.history_length).to(device)
        visual = runtime.visual_summary
        if visual is None or getattr(c, "hidden_source", "model") == "synthetic":  # see DeviceLookahead.start_decode
            visual = torch.zeros(c.visual_size, device=device)
        previous = self._previous_token(runtime, index, hidden.shape[0] == 1) if c.previous_token else None
        recent = self._recent[None, index + 1:index + 1 + c.window] if self._recent is not None else None
        with torch.no_grad():
            state = self.hidden_of(index, hidden) if self.hidden_of is not None else hidden.float().mean(0, keepdim=True)
            scores = self.predictor(torch.tensor([index], device=device), past[None], state.float(),
                                    visual.float().to(device)[None], previous, recent)[0]
            values, flat = self.predictor.top_pairs(index, scores, len(runtime.moe_layers), self.top_b)
        if values.numel() == 0:
            return

        def items(v: list[float], i: list[int]) -> list:
            return [((runtime.moe_layers[l], e), p) for (l, e), p in self.predictor.to_items(index, v, i)
                    if runtime.moe_layers[l] not in runtime.pinned]

        if runtime.transfers.cuda:
            runtime.transfers.prefetch_later(values, flat, items)
        else:
            runtime.prefetch(items(values.tolist(), flat.tolist()))
