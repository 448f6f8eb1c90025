"""Expert memory budget: sizes, and the pinned-prefix depth of VisMMOE Eq. 10.

    I_valid = { L : L_semantic <= L <= floor((M_avail - C_safe) / S_layer) }

M_avail is the expert budget, S_layer the bytes of one MoE layer's experts, C_safe the least memory
the dynamic cache must keep, L_semantic the least depth whose routing is informative.
"""

from __future__ import annotations

import re

from ..errors import VismmoeError

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


def choose_pinned_layers(m_avail: int, layer_bytes: int, c_safe: int, l_semantic: int,
                         num_moe_layers: int, requested: int | None = None) -> int:
    """Pick L_pinned: the smallest valid depth, or `requested` after checking it against Eq. 10.

    A budget that holds every layer pins them all (there is nothing left to offload).
    """
    if m_avail >= num_moe_layers * layer_bytes and requested is None:
        return num_moe_layers
    valid = valid_prefix_range(m_avail, layer_bytes, c_safe, l_semantic)
    if len(valid) == 0:
        minimum = l_semantic * layer_bytes + c_safe
        raise BudgetError(
            f"expert budget {human_bytes(m_avail)} is too small: it must hold {l_semantic} pinned layer(s) of "
            f"{human_bytes(layer_bytes)} plus a dynamic cache of {human_bytes(c_safe)}, at least "
            f"{human_bytes(minimum)} ({minimum} bytes)"
        )
    if requested is None:
        return min(valid.start, num_moe_layers)
    if requested not in valid and not (requested <= num_moe_layers and requested * layer_bytes <= m_avail
                                       and requested == num_moe_layers):
        raise BudgetError(
            f"pinned_layers={requested} is outside the valid range {valid.start}..{valid.stop - 1} for an expert "
            f"budget of {human_bytes(m_avail)} ({human_bytes(layer_bytes)} per layer, "
            f"{human_bytes(c_safe)} kept for the cache)"
        )
    return requested
