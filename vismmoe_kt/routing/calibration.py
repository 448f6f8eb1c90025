"""The synthetic router's knobs: defaults, the fitted per-layer table, and resolving both to a shape.

A calibration is a JSON file in this package (calibration_qwen3_30b_a3b.json, written by
benchmarks/fit_routing.py) holding one value per layer for each per-layer knob and one value for each
scalar knob. Any model shape can use it: a table of L0 layers is interpolated over relative depth
(layer l of L sits at l / (L - 1)), so a 24-layer or a 94-layer model gets the same depth profile.
Callers override any knob with a scalar (every layer), a sequence of L values, or a sequence of any
other length (interpolated over depth like the table).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DEFAULT_CALIBRATION = Path(__file__).with_name("calibration_qwen3_30b_a3b.json")

# what each knob does (the generator's docstring has the full model)
PER_LAYER = {
    "rho": "token-to-token AR(1) correlation of the layer's latent innovation (negative: anti-correlated)",
    "coupling": "c_l: h_l = sqrt(c_l) h_{l-1} + sqrt(1 - c_l) z_l, how much layer l inherits from layer l-1",
    "temperature": "divides the token-dependent logits W_l h; lower = the latent state dominates the biases",
    "hot": "logit bonus at the head of the request's graded hot set (drawn per seed)",
    "hot_size": "length of the hot set as a fraction of the experts (the bonus ramps down to 0 over it)",
    "skew": "strength of the corpus-wide expert skew (drawn per corpus_seed: one kind of prompt)",
    "vision": "strength of the vision tokens' expert preference (fixed by the model, long-tailed)",
}
SCALAR = {
    "jump": "probability per token of a topic jump: every layer's latent state is redrawn",
    "dim": "latent dimension D of the hidden state the routers read",
    "logit_scale": "multiplies all logits: sets how peaked the softmax weights are, not which ids win",
}
# Used where no calibration file exists, and where a calibration lacks a knob; near the fitted means.
DEFAULTS: dict[str, Any] = {"rho": 0.6, "coupling": 0.8, "temperature": 1.0, "hot": 2.2, "hot_size": 0.56,
                            "skew": 0.28, "vision": 0.31, "jump": 0.02, "dim": 32, "logit_scale": 1.0}


@dataclass(frozen=True)
class Knobs:
    """Resolved knobs for one shape: per-layer numpy arrays [L] and scalars."""
    rho: np.ndarray
    coupling: np.ndarray
    temperature: np.ndarray
    hot: np.ndarray
    hot_size: np.ndarray
    skew: np.ndarray
    vision: np.ndarray
    jump: float
    dim: int
    logit_scale: float
    source: str = field(default="defaults", compare=False)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: [float(v) for v in getattr(self, k)] for k in PER_LAYER}
        out.update(jump=self.jump, dim=self.dim, logit_scale=self.logit_scale)
        return out


def depth_interp(values: Sequence[float] | np.ndarray, layers: int) -> np.ndarray:
    """Resample a per-layer profile to `layers` layers over relative depth (linear interpolation)."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("a per-layer knob needs at least one value")
    if values.size == layers:
        return values.copy()
    if values.size == 1 or layers == 1:  # one layer sits at depth 0
        return np.full(layers, values[0])
    return np.interp(np.linspace(0.0, 1.0, layers), np.linspace(0.0, 1.0, values.size), values)


def load_calibration(path: str | Path | None = None) -> dict[str, Any]:
    """The raw calibration table ({"per_layer": {...}, "scalars": {...}, ...}); {} if the default file
    is absent (the generator then uses DEFAULTS)."""
    path = DEFAULT_CALIBRATION if path is None else Path(path)
    if not path.exists():
        if path == DEFAULT_CALIBRATION:
            # an install without the package data would otherwise route uncalibrated without a word
            warnings.warn(f"{path} is missing: synthetic routing uses uncalibrated default knobs", stacklevel=3)
            return {}
        raise FileNotFoundError(f"calibration file {path} does not exist")
    table = json.loads(path.read_text())
    unknown = (set(table.get("per_layer", {})) - set(PER_LAYER)) | (set(table.get("scalars", {})) - set(SCALAR))
    if unknown:
        raise ValueError(f"calibration file {path} has unknown knobs: {sorted(unknown)}")
    return table


_CACHE: dict[str, dict[str, Any]] = {}


def resolve_knobs(layers: int, calibration: str | Path | dict | None = None, **overrides: Any) -> Knobs:
    """Knobs for `layers` layers: the calibration table (default: the packaged fit), then overrides."""
    unknown = set(overrides) - set(PER_LAYER) - set(SCALAR)
    if unknown:
        raise TypeError(f"unknown routing knobs: {sorted(unknown)}; known: {sorted({**PER_LAYER, **SCALAR})}")
    if isinstance(calibration, dict):
        table, source = calibration, "dict"
    else:
        key = str(calibration or DEFAULT_CALIBRATION)
        if key not in _CACHE:
            _CACHE[key] = load_calibration(calibration)
        table, source = _CACHE[key], (key if _CACHE[key] else "defaults")
    per_layer, scalars = table.get("per_layer", {}), table.get("scalars", {})
    values: dict[str, Any] = {}
    for name in PER_LAYER:
        raw = overrides.get(name, per_layer.get(name, DEFAULTS[name]))
        values[name] = depth_interp(np.atleast_1d(np.asarray(raw, dtype=np.float64)), layers)
    for name in SCALAR:
        values[name] = overrides.get(name, scalars.get(name, DEFAULTS[name]))
    knobs = Knobs(**{name: values[name] for name in PER_LAYER}, jump=float(values["jump"]), dim=int(values["dim"]),
                  logit_scale=float(values["logit_scale"]), source=source)
    _check(knobs)
    return knobs


def _check(k: Knobs) -> None:
    if np.any(np.abs(k.rho) >= 1):
        raise ValueError("rho must lie in (-1, 1)")
    if np.any((k.coupling < 0) | (k.coupling > 1)):
        raise ValueError("coupling must lie in [0, 1]")
    if np.any(k.temperature <= 0):
        raise ValueError("temperature must be positive")
    if np.any((k.hot_size <= 0) | (k.hot_size > 1)):
        raise ValueError("hot_size is a fraction of the experts: it must lie in (0, 1]")
    if not 0 <= k.jump <= 1:
        raise ValueError("jump is a probability: it must lie in [0, 1]")
    if k.dim < 1:
        raise ValueError("dim must be at least 1")
