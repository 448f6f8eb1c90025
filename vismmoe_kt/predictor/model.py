"""Compression-guided lookahead predictor (VisMMOE 3.3): which experts the next W MoE layers will need.

Shapes: L MoE layers, E experts per layer, W lookahead window, R history length, H hidden size,
V visual-summary size, B prefetch budget.

Features at MoE layer l (Eq. 7), x_l = [h_r ; h_h ; h_v]:
  h_r  routing history: which experts the last R layers (l-R+1 .. l) used in this step, (R, E) 0/1,
       projected to D_r by the model's first layer;
  h_h  the layer's hidden-state summary (mean over the tokens the layer processed; over the kept
       visual tokens in a compressed prefill);
  h_v  the static visual summary (mean of the kept visual tokens' embeddings), reused through decode.
and, beyond the paper (`previous_token`), the experts the previous decode token used at layers
l+1..l+W, (W, E) 0/1, zeros in prefill and for the first decoded token: about half of a decode
token's experts are its predecessor's, which the current token's earlier layers cannot show.
Model (Eq. 8): z = psi(W2 psi(W1 x)), psi = BatchNorm-ReLU-Dropout, y = W_o z, plus a learned
embedding of l (one predictor serves every layer). `layer_heads` r > 0 adds a per-layer term
U_l (P h_h) + b_l with P: H -> r shared and U_l: r -> (W, E) per layer: each layer's router is a
different map of the hidden state, which one shared MLP fed a layer embedding learns poorly. Output per DESIGN.md: a (W, E) score map, one
row per distance d = 1..W; the runtime ranks (layer l+d, expert e) pairs by sigmoid(y[d, e]) *
gamma**(d-1) and prefetches the top B. `output: vector` gives the paper's E-vector instead, trained
on Eq. 9's decayed targets (`paper_targets`) and applied to every layer of the window.
Training: soft binary cross-entropy. Quality: Hot Recall@B (DESIGN.md), against a random-B guess
and the same model without hidden/visual features (history only).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


def paper_targets(active: torch.Tensor, layer: int, window: int, gamma: float) -> torch.Tensor:
    """Eq. 9: g[e] = max over d in 1..W of gamma**(d-1) * [e active at layer + d]. active: (L, E) bool."""
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    target = torch.zeros(active.shape[1])
    for d in range(1, window + 1):
        if layer + d >= active.shape[0]:
            break
        target = torch.maximum(target, (gamma ** (d - 1)) * active[layer + d].float())
    return target


def window_targets(active: torch.Tensor, layer: int, window: int) -> torch.Tensor:
    """DESIGN.md's (W, E) target map: row d-1 marks the experts layer + d uses (zeros past the last layer)."""
    out = torch.zeros(window, active.shape[1])
    for d in range(1, window + 1):
        if layer + d < active.shape[0]:
            out[d - 1] = active[layer + d].float()
    return out


def history(active: torch.Tensor, layer: int, length: int) -> torch.Tensor:
    """(R, E) routing history ending at `layer` (zeros before layer 0)."""
    out = torch.zeros(length, active.shape[1])
    for r in range(length):
        source = layer - length + 1 + r
        if source >= 0:
            out[r] = active[source].float()
    return out


@dataclass(frozen=True)
class PredictorConfig:
    num_layers: int
    num_experts: int
    hidden_size: int
    visual_size: int
    window: int = 5
    gamma: float = 0.8
    history_length: int = 3
    history_dim: int = 128       # D_r
    width: int = 512             # bottleneck widths
    dropout: float = 0.1
    output: str = "window"       # "window" (W, E) map | "vector" (the paper's E-vector)
    use_features: bool = True    # False: the history-only ablation
    layer_heads: int = 64        # r of the per-layer low-rank hidden-state term; 0: none (the paper's model)
    previous_token: bool = True  # the previous decode token's experts at the window's layers as a feature

# what a predictor saved before these options existed was trained without them
LEGACY_DEFAULTS = {"layer_heads": 0, "previous_token": False}


def _block(inputs: int, outputs: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, outputs), nn.BatchNorm1d(outputs), nn.ReLU(), nn.Dropout(dropout))


