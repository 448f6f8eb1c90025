"""Which visual tokens continue past the pinned prefix: VisMMOE Algorithm 1 and the baselines it is
compared with. Pure functions on tensors (N visual tokens, E experts).

    affinity   Algorithm 1: a salient core (top alpha*N by saliency) anchors accuracy; the rest of
               the budget goes to tokens that add the least new expert demand beyond the core's
               experts, scored p_i = s_i - lambda * Delta_i with Delta_i = |E_i \\ E_core| / |E_i|.
    saliency   top beta*N by saliency alone (VisionZip-style "Zip").
    random     beta*N tokens uniformly at random (seeded).

All return the ascending indices of the kept tokens; exactly floor(beta*N) of them.
Ties in scores go to the lower index (stable), so results are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

METHODS = ("affinity", "saliency", "random", "none")
SALIENCY_SOURCES = ("vision", "llm")


@dataclass
class CompressionSettings:
    """The VisDecoder rule's kwargs: which visual tokens continue past the pinned prefix."""

    compression: str = "affinity"      # affinity (Algorithm 1) | saliency | random | none
    keep_ratio: float = 0.5            # beta, the share of visual tokens kept; 1.0 turns pruning off
    salient_ratio: float | None = None  # alpha, the salient core; default 0.4 * beta
    tradeoff: float = 2.0              # lambda: saliency against new expert demand
    prune_layer: Any = "auto"          # auto: the offload runtime's pinned prefix depth | a decoder-layer index >= 1
    saliency_source: str = "vision"    # vision: attention in the vision encoder's last block | llm: FastV-style
    seed: int = 0                      # for `random`

    def __post_init__(self):
        if self.compression not in METHODS:
            raise ValueError(f"compression {self.compression!r} is not one of: {', '.join(METHODS)}")
        self.keep_ratio = float(self.keep_ratio)
        if not 0 < self.keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
        self.salient_ratio = 0.4 * self.keep_ratio if self.salient_ratio is None else float(self.salient_ratio)
        if not 0 < self.salient_ratio <= self.keep_ratio:
            raise ValueError(f"salient_ratio must be in (0, keep_ratio], got {self.salient_ratio}")
        if self.saliency_source not in SALIENCY_SOURCES:
            raise ValueError(f"saliency_source {self.saliency_source!r} is not one of: {', '.join(SALIENCY_SOURCES)}")
        if self.prune_layer != "auto" and not (isinstance(self.prune_layer, int) and self.prune_layer >= 1):
            raise ValueError(f"prune_layer must be 'auto' or a decoder-layer index >= 1, got {self.prune_layer!r}")
        self.tradeoff = float(self.tradeoff)

    @property
    def active(self) -> bool:
        return self.compression != "none" and self.keep_ratio < 1

    @property
    def needs_vision_saliency(self) -> bool:
        return self.active and self.compression in ("affinity", "saliency") and self.saliency_source == "vision"


def _check(n: int, keep_ratio: float, salient_ratio: float | None = None) -> None:
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio (beta) must be in (0, 1], got {keep_ratio}")
    if salient_ratio is not None and not 0 < salient_ratio <= keep_ratio:
        raise ValueError(f"salient_ratio (alpha) must be in (0, keep_ratio={keep_ratio}], got {salient_ratio}")
    if n < 1:
        raise ValueError("there are no visual tokens to select from")


def normalize(saliency: torch.Tensor) -> torch.Tensor:
    """Min-max to [0, 1]; all-equal saliency maps to all zeros. Decided on the tensor's device (nothing read
    back: a prompt's pruning runs on a GPU without the host waiting)."""
    s = saliency.double()
    low, span = s.min(), s.max() - s.min()
    return torch.where(span > 0, (s - low) / torch.where(span > 0, span, 1.0), 0.0)


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ties to the lower index."""
    order = torch.sort(-scores, stable=True).indices
    return order[:k]


def keep_count(n: int, keep_ratio: float) -> int:
    return max(math.floor(keep_ratio * n), 1)


def affinity_select(saliency: torch.Tensor, expert_masks: torch.Tensor, keep_ratio: float,
                    salient_ratio: float, tradeoff: float = 2.0) -> torch.Tensor:
    """Algorithm 1. saliency (N,), expert_masks (N, E) bool -> kept indices (ascending)."""
    if saliency.dim() != 1 or expert_masks.dim() != 2 or expert_masks.shape[0] != saliency.shape[0]:
        raise ValueError(f"saliency must be (N,) and expert_masks (N, E); got {tuple(saliency.shape)} and "
                         f"{tuple(expert_masks.shape)}")
    n = saliency.shape[0]
    _check(n, keep_ratio, salient_ratio)
    s = normalize(saliency)
    k_keep = keep_count(n, keep_ratio)
    k_core = min(math.floor(salient_ratio * n), k_keep)
    core = _top(s, k_core)
    masks = expert_masks.bool()
    target = masks[core].any(dim=0)
    active = masks.sum(dim=1).clamp(min=1)
    delta = (masks & ~target).sum(dim=1).double() / active.double()
    score = s - tradeoff * delta
    score.index_fill_(0, core, math.inf)  # the core is kept whatever its score (`score[core] = inf` would copy the
    # scalar from host memory: on a GPU a copy that waits for everything queued)
    return torch.sort(_top(score, k_keep)).values


def saliency_select(saliency: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    n = saliency.shape[0]
    _check(n, keep_ratio)
    return torch.sort(_top(normalize(saliency), keep_count(n, keep_ratio))).values


def random_select(n: int, keep_ratio: float, seed: int = 0) -> torch.Tensor:
    _check(n, keep_ratio)
    generator = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(n, generator=generator)[:keep_count(n, keep_ratio)]).values


def select(method: str, saliency: torch.Tensor, expert_masks: torch.Tensor, keep_ratio: float,
           salient_ratio: float, tradeoff: float = 2.0, seed: int = 0) -> torch.Tensor:
    """Dispatch by the rule's `compression:` name."""
    n = saliency.shape[0]
    if method == "none" or keep_ratio >= 1:
        return torch.arange(n)
    if method == "affinity":
        return affinity_select(saliency, expert_masks, keep_ratio, salient_ratio, tradeoff)
    if method == "saliency":
        return saliency_select(saliency, keep_ratio)
    if method == "random":
        return random_select(n, keep_ratio, seed)
    raise ValueError(f"compression {method!r} is not one of: {', '.join(METHODS)}")
