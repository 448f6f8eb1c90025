"""The working-set figures of the affinity studies, on one prefill's routing, layer by layer.

A prefill's routing is a list of layers, each (ids [T_l, k], positions [T_l]): the prompt positions
that reached the layer (all of them before the pruning layer, the kept ones after it) and their
experts. affinity_study.py records it from a trained model, affinity_whatif.py from the synthetic router.

    distinct        experts layer l used at all (the layer's working set)
    concentration   share of layer l's assignments in its `top` most used experts, in [0, 1]
    cover           experts that take `share` of layer l's assignments (a working set that ignores strays)
    stability       mean Jaccard |E_t,l & E_t,l+1| / |E_t,l | E_t,l+1| of a token's expert sets at two
                    consecutive layers, over the tokens (of a modality) that reached both; 1: the same set
"""

from __future__ import annotations

import math

import torch

Layer = tuple[torch.Tensor, torch.Tensor]  # (ids [T_l, k], positions [T_l])


def counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1).long(), minlength=experts).float()


def distinct(ids: torch.Tensor, experts: int) -> int:
    return int((counts(ids, experts) > 0).sum())


def concentration(ids: torch.Tensor, experts: int, top: int) -> float:
    c = counts(ids, experts)
    total = float(c.sum())
    return float(c.sort(descending=True).values[:top].sum()) / total if total else math.nan


def cover(ids: torch.Tensor, experts: int, share: float = 0.9) -> int:
    c = counts(ids, experts).sort(descending=True).values
    total = float(c.sum())
    return int((torch.cumsum(c, 0) < share * total).sum()) + 1 if total else 0


def stability(a: Layer, b: Layer, experts: int, tokens: torch.Tensor | None = None) -> float:
    """Mean Jaccard of the expert sets at layers a and b of the positions in both (and in `tokens`, a
    [T] bool mask of prompt positions, when given); NaN where no position qualifies."""
    (ids_a, pos_a), (ids_b, pos_b) = a, b
    common = pos_a[torch.isin(pos_a, pos_b)]
    if tokens is not None:
        common = common[tokens[common]]
    if not len(common):
        return math.nan
    row_a = {int(p): i for i, p in enumerate(pos_a.tolist())}
    row_b = {int(p): i for i, p in enumerate(pos_b.tolist())}
    ia = torch.tensor([row_a[int(p)] for p in common])
    ib = torch.tensor([row_b[int(p)] for p in common])
    sa = torch.zeros(len(common), experts, dtype=torch.bool).scatter_(1, ids_a[ia].long(), True)
    sb = torch.zeros(len(common), experts, dtype=torch.bool).scatter_(1, ids_b[ib].long(), True)
    return float(((sa & sb).sum(1).float() / (sa | sb).sum(1).clamp(min=1).float()).mean())


def layer_figures(layers: list[Layer], modality: torch.Tensor, experts: int, top: int) -> list[dict]:
    """Per layer: distinct, concentration, cover and (to the next layer) visual and text stability."""
    rows = []
    for i, (ids, _) in enumerate(layers):
        row = {"layer": i, "tokens": int(ids.shape[0]), "distinct": distinct(ids, experts),
               "concentration": concentration(ids, experts, top), "cover90": cover(ids, experts)}
        if i + 1 < len(layers):
            row["stability_visual"] = stability(layers[i], layers[i + 1], experts, modality.bool())
            row["stability_text"] = stability(layers[i], layers[i + 1], experts, ~modality.bool())
        rows.append(row)
    return rows


def mean_over(rows: list[dict], key: str, first: int = 0) -> float:
    """Mean of a figure over layers >= first (NaNs left out; NaN if none is left)."""
    values = [r[key] for r in rows[first:] if key in r and not math.isnan(r[key])]
    return sum(values) / len(values) if values else math.nan
