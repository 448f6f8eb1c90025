"""The pinned-prefix depth within Eq. 10's range that minimises predicted time per decode token.

Eq. 10 (budget.py) bounds the depth L_pinned; this module prices each depth p of that range for one
decode token and picks one. Glossary: L MoE layers, E experts per layer, k experts per token,
S = E * B bytes per layer (B bytes per expert), M the expert budget.

    slabs(p)    = min(floor((M - p S) / B), (L - p) E)        the cache left for the L - p offloaded layers
    c(p)        = slabs(p) / (L - p)                           experts per offloaded layer (equal split)
    n_l(p)      = k (1 - h_l(c(p)))   for l >= p,  0 for l < p  experts layer l reads from the host per token
    compute_l   = t_layer + (t_offload if l >= p)              a layer's compute, plus the offloaded-layer upkeep

h_l(c) is layer l's decode hit rate with a cache of c experts: a HitRateCurve, measured by replaying
routing (the synthetic router's or a recorded trace) through an LRU cache per layer
(vismmoe_kt/routing/belady.py; `python -m benchmarks.pinned_depth` computes and writes
one). The runtime shares one slab pool among the offloaded layers; splitting it equally is the
approximation (on the synthetic trace, 16 and 32 GiB, 0-12 pinned layers, a shared-pool LRU hit
0.2-1.8 points more than the split). Below k experts a layer cannot hold one token's experts; h_l is
then taken linearly down from h_l(k) to 0 (optimistic: there the shared pool thrashes, 18% against
44% at 7.9 slabs per layer): such depths are slow either way.

Time per token, `lookahead` W (in the reads below, B is what a miss reads from the host: with a
quantized store its block, a half or a quarter of the slab B the budget holds; `read_bytes`):
    W = 0 (today's offloaded decode: a miss is read when its layer runs, zero-copy at bw_zc)
        T(p) = sum_l compute_l + n_l B / bw_zc
    W >= 1 (prefetch: a fraction `recall` of layer l's misses is known when layer max(l - W, 0) starts
        and copied then on one link at bw_copy, in layer order; the rest is read when the layer runs)
        ready_l = end_{l-1};  link_l = max(link_{l-1}, ready_{max(l-W, 0)}) + recall n_l B / bw_copy
        end_l   = max(ready_l, link_l) + compute_l + (1 - recall) n_l B / bw_zc;   T(p) = end_{L-1}
        (a pinned prefix gives the first offloaded layers' copies its compute to hide behind: the
        paper's startup overlap; PCIe contention between the two kinds of reads is not modelled)

Choice: the fastest depth (exact ties: the deepest). `tolerance` > 0 widens the tie to the depths
predicted within that fraction of the fastest, the deepest of them kept: a deeper prefix gives the
predictor and the compressor more routing context (VisMMOE 3.4.1, Figure 12), which this model does
not price. The default is 0 because that context was not worth its slabs when measured: a 2% tolerance
pinned 3 layers at 6 GiB of Q4_K (384 slabs fewer than 1 layer) and the default rules decoded at 0.96x
of `lru` (H100, 448 px, synthetic routing), while the predictor (0.99x) and compression (0.95-1.01x)
never paid in decode and the trained model's routing showed no visual-expert affinity (docs/design.md).

The bandwidths and compute times are inputs. Where nothing was measured the defaults are the H200's
(BENCHMARKS.md, 2026-11-30): zero-copy 45.7 GB/s and copy engine 53.7 GB/s (decode_kernel_bench),
0.183 ms per layer (113.84 tok/s all resident over 48 layers, lean graphs), 10.8 us per offloaded layer
(the `lru` runtime at 1.06x the resident step with every expert cached); `sources` says which is which.
"""

from __future__ import annotations

import bisect
import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# the decode hit rates shipped for Qwen3-VL-30B-A3B's shape (48 x 128 experts, top-8, BF16)
SHIPPED_CURVE = Path(__file__).with_name("decode_hit_rates_qwen3_vl_30b_a3b.json")

