"""Routing statistics: the numbers public routing studies report, measured on any trace.

They are what the synthetic router is calibrated against (benchmarks/fit_routing.py) and what a replayed
real trace can be compared with. Every function takes expert ids [T, L, k] (T tokens, L MoE layers,
k experts per token; a torch tensor or numpy array) and returns plain Python numbers, so the results
go straight into JSON.

Definitions (all per layer, then summarised over layers):
  overlap       |S_t & S_{t-1}| / k for consecutive decode tokens of one request (S_t: token t's k ids)
  reuse         for every selection (t, e) whose expert e was selected earlier in the same request at the
                same layer, the distance t - t' to that latest earlier selection t'; selections with no
                earlier one (first uses) are left out. Summarised as the median, the share at distance 1
                ("repeats at the next token") and the share at distance <= 8.
  entropy       per request: Shannon entropy of the expert selection counts / log E (1.0 = uniform)
  top16_share   per request: share of the selections carried by the 16 most used experts of the layer
  hot_ratio     max count / mean count of a layer: per request, and pooled over the whole trace
                ("corpus") where the trace holds several requests
  vision_max_mean  hot_ratio over vision prefill tokens only (modality 1, phase 0 or no phase given)
Temporal statistics (overlap, reuse) count text tokens that are decode tokens when a phase is given
(all text tokens otherwise); concentration statistics (entropy, top16_share, hot_ratio) use text tokens.
"overall" averages the per-layer values over layers, except reuse, which pools every layer's distances.
`hot_set_jaccard` compares two traces' hot sets (the `top` most used experts of each layer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TOP = 16  # "the 16 most used experts": the published concentration figure


def as_numpy(x: Any, dtype=None) -> np.ndarray | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    return x.astype(dtype) if dtype is not None else x


def selection_mask(ids: np.ndarray, experts: int) -> np.ndarray:
    """[T, L, k] ids -> [T, L, E] bool, True where the token selected the expert at that layer."""
    # T tokens, L layers, k top-k, E experts
    t, layers, _ = ids.shape
    mask = np.zeros((t, layers, experts), dtype=bool)
    np.put_along_axis(mask, ids.astype(np.int64), True, axis=2)
    return mask


def _segments(n: int, request_ids: np.ndarray | None) -> list[slice]:
    """Contiguous runs of one request (a request's tokens are contiguous in a trace)."""
    if request_ids is None or n == 0:
        return [slice(0, n)]
    cuts = np.flatnonzero(np.diff(request_ids)) + 1
    bounds = [0, *cuts.tolist(), n]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def layer_overlap(mask: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Mean |S_t & S_{t-1}| / k per layer over the token pairs (t-1, t) where pairs[t] is True.
    mask: [T, L, E] bool; pairs: [T] bool (pairs[0] is ignored). Returns [L] (nan without pairs)."""
    k = mask[0].sum(-1).max() if len(mask) else 1
    shared = (mask[1:] & mask[:-1]).sum(-1)  # [T-1, L]
    use = pairs[1:]
    if not use.any():
        return np.full(mask.shape[1], np.nan)
    return shared[use].mean(0) / k


def reuse_distances(mask: np.ndarray, valid: np.ndarray, request_ids: np.ndarray | None = None) -> list[np.ndarray]:
    """Per layer, the reuse distances of the selections at tokens where `valid` is True (see module doc).
    Distances count tokens of the trace; they never cross a request boundary."""
    # T tokens, L layers, E experts
    t_count, layers, _ = mask.shape
    req = np.zeros(t_count, np.int64) if request_ids is None else request_ids.astype(np.int64)
    out = []
    for layer in range(layers):
        # (e, t) of every selection, sorted by expert then token: consecutive entries of one expert
        # are consecutive uses, so the distance is a diff (vectorised, no loop over tokens)
        e, t = np.nonzero(mask[:, layer, :].T)
        same = (e[1:] == e[:-1]) & (req[t[1:]] == req[t[:-1]])
        d = (t[1:] - t[:-1])[same & valid[t[1:]]]
        out.append(d)
    return out


def reuse_shares(mask: np.ndarray, windows: tuple[int, ...] = (1, 8)) -> dict[int, np.ndarray]:
    """Per layer, the share of reused selections whose previous use lies within w tokens, for each w.
    Same definition as `reuse_distances` (one request, every token counted), vectorised with cumulative
    sums instead of distances: what the fit evaluates many times. mask [T, L, E] -> {w: [L]}."""
    counts = np.cumsum(mask, axis=0, dtype=np.int32)                       # uses up to and including t
    before = np.concatenate([np.zeros_like(counts[:1]), counts[:-1]])      # uses before t
    reused = (mask & (before > 0)).sum((0, 2))                              # [L] selections with an earlier use
    out = {}
    for w in windows:
        lagged = np.concatenate([np.zeros_like(counts[:w + 1]), counts[:-(w + 1)]])[:len(counts)]
        recent = before - lagged                                            # uses in [t - w, t - 1]
        out[w] = (mask & (recent > 0)).sum((0, 2)) / np.maximum(reused, 1)
    return out


def _reuse_summary(d: np.ndarray) -> dict[str, float]:
    if d.size == 0:
        return {"median": float("nan"), "next": float("nan"), "within8": float("nan")}
    return {"median": float(np.median(d)), "next": float(np.mean(d == 1)), "within8": float(np.mean(d <= 8))}


def concentration(counts: np.ndarray, top: int = TOP) -> dict[str, np.ndarray]:
    """counts: [L, E] selections per expert. Returns per-layer entropy / log E, top-`top` share and
    max / mean (hot_ratio); layers without selections give nan."""
    total = counts.sum(-1, keepdims=True).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = counts / total
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        entropy = -plogp.sum(-1) / np.log(counts.shape[-1])
        top_share = np.sort(counts, axis=-1)[:, ::-1][:, :top].sum(-1) / total[:, 0]
        hot = counts.max(-1) / counts.mean(-1)
    empty = total[:, 0] == 0
    for a in (entropy, top_share, hot):
        a[empty] = np.nan
    return {"entropy": entropy, "top16_share": top_share, "hot_ratio": hot}


def _mean(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def _listed(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float64)]


def trace_stats(ids: Any, experts: int, modality: Any = None, phase: Any = None, request_ids: Any = None,
                top: int = TOP) -> dict[str, Any]:
    """Statistics of a trace, per layer and overall (see the module docstring for the definitions).

    ids: [T, L, k] expert ids; modality: [T] (1 = vision token) or None (all text); phase: [T]
    (0 prefill, 1 decode) or None (all treated as one stream: temporal stats over every token, vision
    stats over every vision token); request_ids: [T] or None (one request). Returns
    {"overall": {name: float}, "per_layer": {name: [L floats]}, "tokens": ..., "requests": ...}.
    """
    # T tokens, L layers, k top-k, E experts
    ids = as_numpy(ids, np.int64)
    if ids.ndim != 3:
        raise ValueError(f"ids must be [tokens, layers, top_k], got shape {tuple(ids.shape)}")
    t_count, layers, _ = ids.shape
    modality = np.zeros(t_count, bool) if modality is None else as_numpy(modality).astype(bool)
    decode = np.ones(t_count, bool) if phase is None else as_numpy(phase).astype(bool)
    prefill = np.ones(t_count, bool) if phase is None else ~decode
    request_ids = None if request_ids is None else as_numpy(request_ids, np.int64)
    mask = selection_mask(ids, experts)

    # consecutive pairs inside one request, both tokens decode (and text: the published overlap is text)
    pairs = decode & ~modality
    pairs[1:] &= pairs[:-1]
    pairs[0] = False
    if request_ids is not None:
        pairs[1:] &= request_ids[1:] == request_ids[:-1]
    overlap = layer_overlap(mask, pairs)

    distances = reuse_distances(mask, decode & ~modality, request_ids)
    reuse_layer = [_reuse_summary(d) for d in distances]
    reuse_all = _reuse_summary(np.concatenate(distances) if distances else np.zeros(0))

    # concentration per request (then averaged), and pooled over the whole trace ("corpus")
    text = ~modality
    per_request = []
    for seg in _segments(t_count, request_ids):
        use = text[seg]
        if use.any():
            per_request.append(concentration(mask[seg][use].sum(0), top))
    conc = {key: np.nanmean(np.stack([r[key] for r in per_request]), 0) if per_request else np.full(layers, np.nan)
            for key in ("entropy", "top16_share", "hot_ratio")}
    corpus_hot = concentration(mask[text].sum(0), top)["hot_ratio"] if text.any() else np.full(layers, np.nan)

    vis = modality & prefill
    vision = concentration(mask[vis].sum(0), top)["hot_ratio"] if vis.any() else np.full(layers, np.nan)

    per_layer = {
        "overlap": _listed(overlap),
        "reuse_median": [r["median"] for r in reuse_layer],
        "reuse_next": [r["next"] for r in reuse_layer],
        "reuse_within8": [r["within8"] for r in reuse_layer],
        "entropy": _listed(conc["entropy"]),
        "top16_share": _listed(conc["top16_share"]),
        "hot_ratio": _listed(conc["hot_ratio"]),
        "corpus_hot_ratio": _listed(corpus_hot),
        "vision_max_mean": _listed(vision),
    }
    overall = {
        "overlap": _mean(overlap),
        "reuse_median": reuse_all["median"],
        "reuse_next": reuse_all["next"],
        "reuse_within8": reuse_all["within8"],
        "entropy": _mean(conc["entropy"]),
        "top16_share": _mean(conc["top16_share"]),
        "hot_ratio": _mean(conc["hot_ratio"]),
        "corpus_hot_ratio": _mean(corpus_hot),
        "vision_max_mean": _mean(vision),
        "vision_max_mean_min": float(np.nanmin(vision)) if np.isfinite(vision).any() else float("nan"),
        "vision_max_mean_max": float(np.nanmax(vision)) if np.isfinite(vision).any() else float("nan"),
    }
    return {"overall": overall, "per_layer": per_layer, "tokens": t_count,
            "requests": len(_segments(t_count, request_ids))}


def hot_sets(ids: Any, experts: int, top: int = TOP) -> np.ndarray:
    """[L, E] bool: the `top` most selected experts of each layer (ties broken by lower id)."""
    ids = as_numpy(ids, np.int64)
    counts = selection_mask(ids, experts).sum(0)  # [L, E]
    # stable argsort of -counts: equal counts keep id order, so the result is deterministic
    order = np.argsort(-counts, axis=-1, kind="stable")[:, :top]
    out = np.zeros_like(counts, dtype=bool)
    np.put_along_axis(out, order, True, axis=-1)
    return out


def hot_set_jaccard(ids_a: Any, ids_b: Any, experts: int, top: int = TOP) -> dict[str, Any]:
    """Jaccard |A & B| / |A | B| of two traces' hot sets (the `top` most used experts per layer).
    Two random `top`-sets of E experts give about top / (2E - top) (0.067 for 16 of 128)."""
    a, b = hot_sets(ids_a, experts, top), hot_sets(ids_b, experts, top)
    if a.shape != b.shape:
        raise ValueError(f"the traces have different layer counts: {a.shape[0]} and {b.shape[0]}")
    inter, union = (a & b).sum(-1), (a | b).sum(-1)
    per_layer = inter / np.maximum(union, 1)
    return {"mean": float(per_layer.mean()), "per_layer": _listed(per_layer)}
