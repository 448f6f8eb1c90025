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
different map of the hidden state, which one shared MLP fed a layer embedding learns poorly. Output per docs/design.md "Predictor": a (W, E) score map, one
row per distance d = 1..W; the runtime ranks (layer l+d, expert e) pairs by sigmoid(y[d, e]) *
gamma**(d-1) and prefetches the top B. `output: vector` gives the paper's E-vector instead, trained
on Eq. 9's decayed targets (`paper_targets`) and applied to every layer of the window.
The paper's h_r is "a compressed histogram of recent expert activations"; `recent` adds the request's
recent expert usage at the window's layers, (W, E): per MoE layer an exponential moving average over
the request's previous decode tokens of which experts they used (`recent_table`; zeros in prefill and
for the first decoded token). A request's routing leans on its own hot experts, which neither the
current token's earlier layers nor its predecessor alone show. It is read per expert: a small net
shared by all experts maps (usage share, usage mass, previous-token use) of expert e at layer l+d to
a score added to y[d, e], scaled per (layer, d).
`hidden_source`: "model" (h_h is the model's hidden state) or "synthetic" (a predictor for the
synthetic router, vismmoe_kt/routing/synthetic.py: h_h is the routing source's latent h_l,
hidden_size its latent dim; the serving runtime feeds that latent instead of the model's state).
Training: soft binary cross-entropy. Quality: Hot Recall@B (docs/design.md "Predictor"), against a random-B guess
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
    """The (W, E) target map of docs/design.md "Predictor": row d-1 marks the experts layer + d uses (zeros past the last layer)."""
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
    recent: bool = True          # the request's recent expert usage at the window's layers (`recent_table`)
    recent_decay: float = 0.95   # lam: after each decode token, recent = lam * recent + (1 - lam) * its experts
    recent_width: int = 16       # hidden units of the per-expert net that reads it
    hidden_source: str = "model"  # "model": the model's hidden state; "synthetic": the synthetic router's latent

# what a predictor saved before these options existed was trained without them
LEGACY_DEFAULTS = {"layer_heads": 0, "previous_token": False, "recent": False, "hidden_source": "model"}
HIDDEN_SOURCES = ("model", "synthetic")


def recent_table(steps: list[torch.Tensor], decay: float) -> torch.Tensor:
    """The recent-usage table (L, E) float32 after a request's decode tokens `steps` (each (L, E) 0/1, in
    order): zeros before the first, then recent = decay * recent + (1 - decay) * experts of each token.
    `samples_from_steps` builds the same table step by step, and the serving runtime keeps it."""
    recent = torch.zeros(steps[0].shape, dtype=torch.float32) if steps else torch.zeros(0)
    for active in steps:
        recent = decay * recent + (1 - decay) * active.float()
    return recent


def window_rows(table: torch.Tensor, window: int) -> torch.Tensor:
    """(L - 1, W, E): for each layer l with a next layer, rows l+1 .. l+W of a (L, E) table (zeros past the end)."""
    layers = table.shape[0]
    padded = torch.cat([table, table.new_zeros(window, table.shape[1])])
    rows = torch.arange(layers - 1)[:, None] + 1 + torch.arange(window)[None]
    return padded[rows]


def _block(inputs: int, outputs: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, outputs), nn.BatchNorm1d(outputs), nn.ReLU(), nn.Dropout(dropout))


