"""SlabCache: which logical expert each GPU slab holds, and which slab to give up next.

Pure host-side state and policy (no tensors, no streams), so it is tested exhaustively on the CPU.
The runtime tells it when a layer starts (with the experts that layer needs), when a copy is issued
and completes, and when the layer ends; it answers lookups and picks eviction victims.

Rankings (eviction.py: the cache holds one ranking object, `ranking`, and a swap is an assignment):
- `vismmoe` (VisMMOE 3.4.2): victims are Expired experts first, then Speculative ones; among
  Expired the least recently used (decode reuses a layer's recent experts: ranking Expired experts
  by how soon their layer runs again, as this cache once did, evicted what the previous layer had
  just used and kept cold prefill leftovers), or, when `usage` is given (table decode: per layer,
  the average of the router's probabilities over decode tokens), the least favoured by the router,
  recency breaking ties (83.3% decode hits against recency's 81.5% in a simulation of synthetic
  routing, benchmarks/eviction_study.py); among Speculative the lowest prefetch priority.
- `lru`: the least recently used resident expert, whatever its layer (on-demand caching as in
  earlier MoE offloading work).
- a long prompt's streamed layers (eviction.CycleRanking, passed to `assign_many`): the slab whose layer
  runs again last, whatever the cache's ranking: a prompt's layers run in a fixed cycle, where that ranking,
  unlike decode's reuse of recent experts, is Belady's.
Whatever the ranking, a prefetch (a priority given) is admitted only if the next victim is worth less
than what it brings in: a Speculative victim's priority, an Expired one's router average (0 while
none is known), must be below the prefetch's priority, else the prefetch (and every lower one after
it) takes no slab. A prefetch never evicts a more probable expert.
Never a victim: a slab whose copy is in flight, or whose expert the executing layer uses.
Recency is kept in an ordered map updated on every use, so finding victims is one pass that stops
at the first evictable slabs, with no sort by Python keys (Speculative ones, few, are sorted). Ranking
by the router's averages touches every Expired slab, so it runs in numpy over per-slab arrays
(layer, expert, resident) kept beside the owner list, once per decode step: the averages come as one
array (`set_usage`), and the few dozen victims a step takes come from a partition, not a full sort
(a decode step's landing reservations, ranking included, on the 2-core CPU with 3512 slabs: 0.77-0.88
ms, from 1.12-1.19; `lru`'s: 0.44-0.57).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator

import numpy as np

from .eviction import RANKINGS

Key = tuple[int, int]  # (layer, expert)
VICTIMS_HEAD = 64  # victims ranked first by a partition (a decode step reserves a few dozen landing slabs)


class SlabState(Enum):
    FREE = "free"
    IN_FLIGHT = "in_flight"
    RESIDENT = "resident"


@dataclass
class CacheCounters:
    hits: int = 0          # needed and resident when the layer started
    late: int = 0          # needed while its prefetch was still in flight (compute waits on it)
    misses: int = 0        # needed, neither resident nor in flight: fetched urgently
    evictions: int = 0
    prefetches: int = 0    # copies issued from a priority list
    fetches: int = 0       # urgent copies
    prefetch_used: int = 0    # prefetched experts a layer used before they were evicted
    prefetch_wasted: int = 0  # prefetched experts evicted without being used


@dataclass
class SlabCache:
    num_slabs: int
    layer_order: list[int]  # MoE layers in execution order (one step runs them in this order)
    policy: str = "vismmoe"  # the initial ranking's name (`ranking` is the live strategy)
    owner: list[Key | None] = field(init=False)
    state: list[SlabState] = field(init=False)
    where: dict[Key, int] = field(init=False, default_factory=dict)
    in_use: set[int] = field(init=False, default_factory=set)
    priority: dict[Key, float] = field(init=False, default_factory=dict)
    last_use: list[int] = field(init=False)
    executed: set[int] = field(init=False, default_factory=set)  # layers that ran in this step
    executing: int | None = field(init=False, default=None)
    counters: CacheCounters = field(init=False, default_factory=CacheCounters)
    _tick: int = field(init=False, default=0)
    _recency: OrderedDict = field(init=False, default_factory=OrderedDict)  # held slabs, least recent first
    _frontier: int = field(init=False, default=-1)  # the furthest position in layer_order among `executed`
    _unused_prefetch: set = field(init=False, default_factory=set)  # prefetched slabs not used yet
    usage: dict | None = field(init=False, default=None)  # layer -> per expert router probability average

    def __post_init__(self) -> None:
        if self.policy not in RANKINGS:
            raise ValueError(f"unknown cache policy {self.policy!r}; choose vismmoe or lru")
        self.ranking = RANKINGS[self.policy]()
        self.owner = [None] * self.num_slabs
        self.state = [SlabState.FREE] * self.num_slabs
        # the same facts as arrays, for the vectorised ranking (`_set`, the one place that changes them)
        self._slab_layer = np.full(self.num_slabs, -1, dtype=np.int64)
        self._slab_expert = np.full(self.num_slabs, -1, dtype=np.int64)
        self._slab_resident = np.zeros(self.num_slabs, dtype=bool)
        self.last_use = [0] * self.num_slabs
        self._usage_of: tuple | None = None  # (the `usage` dict, its (rows + 1, E) table, each layer's row)
        self._position = {layer: i for i, layer in enumerate(self.layer_order)}
        self._position_of = np.zeros(max(self.layer_order, default=0) + 1, dtype=np.int64)  # the same, by array
        self._position_of[list(self.layer_order)] = np.arange(len(self.layer_order))
        self._free = list(range(self.num_slabs - 1, -1, -1))  # pop() gives slab 0 first

    # --- layer lifecycle ------------------------------------------------------------------
    def begin_layer(self, layer: int, needed: list[int]) -> dict[str, list[int]]:
        """Start `layer`; classify its needed experts as hit / late / miss (misses get no slab yet)."""
        if self.executing is not None:
            raise RuntimeError(f"layer {layer} started while layer {self.executing} is still executing")
        if layer in self.executed or (self.executed and self._position[layer] <= self._frontier):
            self.executed.clear()  # a new step: every layer is ahead again
            self._frontier = -1
        self.executing = layer
        self._tick += 1
        result: dict[str, list[int]] = {"hit": [], "late": [], "miss": []}
        for expert in needed:
            slab = self.where.get((layer, expert))
            if slab is None:
                result["miss"].append(expert)
                continue
            result["hit" if self.state[slab] is SlabState.RESIDENT else "late"].append(expert)
            self.in_use.add(slab)
            self._touch(slab)
            if slab in self._unused_prefetch:
                self._unused_prefetch.discard(slab)
                self.counters.prefetch_used += 1
        self.counters.hits += len(result["hit"])
        self.counters.late += len(result["late"])
        self.counters.misses += len(result["miss"])
        return result

    def use(self, slab: int) -> None:
        """Mark a freshly fetched slab as used by the executing layer."""
        self.in_use.add(slab)
        self._touch(slab)

    def end_layer(self, layer: int) -> None:
        if self.executing != layer:
            raise RuntimeError(f"layer {layer} ended but layer {self.executing} was executing")
        self.in_use.clear()
        self.executed.add(layer)
        self._frontier = max(self._frontier, self._position[layer])
        self.executing = None

    # --- copies ---------------------------------------------------------------------------
    def assign(self, key: Key, priority: float | None = None, urgent: bool = False) -> int | None:
        """Give `key` a slab (free, else a victim) in state IN_FLIGHT; None if no slab may be taken."""
        return self.assign_many([key], None if priority is None else [priority], urgent)[0]

    def assign_many(self, keys: list[Key], priorities: list[float] | None = None, urgent: bool = False,
                    count: bool = True, ranking: Any = None) -> list[int | None]:
        """Slabs for several experts at once (one ranking pass). Prefetches come in priority order and
        stop at the first that may not evict anything; urgent fetches take any non-Required victim.
        `count=False`: landing reservations (see `land`), counted when something lands. `ranking`: whose
        victims (default: the cache's own `ranking`)."""
        out: list[int | None] = []
        victims: Iterator[int] | None = None
        for i, key in enumerate(keys):
            if key in self.where:
                raise RuntimeError(f"expert {key} already has slab {self.where[key]}")
            priority = priorities[i] if priorities is not None else None
            slab = self._free.pop() if self._free else None
            if slab is None:
                if victims is None:
                    victims = (ranking or self.ranking).victims(self)
                slab = self._next_victim(victims, None if urgent else priority)
                if slab is None:
                    out.extend([None] * (len(keys) - i))
                    return out
                self._evict(slab)
            self._set(slab, key, SlabState.IN_FLIGHT)
            self.where[key] = slab
            self._recency[slab] = None
            self._recency.move_to_end(slab)
            if priority is not None:
                self.priority[key] = priority
            if not count:
                pass
            elif urgent:
                self.counters.fetches += 1
            else:
                self.counters.prefetches += 1
                self._unused_prefetch.add(slab)
            out.append(slab)
        return out

    def assign_in_slab_order(self, keys: list[Key], priority: float, ranking: Any = None) -> list[int | None]:
        """`assign_many` for keys of one priority (a long prompt's stream of a layer), the slabs it takes given out
        in ascending order: consecutive experts then land in consecutive slabs wherever the slabs taken are
        consecutive, one copy a run (Transfers._copies), where victims in the ranking's order scattered a layer's
        experts over about as many copies as experts (about 80 `copy_` calls a layer, 5.1 ms of host a layer on
        an H100 host that paced its prompts)."""
        slabs = self.assign_many(keys, [priority] * len(keys), ranking=ranking)
        taken = sorted(slab for slab in slabs if slab is not None)  # the keys' first len(taken) got one
        for key, slab in zip(keys, taken):  # same priority and state: only the pairing changes
            self._set(slab, key, SlabState.IN_FLIGHT)
            self.where[key] = slab
        return taken + slabs[len(taken):]

    def abandon(self, slab: int) -> None:
        """A copy assigned to `slab` was never issued (or failed): the slab holds nothing (free), its expert no slab."""
        if self.state[slab] is not SlabState.IN_FLIGHT:
            raise RuntimeError(f"slab {slab} abandoned a copy it was not waiting for ({self.state[slab].value})")
        del self.where[self.owner[slab]]
        self._set(slab, None, SlabState.FREE)
        self._recency.pop(slab, None)
        self._unused_prefetch.discard(slab)
        self.in_use.discard(slab)
        self._free.append(slab)

    def complete(self, slab: int) -> None:
        if self.state[slab] is not SlabState.IN_FLIGHT:
            raise RuntimeError(f"slab {slab} completed a copy it was not waiting for ({self.state[slab].value})")
        self._set(slab, self.owner[slab], SlabState.RESIDENT)

    # --- landing slabs (decode from the slab table) -------------------------------------------
    # The decode step reads a missing expert from the host and writes it into a slab reserved for its
    # layer beforehand ("landing"). A reservation holds a placeholder key (layer, negative id) in
    # state IN_FLIGHT, so nothing evicts it; `land` gives it its expert, `release` frees it.
    def land(self, slab: int, key: Key, prefetched: bool = False) -> None:
        """The reservation in `slab` now holds `key` (read through on a miss, or `prefetched` ahead
        of use: counted as a prefetch, used or wasted like one)."""
        if key in self.where:
            raise RuntimeError(f"expert {key} landed in slab {slab} but already has slab {self.where[key]}")
        self._drop_reservation(slab)
        self._set(slab, key, SlabState.RESIDENT)
        self.where[key] = slab
        self._tick += 1
        self._touch(slab)
        if prefetched:
            self.counters.prefetches += 1
            self._unused_prefetch.add(slab)
        else:
            self.counters.fetches += 1

    def release(self, slab: int) -> None:
        """Free an unused landing reservation."""
        self._drop_reservation(slab)
        self._set(slab, None, SlabState.FREE)
        self._recency.pop(slab, None)
        self._free.append(slab)

    def restore(self, slab: int, key: Key) -> None:
        """An unused landing reservation goes back to the expert it was taken from, whose bytes no step has
        written over (nothing landed in it): resident again, the least recently used."""
        if key in self.where:
            raise RuntimeError(f"expert {key} cannot return to slab {slab}: slab {self.where[key]} holds it")
        self._drop_reservation(slab)
        self._set(slab, key, SlabState.RESIDENT)
        self.where[key] = slab
        self._recency[slab] = None
        self._recency.move_to_end(slab, last=False)

    def _drop_reservation(self, slab: int) -> None:
        """The placeholder key of landing reservation `slab` leaves the map (land, release, restore)."""
        placeholder = self.owner[slab]
        if placeholder is None or placeholder[1] >= 0 or self.state[slab] is not SlabState.IN_FLIGHT:
            raise RuntimeError(f"slab {slab} is not a landing reservation ({placeholder})")
        del self.where[placeholder]

    @property
    def free_slabs(self) -> int:
        """Slabs holding nothing: no expert, no landing reservation."""
        return len(self._free)

    def set_usage(self, layers: list[int], averages: np.ndarray) -> None:
        """`usage` from one (len(layers), E) array (the decode table's router averages, read back once
        a step): the ranking's lookup table is made here in one piece, not row by row."""
        averages = np.asarray(averages, dtype=np.float64)
        self.usage = dict(zip(layers, averages))
        self._usage_of = (self.usage, *_lookup_table(list(layers), averages))

    def set_priorities(self, priorities: dict[Key, float]) -> None:
        self.priority = dict(priorities)

    def spend_priorities(self, keys: list[Key]) -> None:
        """Forget these prefetches' priorities: guesses about a layer that has now run, which would otherwise
        outrank later prefetches in the admission rule until a new list replaced them."""
        for key in keys:
            self.priority.pop(key, None)

    # --- policy ---------------------------------------------------------------------------
    def classify(self, slab: int) -> str:
        if self.state[slab] is SlabState.FREE:
            return "free"
        if self.state[slab] is SlabState.IN_FLIGHT or slab in self.in_use:
            return "required"
        return "expired" if self.owner[slab][0] in self.executed else "speculative"

    def victim(self, for_priority: float | None = None) -> int | None:
        """The slab to give up next, or None. `for_priority` set: a prefetch of that priority asks."""
        return self._next_victim(self._victims(), for_priority)

    def _set(self, slab: int, key: Key | None, state: SlabState) -> None:
        self.owner[slab], self.state[slab] = key, state
        self._slab_layer[slab], self._slab_expert[slab] = key if key is not None else (-1, -1)
        self._slab_resident[slab] = state is SlabState.RESIDENT

    def _touch(self, slab: int) -> None:
        self.last_use[slab] = self._tick
        self._recency[slab] = None
        self._recency.move_to_end(slab)

    def _victims(self) -> Iterator[int]:
        """Evictable slabs in the order they go, as the ranking says. Lazy: assigning n slabs looks at about n."""
        return self.ranking.victims(self)

    def victims_by_recency(self, speculative_last: bool) -> Iterator[int]:
        """Least recently used first; `speculative_last`: Expired ones so, then Speculative by priority."""
        speculative = []
        for slab in list(self._recency):
            cls = self.classify(slab)
            if cls == "expired" or (cls == "speculative" and not speculative_last):
                yield slab
            elif cls == "speculative":
                speculative.append(slab)
        speculative.sort(key=self._priority_of)  # stable: equal priorities go least recent first
        yield from speculative

    def _held_by_recency(self) -> tuple[np.ndarray, np.ndarray]:
        """(the held slabs, least recent first; which of them may be evicted: resident, not used by the executing
        layer; in flight, copies and landing reservations alike, is Required)."""
        order = np.fromiter(self._recency, dtype=np.int64, count=len(self._recency))
        evictable = self._slab_resident[order]
        if self.in_use:
            busy = np.zeros(self.num_slabs, dtype=bool)
            busy[list(self.in_use)] = True
            evictable &= ~busy[order]
        return order, evictable

    def victims_by_usage(self) -> Iterator[int]:
        """Expired slabs by (the router's average for their expert, recency), then Speculative ones by
        priority: RouterRanking's order once `usage` is known, over arrays (every Expired slab is ranked)."""
        order, evictable = self._held_by_recency()
        layer, expert = self._slab_layer[order], self._slab_expert[order]
        ran = np.zeros(len(order), dtype=bool)
        if self.executed and len(order):
            executed = np.zeros(max(int(layer.max()), max(self.executed)) + 1, dtype=bool)
            executed[list(self.executed)] = True
            ran = executed[layer]
        place = np.flatnonzero(evictable & ran)  # the Expired slabs, in recency order
        value = self._usage_values(layer[place], expert[place])
        # by value, then by recency (`place` ascends: a stable sort keeps it within equal values). A step
        # takes a few dozen victims of thousands, so the first HEAD come from a partition, not a full sort;
        # every slab valued at most the HEAD-th smallest value is in that part, so the order is the same
        parts = [np.arange(len(place))]
        if len(place) > VICTIMS_HEAD:
            bound = np.partition(value, VICTIMS_HEAD - 1)[VICTIMS_HEAD - 1]
            parts = [np.flatnonzero(value <= bound), np.flatnonzero(value > bound)]
        for part in parts:  # the rest is sorted only if the head did not suffice
            yield from order[place[part[np.argsort(value[part], kind="stable")]]].tolist()
        speculative = order[evictable & ~ran].tolist()
        speculative.sort(key=self._priority_of)  # stable: equal priorities go least recent first
        yield from speculative

    def victims_by_cycle(self) -> Iterator[int]:
        """Evictable slabs (resident, not used by the executing layer) whose layer runs again last first, in the
        cycle of `layer_order` from the executing layer (or the last one run), which itself runs again last of all
        (its slabs the layer does not use go first); least recent first among equals. The layer that runs next, the
        one a stream brings in, gives none."""
        order, evictable = self._held_by_recency()
        order = order[evictable]
        here = self._position[self.executing] if self.executing is not None else self._frontier
        # layers until the slab's layer runs again: the one after `here` is 0 away, `here` itself a whole cycle
        distance = (self._position_of[self._slab_layer[order]] - here - 1) % len(self.layer_order)
        keep = distance > 0  # the layer that runs next is the one a stream brings in: never its own victim
        yield from order[keep][np.argsort(-distance[keep], kind="stable")].tolist()

    def _next_victim(self, victims: Iterator[int], for_priority: float | None) -> int | None:
        for slab in victims:
            cls = self.classify(slab)
            if cls not in ("expired", "speculative"):
                continue  # became Required since (fetched for this layer)
            if for_priority is not None and self.worth(slab) >= for_priority:
                return None  # the admission rule: never trade a more probable expert for a prefetch
            return slab
        return None

    def worth(self, slab: int) -> float:
        """What keeping a held slab is worth to a prefetch that would evict it: a Speculative expert's
        prefetch priority, an Expired one's router average (0 while no average is known)."""
        if self.classify(slab) == "speculative":
            return self._priority_of(slab)
        if not self.usage:
            return 0.0
        # one slab, looked up directly: a long prompt's stream asks this for every victim it takes (thousands a
        # prompt), where the arrays' path (`_usage_values`) cost about 10 us a call on the prompt's host path
        layer, expert = self.owner[slab]
        row = self.usage.get(layer)
        return float(row[expert]) if row is not None and 0 <= expert < len(row) else 0.0

    def _usage_values(self, layer: np.ndarray, expert: np.ndarray) -> np.ndarray:
        """usage[layer][expert] for arrays of slabs' keys; 0 for layers without a row, or experts
        outside it (and placeholders' negative ids)."""
        if not self.usage or not len(layer):
            return np.zeros(len(layer))
        table, row_of = self._usage_table()
        inside = (expert >= 0) & (expert < table.shape[1]) & (layer >= 0)
        rows = np.full(len(layer), table.shape[0] - 1, dtype=np.int64)  # the zero row
        listed = inside & (layer < len(row_of))
        rows[listed] = row_of[layer[listed]]
        value = np.zeros(len(layer))
        value[inside] = table[rows[inside], expert[inside]]
        return value

    def _usage_table(self) -> tuple[np.ndarray, np.ndarray]:
        """`usage` as one (rows + 1, E) array (the last row zeros) and each layer's row in it; made once
        per `usage` dict (`set_usage` makes it with the dict; `usage` is replaced, never edited in place)."""
        if self._usage_of is not None and self._usage_of[0] is self.usage:
            return self._usage_of[1], self._usage_of[2]
        rows = [np.asarray(row, dtype=np.float64).reshape(-1) for row in self.usage.values()]
        averages = np.zeros((len(rows), max(len(row) for row in rows)))  # rows of any length, zero-padded
        for i, row in enumerate(rows):
            averages[i, :len(row)] = row
        self._usage_of = (self.usage, *_lookup_table(list(self.usage), averages))
        return self._usage_of[1], self._usage_of[2]

    def _priority_of(self, slab: int) -> float:
        key = self.owner[slab]
        if key in self.priority:
            return self.priority[key]
        return -self._distance(key[0]) / max(len(self.layer_order), 1) - 1.0  # below any listed priority

    def _distance(self, layer: int) -> int:
        """Layers from the executing one until `layer` runs again (cyclic: steps repeat the order)."""
        here = self._position[self.executing] if self.executing is not None else self._frontier
        return (self._position[layer] - here) % len(self.layer_order)

    def _evict(self, slab: int) -> None:
        if self.classify(slab) not in ("expired", "speculative"):
            raise RuntimeError(f"refusing to evict slab {slab} ({self.classify(slab)}): it is in flight or in use")
        del self.where[self.owner[slab]]
        self._set(slab, None, SlabState.FREE)
        self._recency.pop(slab, None)
        if slab in self._unused_prefetch:
            self._unused_prefetch.discard(slab)
            self.counters.prefetch_wasted += 1
        self.counters.evictions += 1  # the slab is refilled at once, so it does not go back to _free

    # --- checks (used by tests; cheap enough to call in debug runs) -------------------------
    def check_invariants(self) -> None:
        held = [key for key in self.owner if key is not None]
        assert len(held) == len(set(held)), "an expert is held by two slabs"
        assert {k: s for s, k in enumerate(self.owner) if k is not None} == self.where, "slab map out of sync"
        for slab, key in enumerate(self.owner):
            assert (key is None) == (self.state[slab] is SlabState.FREE), f"slab {slab} state/owner mismatch"
        assert self.in_use <= {s for s in range(self.num_slabs) if self.owner[s] is not None}
        assert sorted(self._free) == [s for s in range(self.num_slabs) if self.owner[s] is None], "free list out of sync"
        assert set(self._recency) == {s for s in range(self.num_slabs) if self.owner[s] is not None}, "recency out of sync"


def _lookup_table(layers: list[int], averages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the averages plus a zero row for layers without one, each layer's row in it)."""
    row_of = np.full(max(layers) + 1, len(layers), dtype=np.int64)
    row_of[layers] = np.arange(len(layers))
    return np.vstack([averages, np.zeros((1, averages.shape[1]))]), row_of