H200_DEFAULTS = {  # figure -> (value, where it comes from)
    "zero_copy_bytes_per_s": (45.7e9, "H200 default (BENCHMARKS.md: decode_kernel_bench, table host)"),
    "copy_bytes_per_s": (53.7e9, "H200 default (BENCHMARKS.md: decode_kernel_bench, copy engine)"),
    "layer_seconds": (1 / 113.84 / 48, "H200 default (BENCHMARKS.md: all resident 113.84 tok/s, 48 layers)"),
    "offload_overhead_seconds": (10.8e-6, "H200 default (BENCHMARKS.md: lru 1.06x the resident step, all cached)"),
}


@dataclass(frozen=True)
class HitRateCurve:
    """Decode hit rate of each layer's expert cache against its capacity. L layers, C capacities."""
    capacities: tuple[int, ...]           # [C] experts per layer, ascending, the first one top_k
    rates: tuple[tuple[float, ...], ...]  # [L][C]
    experts: int
    top_k: int
    expert_bytes: int = 0                 # the shape it was measured for (0: any)
    source: str = ""

    def __post_init__(self):
        caps = list(self.capacities)
        if not caps or caps != sorted(set(caps)) or caps[0] < 1 or caps[-1] > self.experts:
            raise ValueError(f"capacities must ascend within 1..{self.experts}, got {caps}")
        if not self.rates or any(len(row) != len(caps) for row in self.rates):
            raise ValueError(f"rates must be one row of {len(caps)} values per layer")

    @property
    def layers(self) -> int:
        return len(self.rates)

    def rate(self, layer: int, capacity: float) -> float:
        """h_layer(capacity), linear between the measured capacities (and from 0 below the first)."""
        caps, row = self.capacities, self.rates[layer]
        if capacity <= caps[0]:
            return row[0] * max(capacity, 0.0) / caps[0]
        if capacity >= caps[-1]:
            return row[-1]
        i = bisect.bisect_right(caps, capacity)
        lo, hi = caps[i - 1], caps[i]
        return row[i - 1] + (row[i] - row[i - 1]) * (capacity - lo) / (hi - lo)

    def as_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "experts": self.experts, "top_k": self.top_k, "expert_bytes": self.expert_bytes,
                "source": self.source, "capacities": list(self.capacities),
                "rates": [[round(r, 5) for r in row] for row in self.rates]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HitRateCurve":
        try:
            return cls(tuple(int(c) for c in data["capacities"]), tuple(tuple(float(r) for r in row) for row in data["rates"]),
                       int(data["experts"]), int(data["top_k"]), int(data.get("expert_bytes", 0)), str(data.get("source", "")))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a hit-rate curve (needs capacities, rates, experts, top_k): {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "HitRateCurve":
        return cls.from_dict(json.loads(Path(path).read_text()))


@functools.cache
def shipped_curve() -> HitRateCurve | None:
    return HitRateCurve.load(SHIPPED_CURVE) if SHIPPED_CURVE.exists() else None


@dataclass(frozen=True)
class DepthModel:
    """Everything the prediction needs besides the budget; see the module docstring for the formula."""
    curve: HitRateCurve
    expert_bytes: int        # B: an expert's slab on the GPU (what the budget holds)
    zero_copy_bytes_per_s: float = H200_DEFAULTS["zero_copy_bytes_per_s"][0]
    copy_bytes_per_s: float = H200_DEFAULTS["copy_bytes_per_s"][0]
    layer_seconds: float = H200_DEFAULTS["layer_seconds"][0]
    offload_overhead_seconds: float = H200_DEFAULTS["offload_overhead_seconds"][0]
    lookahead: int = 0       # W: 0 reads misses when their layer runs; >= 1 prefetches W layers ahead
    recall: float = 1.0      # with W >= 1: the fraction of misses known ahead
    tolerance: float = 0.0   # depths within this fraction of the fastest count as equal (the deepest wins)
    read_bytes: int = 0      # bytes a miss reads from the host (a quantized store's block); 0: expert_bytes
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # figure -> where it came from

    def __post_init__(self):
        if self.zero_copy_bytes_per_s <= 0 or self.copy_bytes_per_s <= 0:
            raise ValueError("bandwidths must be positive")
        if self.layer_seconds < 0 or self.offload_overhead_seconds < 0:
            raise ValueError("compute times must not be negative")
        if self.lookahead < 0 or not 0 <= self.recall <= 1 or self.tolerance < 0:
            raise ValueError("lookahead >= 0, recall in [0, 1] and tolerance >= 0 are required")

    def source(self, figure: str) -> str:
        return dict(self.sources).get(figure, H200_DEFAULTS[figure][1] if figure in H200_DEFAULTS else "given")

    def describe(self, short: bool = False) -> str:
        """The inputs and where each came from; `short`: one line for the runtime's summary."""
        gb = 1e9
        if short:
            names = {"zero_copy_bytes_per_s": "zero-copy rate", "copy_bytes_per_s": "copy rate",
                     "layer_seconds": "layer compute", "offload_overhead_seconds": "offload upkeep"}
            used = [f for f in names if f != "copy_bytes_per_s" or self.lookahead]
            defaults = [names[f] for f in used if self.source(f).startswith("H200 default")]
            reads = (f"{self.recall:.0%} prefetched {self.lookahead} layer(s) ahead at {self.copy_bytes_per_s / gb:.1f} GB/s"
                     if self.lookahead else "misses read when their layer runs")
            return (f"{reads}, zero-copy {self.zero_copy_bytes_per_s / gb:.1f} GB/s, {self.layer_seconds * 1e3:.3f} ms "
                    f"per layer + {self.offload_overhead_seconds * 1e6:.1f} us per offloaded layer"
                    + (f" ({'all' if len(defaults) == len(used) else ', '.join(defaults)}: H200 defaults, not "
                       f"measured here)" if defaults else "")
                    + f"; hit rates: {self.curve.source.split(' (')[0] or 'given curve'}")
        if self.lookahead:
            reads = (f"{self.recall:.0%} of misses prefetched {self.lookahead} layer(s) ahead at "
                     f"{self.copy_bytes_per_s / gb:.1f} GB/s [{self.source('copy_bytes_per_s')}], the rest read "
                     f"when their layer runs at {self.zero_copy_bytes_per_s / gb:.1f} GB/s "
                     f"[{self.source('zero_copy_bytes_per_s')}]")
        else:
            reads = (f"misses read when their layer runs at {self.zero_copy_bytes_per_s / gb:.1f} GB/s "
                     f"[{self.source('zero_copy_bytes_per_s')}]")
        return (f"{reads}; compute {self.layer_seconds * 1e3:.3f} ms per layer [{self.source('layer_seconds')}] "
                f"+ {self.offload_overhead_seconds * 1e6:.1f} us per offloaded layer "
                f"[{self.source('offload_overhead_seconds')}]; hit rates: {self.curve.source or 'given curve'}")


@dataclass(frozen=True)
class DepthRow:
    """One candidate depth's prediction (per decode token)."""
    depth: int
    slabs: int
    per_layer: float     # slabs per offloaded layer
    hit_rate: float      # over the offloaded layers' accesses (1.0 with nothing offloaded)
    experts_read: float  # experts read from the host
    bytes_read: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"depth": self.depth, "slabs": self.slabs, "slabs_per_offloaded_layer": round(self.per_layer, 2),
                "hit_rate": round(self.hit_rate, 4), "experts_read_per_token": round(self.experts_read, 2),
                "bytes_read_per_token": int(self.bytes_read), "ms_per_token": round(self.seconds * 1e3, 4)}


