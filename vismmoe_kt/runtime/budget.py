"""Expert memory budget: sizes, and the pinned-prefix depth of VisMMOE Eq. 10.

    I_valid = { L : L_semantic <= L <= floor((M_avail - C_safe) / S_layer) }

M_avail is the expert budget, S_layer the bytes of one MoE layer's experts, C_safe the least memory
the dynamic cache must keep, L_semantic the least depth whose routing is informative. Within that range
`pinned_layers: auto` takes the depth that minimises predicted time per decode token (prefix_depth.py).
"""

from __future__ import annotations

import functools
import logging
import math
import re

from ..errors import VismmoeError
from .prefix_depth import DepthChoice, DepthModel, choose, default_model

_log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class BudgetError(VismmoeError, ValueError):
    """The expert budget cannot hold what the configuration needs (the message gives the minimum)."""


def parse_bytes(value: int | float | str) -> int:
    """`123`, `"24GiB"`, `"40 GB"`, `"512MiB"` -> bytes."""
    if isinstance(value, bool):
        raise BudgetError(f"not a byte size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise BudgetError(f"byte size must not be negative: {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise BudgetError(f"not a byte size: {value!r} (use e.g. 24GiB, 40GB, 512MiB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_budget(value: int | float | str) -> int | str:
    """An expert budget: a byte size (`parse_bytes`), or a share of the model's routed experts, "N%"
    (normalised to e.g. "30%"), which `resolve_budget` turns into bytes once the runtime knows the experts'
    size: the same rule then means the same fraction on any model (a benchmark's "30% of the experts")."""
    if isinstance(value, str) and value.strip().endswith("%"):
        number = value.strip()[:-1].strip()
        try:
            share = float(number)
        except ValueError:
            share = -1.0
        if not 0 < share < math.inf:
            raise BudgetError(f"not a share of the experts: {value!r} (use e.g. 30%: a positive percentage)")
        return f"{share:g}%"
    return parse_bytes(value)


def resolve_budget(budget: int | str, expert_bytes: int) -> int:
    """Bytes of a `parse_budget` value, for a model whose routed experts take `expert_bytes` (its dtype)."""
    if isinstance(budget, str):
        return math.ceil(float(budget[:-1]) / 100 * expert_bytes)
    return budget


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def valid_prefix_range(m_avail: int, layer_bytes: int, c_safe: int, l_semantic: int) -> range:
    """Eq. 10 as a range of depths (possibly empty)."""
    if layer_bytes <= 0:
        raise ValueError("layer_bytes must be positive")
    deepest = (m_avail - c_safe) // layer_bytes if m_avail >= c_safe else -1
    return range(l_semantic, deepest + 1)


@functools.lru_cache(maxsize=64)  # the runtime's summary asks again for the reason
def pinned_depth_choice(m_avail: int, layer_bytes: int, c_safe: int, l_semantic: int, num_moe_layers: int,
                        requested: int | None = None, model: DepthModel | None = None,
                        read_bytes: int = 0) -> DepthChoice:
    """L_pinned and why: `requested` after checking it against Eq. 10, or (auto) the depth of Eq. 10's range
    that minimises predicted time per decode token (prefix_depth.py). `model` prices the depths; None: the
    shipped hit-rate curve with the H200's figures where the model has its shape, else the smallest valid
    depth of at least one layer (nothing to price with). `read_bytes`: what a miss reads from the host, where a quantized
    store makes it less than an expert's slab (0: the same).

    A budget that holds every layer pins them all (there is nothing left to offload).
    """
    if m_avail >= num_moe_layers * layer_bytes and requested is None:
        return DepthChoice(num_moe_layers, f"every layer fits the budget ({human_bytes(m_avail)} >= {num_moe_layers} x "
                                           f"{human_bytes(layer_bytes)}): all {num_moe_layers} pinned, nothing offloaded")
    valid = valid_prefix_range(m_avail, layer_bytes, c_safe, l_semantic)
    if len(valid) == 0:
        minimum = l_semantic * layer_bytes + c_safe
        raise BudgetError(
            f"expert budget {human_bytes(m_avail)} is too small: it must hold {l_semantic} pinned layer(s) of "
            f"{human_bytes(layer_bytes)} plus a dynamic cache of {human_bytes(c_safe)}, at least "
            f"{human_bytes(minimum)} ({minimum} bytes)"
        )
    span = (valid.start, valid.stop - 1)
    if requested is not None:
        if requested not in valid and not (requested <= num_moe_layers and requested * layer_bytes <= m_avail
                                           and requested == num_moe_layers):
            raise BudgetError(
                f"pinned_layers={requested} is outside the valid range {valid.start}..{valid.stop - 1} for an expert "
                f"budget of {human_bytes(m_avail)} ({human_bytes(layer_bytes)} per layer, "
                f"{human_bytes(c_safe)} kept for the cache)"
            )
        auto = pinned_depth_choice(m_avail, layer_bytes, c_safe, l_semantic, num_moe_layers, None, model, read_bytes)
        return DepthChoice(requested, f"pinned_layers={requested} given (Eq. 10 allows {span[0]}..{span[1]}; "
                                      f"auto would pin {auto.depth})", (), span)
    if valid.start >= num_moe_layers:
        return DepthChoice(num_moe_layers, f"L_semantic={l_semantic} covers every one of the {num_moe_layers} MoE layers",
                           (), span)
    candidates = range(valid.start, min(valid.stop, num_moe_layers + 1))
    model = model if model is not None else default_model(num_moe_layers, layer_bytes, read_bytes=read_bytes)
    if model is None:  # nothing prices an empty prefix against the paper's one layer either: one layer it is
        depth = max(valid.start, min(1, valid.stop - 1))
        return DepthChoice(depth, f"auto: {depth}, the smallest depth of Eq. 10's {span[0]}..{span[1]} of at least one "
                                  f"layer: no decode hit-rate curve for this shape ({num_moe_layers} MoE layers of "
                                  f"{human_bytes(layer_bytes)}) to price others with", (), span)
    return choose(model, m_avail, num_moe_layers, candidates)


def resolve_pinned_layers(m_avail: int, layer_bytes: int, c_safe: int, l_semantic: int, num_moe_layers: int,
                          requested: int | None = None, model: DepthModel | None = None,
                          read_bytes: int = 0) -> DepthChoice:
    """pinned_depth_choice, with an automatic choice logged with its reason."""
    choice = pinned_depth_choice(m_avail, layer_bytes, c_safe, l_semantic, num_moe_layers, requested, model,
                                 read_bytes)
    if requested is None:
        _log.info("pinned prefix: %s%s", choice.reason, f" [{choice.basis}]" if choice.basis else "")
    return choice


def choose_pinned_layers(m_avail: int, layer_bytes: int, c_safe: int, l_semantic: int,
                         num_moe_layers: int, requested: int | None = None, model: DepthModel | None = None) -> int:
    """L_pinned (resolve_pinned_layers' depth)."""
    return resolve_pinned_layers(m_avail, layer_bytes, c_safe, l_semantic, num_moe_layers, requested, model).depth