class LookaheadPredictor(nn.Module):
    def __init__(self, config: PredictorConfig):
        super().__init__()
        if config.output not in ("window", "vector"):
            raise ValueError(f"predictor output {config.output!r} is not one of: window, vector")
        if config.hidden_source not in HIDDEN_SOURCES:
            raise ValueError(f"predictor hidden_source {config.hidden_source!r} is not one of: {', '.join(HIDDEN_SOURCES)}")
        if not 0 <= config.recent_decay < 1:
            raise ValueError(f"recent_decay must be in [0, 1), got {config.recent_decay}")
        self.config = config
        self.layer_counts: list[int] | None = None  # `_layer_term`'s grouping (training only)
        c = config
        rows = c.window if c.output == "window" else 1
        self.history_proj = nn.Linear(c.history_length * c.num_experts, c.history_dim)
        self.layer_embedding = nn.Embedding(c.num_layers, c.history_dim)
        # gamma**(d-1) per distance, (W, 1): made once (a tensor made per call would be a host copy
        # inside a captured decode step); not saved, it follows from the config
        self.register_buffer("decay", torch.tensor([c.gamma ** d for d in range(c.window)])[:, None], persistent=False)
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
        if c.recent:
            # per (expert e, distance d): (usage share, usage mass, previous-token use) -> a score
            self.recent_net = nn.Sequential(nn.Linear(3, c.recent_width), nn.ReLU(), nn.Linear(c.recent_width, 1))
            self.recent_gain = nn.Embedding(c.num_layers, c.window)
            nn.init.ones_(self.recent_gain.weight)

    def forward(self, layer: torch.Tensor, past: torch.Tensor, hidden: torch.Tensor, visual: torch.Tensor,
                previous: torch.Tensor | None = None, recent: torch.Tensor | None = None) -> torch.Tensor:
        """layer (N,), past (N, R, E), hidden (N, H), visual (N, V), previous (N, W, E) or None (zeros),
        recent (N, W, E) rows l+1..l+W of the recent-usage table or None (zeros) -> scores (N, W or 1, E).
        Dense ops only, no data-dependent control flow: one call per MoE layer fits in a CUDA graph."""
        c = self.config
        dtype = self.history_proj.weight.dtype
        x = self.history_proj(past.flatten(1).to(dtype)) + self.layer_embedding(layer)
        if c.previous_token and previous is not None:
            x = x + self.previous_proj(previous.flatten(1).to(dtype))
        if c.use_features:
            x = torch.cat([x, hidden.to(dtype), visual.to(dtype)], dim=1)
        y = self.head(self.body(x))
        if c.layer_heads and c.use_features:
            y = y + self._layer_term(layer, self.hidden_proj(hidden.to(dtype))) + self.layer_bias(layer)
        rows = c.window if c.output == "window" else 1
        y = y.view(-1, rows, c.num_experts)
        if c.recent:
            y = y + self._recent_term(layer, previous, recent, y.shape[0])
        return y

    def _layer_term(self, layer: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """(N, rows * E): each row's per-layer map U_l applied to its projected hidden state low (N, r).
        With `layer_counts` set (training, rows sorted by layer) one matmul per layer computes the same
        values without gathering an (r, rows * E) map per row, several times faster on a CPU."""
        if self.layer_counts is None:
            return torch.bmm(low[:, None], self.layer_maps[layer])[:, 0]
        maps = self.layer_maps.unbind(0)
        return torch.cat([part @ maps[l] for l, part in enumerate(torch.split(low, self.layer_counts)) if len(part)])

    def _recent_term(self, layer: torch.Tensor, previous: torch.Tensor | None, recent: torch.Tensor | None,
                     n: int) -> torch.Tensor:
        """(N, W or 1, E): the per-expert net over the recent-usage rows (and the previous token's experts)."""
        c = self.config
        device, dtype = self.layer_embedding.weight.device, self.history_proj.weight.dtype
        shape = (n, c.window, c.num_experts)
        recent = torch.zeros(shape, device=device, dtype=dtype) if recent is None else recent.to(dtype)
        previous = (torch.zeros(shape, device=device, dtype=dtype) if previous is None or not c.previous_token
                    else previous.to(dtype))
        mass = recent.sum(dim=-1, keepdim=True)                                  # (N, W, 1): (1 - lam^t) * k
        share = recent * (c.num_experts / mass.clamp(min=1e-6))                  # 1 = an average expert's use
        features = torch.stack([share, mass.expand_as(recent), previous], dim=-1)  # (N, W, E, 3)
        term = self.recent_net(features)[..., 0] * self.recent_gain(layer)[:, :, None]
        return term if c.output == "window" else term.sum(dim=1, keepdim=True)

    def top_pairs(self, layer: int, scores: torch.Tensor, moe_layers: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tensors (values, flat indices d * E + e) of the top-B pairs ahead of `layer` (no sync)."""
        c = self.config
        probs = torch.sigmoid(scores.float())
        if c.output == "vector":
            probs = probs.expand(c.window, -1)
        ranked = (probs * self.decay).flatten()  # index d * E + e: layer l + 1 + d, expert e
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
    """Training rows: one per (request, step, MoE layer). 0/1 fields are stored as bool (a large synthetic
    calibration holds millions of rows); the model reads any dtype."""

    layer: torch.Tensor    # (N,)
    past: torch.Tensor     # (N, R, E) bool
    hidden: torch.Tensor   # (N, H)
    visual: torch.Tensor   # (N, V)
    target: torch.Tensor   # (N, W, E) bool window targets, or (N, 1, E) float paper targets
    nxt: torch.Tensor      # (N, E) bool: experts the next layer actually used (for Hot Recall)
    previous: torch.Tensor  # (N, W, E) bool: the previous decode token's experts at layers l+1..l+W (zeros: none)
    recent: torch.Tensor   # (N, W, E) float32: rows l+1..l+W of the request's recent-usage table (zeros: none)
    decode: torch.Tensor   # (N,) bool: the row is of a decode step

    FIELDS = ("layer", "past", "hidden", "visual", "target", "nxt", "previous", "recent", "decode")

    def subset(self, mask: torch.Tensor) -> "Samples":
        return Samples(*(getattr(self, f)[mask] for f in self.FIELDS))

    def inputs(self, index: torch.Tensor | slice | None = None) -> tuple[torch.Tensor, ...]:
        """The model's inputs (layer, past, hidden, visual, previous, recent) of the rows `index` (all: None)."""
        index = slice(None) if index is None else index
        return tuple(getattr(self, f)[index] for f in ("layer", "past", "hidden", "visual", "previous", "recent"))

    @staticmethod
    def concat(parts: list["Samples"]) -> "Samples":
        return Samples(*(torch.cat([getattr(p, f) for p in parts]) for f in Samples.FIELDS))


def samples_from_steps(steps: list[dict], config: PredictorConfig) -> Samples:
    """steps: dicts with `active` (L, E) bool, `hidden` (L, H), `visual` (V,), `phase`, in order; a
    decode step right after another decode step of the same request (no `new_request` flag) has a
    previous token. The recent-usage table starts at zeros at each request's prefill (or a step flagged
    `new_request`) and takes in each decode step after that step's rows are made (`recent_table`)."""
    c = config
    if not steps:
        raise ValueError("no steps to make samples from")
    if c.output == "vector" and not 0 < c.gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {c.gamma}")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in Samples.FIELDS}
    recent = None
    for s, step in enumerate(steps):
        active = step["active"].bool()
        layers, experts = active.shape
        decode, new = step.get("phase") == "decode", step.get("new_request", False)
        follows = s > 0 and decode and steps[s - 1].get("phase") == "decode" and not new
        if recent is None or new or not decode or recent.shape != active.shape:
            recent = torch.zeros(layers, experts, dtype=torch.float32)
        n = layers - 1
        ahead = window_rows(active, c.window)                                     # (n, W, E)
        padded = torch.cat([active.new_zeros(c.history_length - 1, experts), active])
        parts["layer"].append(torch.arange(n))
        parts["past"].append(padded[torch.arange(n)[:, None] + torch.arange(c.history_length)[None]])
        parts["hidden"].append(step["hidden"][:n].float())
        parts["visual"].append(step["visual"].float()[None].expand(n, -1))
        if c.output == "window":
            parts["target"].append(ahead)
        else:
            decay = torch.tensor([c.gamma ** d for d in range(c.window)])[None, :, None]
            parts["target"].append((ahead.float() * decay).amax(dim=1, keepdim=True))
        parts["nxt"].append(active[1:])
        parts["previous"].append(window_rows(steps[s - 1]["active"].bool(), c.window) if follows
                                 else active.new_zeros(n, c.window, experts))
        parts["recent"].append(window_rows(recent, c.window))
        parts["decode"].append(torch.full((n,), decode))
        if decode:
            recent = c.recent_decay * recent + (1 - c.recent_decay) * active.float()
    return Samples(*(torch.cat(parts[k]) for k in Samples.FIELDS))


def _grouped_scores(model: LookaheadPredictor, data: Samples, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, scores) of the rows idx reordered by layer, the per-layer maps computed a layer at a time."""
    layers = data.layer[idx]
    idx = idx[torch.argsort(layers, stable=True)]
    device = model.layer_embedding.weight.device
    model.layer_counts = torch.bincount(layers, minlength=model.config.num_layers).tolist()
    try:
        return idx, model(*(t.to(device, non_blocking=True) for t in data.inputs(idx)))
    finally:
        model.layer_counts = None


def hot_recall(model: LookaheadPredictor | None, data: Samples, budget: int, seed: int = 0, chunk: int = 8192) -> float:
    """Share of layer l+1's experts in the predicted top-B for layer l+1 (None: a random-B guess)."""
    if model is None:
        generator = torch.Generator().manual_seed(seed)
        guess = torch.stack([torch.randperm(data.nxt.shape[1], generator=generator)[:budget] for _ in range(len(data.layer))])
    else:
        model.eval()
        device = data.layer.device
        guess = torch.empty(len(data.layer), budget, dtype=torch.long, device=device)
        with torch.no_grad():
            for start in range(0, len(data.layer), chunk):
                rows = torch.arange(start, min(start + chunk, len(data.layer)), device=device)
                idx, scores = _grouped_scores(model, data, rows)
                guess[idx] = torch.topk(scores[:, 0], budget, dim=1).indices.to(device)
    chosen = torch.zeros_like(data.nxt, dtype=torch.bool).scatter_(1, guess, True)
    hit = (chosen & data.nxt.bool()).sum(dim=1).float()
    return float((hit / data.nxt.sum(dim=1).clamp(min=1)).mean())


def train(config: PredictorConfig, train_data: Samples, valid_data: Samples, epochs: int = 80, lr: float = 1e-2,
          budget: int = 20, patience: int = 10, min_epochs: int = 10, seed: int = 0,
          progress=None, batch: int = 256, schedule: str = "constant", weight_decay: float = 1e-4,
          device: str | torch.device = "cpu") -> tuple[LookaheadPredictor, list[dict]]:
    """Soft-BCE training with early stopping on validation Hot Recall@budget (not before `min_epochs`:
    BCE first pushes every score down, which leaves recall flat for a while). `schedule` "cosine" decays
    the learning rate to zero over `epochs`. The model trains on `device` (the rows may stay on the CPU).
    Returns the best model, on the CPU."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule {schedule!r} is not one of: constant, cosine")
    torch.manual_seed(seed)
    model = LookaheadPredictor(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    loss_fn = nn.BCEWithLogitsLoss()
    best, best_state, log, waited = -math.inf, None, [], 0
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(train_data.layer)).to(train_data.layer.device)
        steps = max(1, math.ceil(len(order) / batch))
        total = torch.zeros((), device=device)
        for i, start in enumerate(range(0, len(order), batch)):
            if schedule == "cosine":
                for group in optimizer.param_groups:
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (epoch + i / steps) / epochs))
            idx = order[start:start + batch]
            if len(idx) < 2:  # BatchNorm needs two rows
                continue
            idx, scores = _grouped_scores(model, train_data, idx)
            loss = loss_fn(scores, train_data.target[idx].to(scores.device, scores.dtype))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)
        recall = hot_recall(model, valid_data, budget)
        log.append({"epoch": epoch, "loss": float(total) / len(order), "valid_hot_recall": recall})
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
    return model.cpu().eval(), log