class LookaheadPredictor(nn.Module):
    def __init__(self, config: PredictorConfig):
        super().__init__()
        if config.output not in ("window", "vector"):
            raise ValueError(f"predictor output {config.output!r} is not one of: window, vector")
        self.config = config
        c = config
        rows = c.window if c.output == "window" else 1
        self.history_proj = nn.Linear(c.history_length * c.num_experts, c.history_dim)
        self.layer_embedding = nn.Embedding(c.num_layers, c.history_dim)
        if c.previous_token:
            self.previous_proj = nn.Linear(c.window * c.num_experts, c.history_dim)
        features = c.history_dim + (c.hidden_size + c.visual_size if c.use_features else 0)
        self.body = nn.Sequential(_block(features, c.width, c.dropout), _block(c.width, c.width // 2, c.dropout))
        self.head = nn.Linear(c.width // 2, rows * c.num_experts)
        if c.layer_heads and c.use_features:
            self.hidden_proj = nn.Linear(c.hidden_size, c.layer_heads, bias=False)
            self.layer_maps = nn.Parameter(torch.zeros(c.num_layers, c.layer_heads, rows * c.num_experts))
            self.layer_bias = nn.Embedding(c.num_layers, rows * c.num_experts)
            nn.init.zeros_(self.layer_bias.weight)

    def forward(self, layer: torch.Tensor, past: torch.Tensor, hidden: torch.Tensor, visual: torch.Tensor,
                previous: torch.Tensor | None = None) -> torch.Tensor:
        """layer (N,), past (N, R, E), hidden (N, H), visual (N, V), previous (N, W, E) or None (zeros)
        -> scores (N, W or 1, E)."""
        c = self.config
        x = self.history_proj(past.flatten(1)) + self.layer_embedding(layer)
        if c.previous_token and previous is not None:
            x = x + self.previous_proj(previous.flatten(1).to(x.dtype))
        if c.use_features:
            x = torch.cat([x, hidden.to(x.dtype), visual.to(x.dtype)], dim=1)
        y = self.head(self.body(x))
        if c.layer_heads and c.use_features:
            low = self.hidden_proj(hidden.to(y.dtype))                          # (N, r)
            y = y + torch.bmm(low[:, None], self.layer_maps[layer])[:, 0] + self.layer_bias(layer)
        rows = c.window if c.output == "window" else 1
        return y.view(-1, rows, c.num_experts)

    def top_pairs(self, layer: int, scores: torch.Tensor, moe_layers: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tensors (values, flat indices d * E + e) of the top-B pairs ahead of `layer` (no sync)."""
        c = self.config
        probs = torch.sigmoid(scores.float())
        if c.output == "vector":
            probs = probs.expand(c.window, -1)
        decay = torch.tensor([c.gamma ** d for d in range(c.window)], device=probs.device)[:, None]
        ranked = (probs * decay).flatten()  # index d * E + e: layer l + 1 + d, expert e
        valid = max(min(c.window, moe_layers - 1 - layer), 0) * c.num_experts
        return torch.topk(ranked[:valid], min(top, valid))

    def to_items(self, layer: int, values: list[float], flat: list[int]) -> list[tuple[tuple[int, int], float]]:
        """Host-side prefetch items ((MoE-layer index, expert), priority) from `top_pairs` results."""
        experts = self.config.num_experts
        return [((layer + 1 + i // experts, i % experts), v) for i, v in zip(flat, values)]

    def priorities(self, layer: int, scores: torch.Tensor, moe_layers: int, top: int) -> list[tuple[tuple[int, int], float]]:
        """Top-B (layer l+d, expert) pairs from one layer's scores (W or 1, E), as prefetch items."""
        values, flat = self.top_pairs(layer, scores, moe_layers, top)
        return self.to_items(layer, values.tolist(), flat.tolist())

    def save(self, path: str | Path) -> None:
        torch.save({"config": asdict(self.config), "state": self.state_dict()}, path)

    @classmethod
    def load(cls, path: str | Path, expect: dict | None = None) -> "LookaheadPredictor":
        """Load a saved predictor; `expect` (e.g. num_layers, num_experts, hidden_size) must match."""
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            config = PredictorConfig(**{**LEGACY_DEFAULTS, **blob["config"]})
        except Exception as exc:  # torch raises its own unpickling errors for foreign files
            raise ValueError(f"predictor {path}: unreadable ({exc})") from None
        for key, value in (expect or {}).items():
            if getattr(config, key) != value:
                raise ValueError(f"predictor {path} was trained for {key}={getattr(config, key)}, this model has {value}")
        model = cls(config)
        model.load_state_dict(blob["state"])
        return model.eval()


@dataclass
class Samples:
    """Training rows: one per (request, step, MoE layer)."""

    layer: torch.Tensor    # (N,)
    past: torch.Tensor     # (N, R, E)
    hidden: torch.Tensor   # (N, H)
    visual: torch.Tensor   # (N, V)
    target: torch.Tensor   # (N, W, E) window targets, or (N, 1, E) paper targets
    nxt: torch.Tensor      # (N, E) experts the next layer actually used (for Hot Recall)
    previous: torch.Tensor  # (N, W, E) the previous decode token's experts at layers l+1..l+W (zeros: none)

    FIELDS = ("layer", "past", "hidden", "visual", "target", "nxt", "previous")

    def subset(self, mask: torch.Tensor) -> "Samples":
        return Samples(*(getattr(self, f)[mask] for f in self.FIELDS))


def samples_from_steps(steps: list[dict], config: PredictorConfig) -> Samples:
    """steps: dicts with `active` (L, E) bool, `hidden` (L, H), `visual` (V,), `phase`, in order; a
    decode step right after another decode step of the same request (no `new_request` flag) has a
    previous token."""
    rows: dict[str, list] = {k: [] for k in Samples.FIELDS}
    for s, step in enumerate(steps):
        active = step["active"]
        follows = (s > 0 and step.get("phase") == "decode" and steps[s - 1].get("phase") == "decode"
                   and not step.get("new_request", False))
        before = steps[s - 1]["active"] if follows else None
        for layer in range(active.shape[0] - 1):
            rows["layer"].append(layer)
            rows["past"].append(history(active, layer, config.history_length))
            rows["hidden"].append(step["hidden"][layer].float())
            rows["visual"].append(step["visual"].float())
            if config.output == "window":
                rows["target"].append(window_targets(active, layer, config.window))
            else:
                rows["target"].append(paper_targets(active, layer, config.window, config.gamma)[None])
            rows["nxt"].append(active[layer + 1])
            rows["previous"].append(window_targets(before, layer, config.window) if before is not None
                                    else torch.zeros(config.window, active.shape[1]))
    return Samples(torch.tensor(rows["layer"]), *(torch.stack(rows[k]) for k in Samples.FIELDS[1:]))


def hot_recall(model: LookaheadPredictor | None, data: Samples, budget: int, seed: int = 0) -> float:
    """Share of layer l+1's experts in the predicted top-B for layer l+1 (None: a random-B guess)."""
    if model is None:
        generator = torch.Generator().manual_seed(seed)
        guess = torch.stack([torch.randperm(data.nxt.shape[1], generator=generator)[:budget] for _ in range(len(data.layer))])
    else:
        with torch.no_grad():
            scores = model.eval()(data.layer, data.past, data.hidden, data.visual, data.previous)[:, 0]
        guess = torch.topk(scores, budget, dim=1).indices
    chosen = torch.zeros_like(data.nxt).scatter_(1, guess, True)
    hit = (chosen & data.nxt).sum(dim=1).float()
    return float((hit / data.nxt.sum(dim=1).clamp(min=1)).mean())


def train(config: PredictorConfig, train_data: Samples, valid_data: Samples, epochs: int = 80, lr: float = 1e-2,
          budget: int = 20, patience: int = 10, min_epochs: int = 10, seed: int = 0,
          progress=None) -> tuple[LookaheadPredictor, list[dict]]:
    """Soft-BCE training with early stopping on validation Hot Recall@budget (not before `min_epochs`:
    BCE first pushes every score down, which leaves recall flat for a while). Returns the best model."""
    torch.manual_seed(seed)
    model = LookaheadPredictor(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    loss_fn = nn.BCEWithLogitsLoss()
    best, best_state, log, waited = -math.inf, None, [], 0
    batch = 256
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(train_data.layer))
        total = 0.0
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            if len(idx) < 2:  # BatchNorm needs two rows
                continue
            scores = model(train_data.layer[idx], train_data.past[idx], train_data.hidden[idx], train_data.visual[idx],
                           train_data.previous[idx])
            loss = loss_fn(scores, train_data.target[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        recall = hot_recall(model, valid_data, budget)
        log.append({"epoch": epoch, "loss": total / len(order), "valid_hot_recall": recall})
        if progress is not None:
            progress(log[-1])
        if recall > best:
            best, waited = recall, 0
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            waited += 1
            if waited >= patience and epoch >= min_epochs:
                break
    model.load_state_dict(best_state)
    return model.eval(), log