@dataclass(frozen=True)
class DepthChoice:
    """The pinned depth the runtime uses, and why; `rows` are the candidates priced (empty: none were)."""
    depth: int
    reason: str
    rows: tuple[DepthRow, ...] = ()
    valid: tuple[int, int] | None = None  # Eq. 10's range, inclusive
    basis: str = ""                       # the inputs of the prediction, where one was made

    def as_dict(self) -> dict[str, Any]:
        return {"depth": self.depth, "reason": self.reason, "basis": self.basis,
                "valid_range": list(self.valid) if self.valid else None, "candidates": [row.as_dict() for row in self.rows]}


def _token_seconds(model: DepthModel, misses: list[float], depth: int) -> float:
    block = model.read_bytes or model.expert_bytes  # what crosses the link per miss
    compute = [model.layer_seconds + (model.offload_overhead_seconds if layer >= depth else 0.0)
               for layer in range(len(misses))]
    if model.lookahead == 0:
        return sum(c + n * block / model.zero_copy_bytes_per_s for c, n in zip(compute, misses))
    ready: list[float] = []
    end = link = 0.0
    for layer, (c, n) in enumerate(zip(compute, misses)):
        ready.append(end)  # layer `layer` could start now
        link = max(link, ready[max(layer - model.lookahead, 0)]) + model.recall * n * block / model.copy_bytes_per_s
        end = max(end, link) + c + (1 - model.recall) * n * block / model.zero_copy_bytes_per_s
    return end


