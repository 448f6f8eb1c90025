"""Which offload options cannot go together, and why: one table, read by OffloadSettings (the rows that
name settings only) and by resolve_plan (the rows that need facts of the model or the load).

A row holds when every one of its conditions does: a condition names an option (a setting, or a fact
the plan adds: `store`, the resolved store's kind, model or quantized, and `store_format` its format;
`lookahead`, a device predictor in decode; `whole_tiles`, hidden and expert intermediate multiples of
256; `backend_built`, the CPU backend the hybrid mode built) and the values it takes. The first row
that holds is the error raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .budget import BudgetError

HYBRID = frozenset({"cpu", "auto"})  # miss_policy values that send misses to the CPU backend
SETTINGS_KEYS = frozenset({"slab_format", "store_dtype", "miss_policy", "cpu_dtype", "cpu_backend"})


@dataclass(frozen=True)
class Incompatible:
    when: tuple[tuple[str, frozenset], ...]  # (option, values it takes) pairs that all hold
    why: str                                 # the error, formatted with the options' values

    def holds(self, values: dict[str, Any]) -> bool:
        return all(key in values and values[key] in allowed for key, allowed in self.when)

    @property
    def settings_only(self) -> bool:
        return all(key in SETTINGS_KEYS for key, _ in self.when)


def _row(why: str, **when: Any) -> Incompatible:
    return Incompatible(tuple((key, frozenset(v) if isinstance(v, (set, frozenset)) else frozenset({v}))
                              for key, v in when.items()), why)


RULES: tuple[Incompatible, ...] = (
    _row("slab_format quantized keeps the store's blocks in the slabs: it needs a quantized store (store_dtype q8_0, "
         "q4_0, q4_k or q5_k, or auto with a GGUF's quantized experts)", slab_format="quantized", store_dtype="model"),
    _row("slab_format quantized works with miss_policy wait, not {miss_policy} (the hybrid's CPU backends read the "
         "model's dtype)", slab_format="quantized", miss_policy=HYBRID),
    _row("cpu_dtype {cpu_dtype} needs cpu_backend kt-kernel: the torch backend reads the store's BF16 blocks in place",
         cpu_dtype={"int8", "int4"}, cpu_backend="torch"),
    _row("slab_format quantized keeps the store's blocks in the slabs: it needs a quantized store (store_dtype q8_0, "
         "q4_0, q4_k or q5_k), not store_dtype {store_format}", slab_format="quantized", store="model"),
    _row("slab_format quantized decodes whole 256-weight tiles: hidden {hidden} and expert intermediate {inter} must "
         "be multiples of 256", slab_format="quantized", whole_tiles=False),
    _row("slab_format quantized does not work with the lookahead predictor yet", slab_format="quantized",
         lookahead=True),
    _row("store_dtype {store_format} does not work with the lookahead predictor yet (its prefetch copies move the "
         "model's dtype); use store_dtype: model, or no predictor", store="quantized", lookahead=True),
    _row("store_dtype {store_format} with the hybrid mode needs cpu_backend: kt-kernel (the torch backend computes on "
         "the store's blocks in place, which are quantized bytes)", store="quantized", miss_policy=HYBRID,
         cpu_backend="torch"),
    _row("store_dtype {store_format} with the hybrid mode needs kt-kernel, and cpu_backend auto chose torch here "
         "(kt-kernel missing, or the CPU or sizes unsuited)", store="quantized", backend_built="torch"),
)


def first_conflict(values: dict[str, Any], settings_only: bool = False) -> Incompatible | None:
    """The first row of RULES that holds for `values` (with `settings_only`, among the settings' rows)."""
    return next((rule for rule in RULES if (rule.settings_only or not settings_only) and rule.holds(values)), None)


def check(values: dict[str, Any], settings_only: bool = False) -> None:
    """Raise the BudgetError of the first row that holds."""
    rule = first_conflict(values, settings_only)
    if rule is not None:
        raise BudgetError(rule.why.format(**values))