def predict(model: DepthModel, budget: int, num_layers: int, depth: int) -> DepthRow:
    """Price pinning the first `depth` of `num_layers` MoE layers at an expert budget of `budget` bytes."""
    curve, block = model.curve, model.expert_bytes
    if curve.layers != num_layers:
        raise ValueError(f"the hit-rate curve has {curve.layers} layers, the model {num_layers}")
    offloaded = num_layers - depth
    slabs = max(min((budget - depth * curve.experts * block) // block, offloaded * curve.experts), 0)
    per_layer = slabs / offloaded if offloaded else 0.0
    misses = [0.0] * depth + [curve.top_k * (1 - curve.rate(layer, per_layer)) for layer in range(depth, num_layers)]
    read = sum(misses)
    hit = 1 - read / (offloaded * curve.top_k) if offloaded else 1.0
    return DepthRow(depth, int(slabs), per_layer, hit, read, read * (model.read_bytes or block),
                    _token_seconds(model, misses, depth))


def choose(model: DepthModel, budget: int, num_layers: int, valid: range) -> DepthChoice:
    """Price every depth of `valid` (non-empty, within 0..num_layers) and pick one (module docstring)."""
    rows = tuple(predict(model, budget, num_layers, depth) for depth in valid)
    best = min(rows, key=lambda r: (r.seconds, r.depth))
    near = [r for r in rows if r.seconds <= best.seconds * (1 + model.tolerance)]
    chosen = max(near, key=lambda r: r.depth)
    span = f"Eq. 10's {valid.start}..{valid.stop - 1}"
    if chosen is best:
        why = f"the fastest of {span}"
        deeper = next((r for r in rows if r.depth == chosen.depth + 1), None)
        if deeper is not None:
            why += (f"; one layer deeper leaves {deeper.slabs} slabs ({deeper.per_layer:.1f} per offloaded layer), "
                    f"hit rate {chosen.hit_rate:.1%} -> {deeper.hit_rate:.1%}, {deeper.seconds * 1e3:.2f} ms")
    else:
        why = (f"within {model.tolerance:.0%} of the fastest of {span} ({best.seconds * 1e3:.2f} ms at {best.depth}); "
               f"the deepest such depth is kept for the predictor's and compressor's routing context")
    reason = (f"auto: {chosen.depth} pinned layer(s), predicted {chosen.seconds * 1e3:.2f} ms per decode token "
              f"({chosen.experts_read:.1f} experts read, hit rate {chosen.hit_rate:.1%}), {why}")
    return DepthChoice(chosen.depth, reason, rows, (valid.start, valid.stop - 1), model.describe(short=True))


def default_model(num_layers: int, layer_bytes: int, lookahead: int = 0, recall: float = 1.0,
                  read_bytes: int = 0, slab_bytes: int = 0) -> DepthModel | None:
    """The shipped curve with the H200 defaults, where this model has the shape the curve was measured on
    (`layer_bytes`: a layer's experts in the model's dtype); `read_bytes`: what a miss reads from the host
    where the store is quantized (0: the slab's bytes); `slab_bytes`: what the budget holds per expert where
    it is not the model's dtype (quantized slabs, and pinned layers as blocks): the hit rates are the
    routing's, per expert held, whatever an expert's bytes."""
    curve = shipped_curve()
    if curve is None or curve.layers != num_layers or curve.experts * curve.expert_bytes != layer_bytes:
        return None
    return DepthModel(curve, slab_bytes or curve.expert_bytes, lookahead=lookahead, recall=recall,
                      read_bytes=read_bytes)


def with_measurements(model: DepthModel, **figures: tuple[float, str] | None) -> DepthModel:
    """`model` with measured figures (name -> (value, source)); None values keep the model's own."""
    given = {name: value for name, value in figures.items() if value is not None}
    sources = dict(model.sources)
    sources.update({name: source for name, (_, source) in given.items()})
    return replace(model, **{name: v for name, (v, _) in given.items()}, sources=tuple(sources.items()))
