"""DecodeBoundary: the offload cache's upkeep once per decode token, between steps, off the step itself.

The lean decode step reads its experts through the DecodeTable (no host work per layer: one graph per
step). Around each step the engine calls the runtime's step hooks, which land here:

    after a step    start copying its records (routing, where each pair was read, what landed) to
                    page-locked host memory
    before a step   1. decode starts (after a prefill or a cache reset): the table is rebuilt from the
                       slab cache, the prefetch queue emptied (nothing evicts behind the table's back)
                    2. the last step's records: counters (hits and host reads per layer), the slab
                       cache's bookkeeping (recency, Expired/Speculative, the router-probability
                       average it ranks victims by), what landed becomes resident
                       (a lookahead prefetch as a prefetch: its use or waste is counted)
                    3. copies that finished since (prefetches issued during prefill) are published
                    4. landing reservations for the next step: per offloaded layer, its last misses
                       and prefetches plus SPARE slabs (at most the table's R), victims chosen by the
                       cache's ranking and dropped from the table first; the ranking is the
                       eviction choice's for this step (fixed, or `auto`'s trial: eviction.py)
                    5. hybrid mode (where decode has a CPU share: offload_plan._decode_cpu): how many
                       of a layer's misses the CPU computes, per miss count
                       (the cost model's split, kept while steps measure faster with it: QuotaTrial)

With the plan's `reservations: ahead` (no CPU share in decode, no lookahead) 2 to 4 move behind the launch:
`before` of step t only arms the landing set written after step t - 1 was queued, and `after` of step t,
with t queued on the device, reads and accounts the records of t - 1, publishes finished copies and
reserves step t + 1's landings, which come from t - 1's unused ones and victims and so never share a slab
with t's set (a reservation is a placeholder in flight: no victim). The device runs step after step; the
host's upkeep runs beside it, one step behind. Quiet steps need no special path there. Which way a step runs
is the reservations choice's (reservations.py: fixed, or `auto`'s trial timing both before the eviction's own
trial), asked at the start of each table step that is neither settled nor a graph's self-check; a change of way
gives the reservations back first (`leave`) and rebuilds the table resuming the decode (`_enter`).

A settled table (every layer pinned, or every offloaded expert in a resident slab as decode starts: a
budget that holds them all, Q4_K slabs on a large GPU) has nothing to account, reserve or land: no step
can miss. Its steps skip the upkeep and the wait for the step before (the engine queues them back to
back) and count their pairs as hits; it settles again at each decode start. Where the plan's slabs hold
every offloaded expert (`fill`), the ones no prompt has routed to yet are copied in as decode first
starts, once, so that decode settles from its first step instead of missing each on its first use.

It talks to the Residency (the cache, the table, the transfers, the counters) and, through the
runtime, to three things: the hybrid's MissPolicy (its decode quota), what starts with decode (the
lookahead's per-request state) and who serves the step once it is armed (the runtime swaps its
executor: `on_arm`). All of it runs under the residency's lock; the device writes go on the compute stream, ordered after
the previous step and before the next one.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Callable

from .decode_table import ARRIVING, CPU_PAIR, NOT_RESIDENT
from .offload_stats import LayerCounters
from .reservations import FixedReservations
from .slab_cache import SlabState

SPARE = 2  # landing slots beyond the layer's last miss count: room for a change of topic
# ahead, two sets are held at once, and every placeholder is a slab not caching an expert: one spare slot each
# (the 48 x 128 CPU proxy at 2427 slabs, lru, 48 steps: decode hits 86.1% with one, 85.9% with two, against
# 87.0% before-step with two)
SPARE_AHEAD = 1
# A step's landings evict at most this share of the slabs (free slabs besides). Where a step wants more (every
# offloaded layer's misses and spares: 48 x 10 landings a token when nearly everything misses), its reservations took
# every slab, each step evicting the experts the last one used, which the next token reuses (44% of its top-8 on
# synthetic routing), so decode hit nothing at all; a miss without a landing costs the same bytes, read once. Decode
# hits on the 48 x 128 CPU proxy (`python -m benchmarks.boundary_upkeep --slabs N`, 32 tokens, before-step), lru /
# the default rules, without the cap and with a quarter: 128 slabs 0% / 0% -> 14.0% / 14.4%; 384: 0% / 0% -> 33.1% /
# 25.3%; 640: 37.0% / 22.3% -> 47.0% / 42.2%; 1152: 65.3% / 65.5% -> 65.0% / 65.3%; 2427: 83.4% / 84.9%, unchanged
# (an eighth was within a point of a quarter, a sixteenth 7 points below at 384). It binds only where the landings
# wanted pass it.
LANDING_SHARE = 0.25


class DecodeBoundary:
    def __init__(self, residency: Any, miss: Any = None, on_enter: Callable[[], None] = lambda: None,
                 on_arm: Callable[[], None] = lambda: None, eviction: Any = None):
        """`miss`: the hybrid's MissPolicy (None where decode has no CPU share: miss_policy wait, or a CPU
        backend that cannot run inside the step, which then serves prefill only); `on_enter`: decode starts;
        `on_arm`: a table step is armed (before it) or over (after it): the runtime binds its executor again;
        `eviction`: the ranking for each step (eviction.py: FixedEviction or EvictionTrial; None: the cache's)."""
        self.res, self.miss, self.on_enter, self.on_arm = residency, miss, on_enter, on_arm
        self.eviction = eviction
        self.armed = False                         # between before_step and after_step
        self.reserved: dict[int, list[int]] = {}   # row -> its next step's landing slabs (placeholders in the cache)
        # the plan's reservations: `ahead` reserves step t + 1's landings in after_step(t), while t runs, from the
        # records of t - 1; then `launched` holds the landing sets of the steps queued and not accounted yet (in
        # order, at most two), and `spare` the unused slabs of sets already accounted (the next set's first)
        self.ahead = False
        self.reservations: Any = FixedReservations(False, "given")  # which way each step runs (reservations.py)
        self.launched: deque[dict[int, list[int]]] = deque()
        self.spare: dict[int, list[int]] = {}
        # slab -> the expert a reservation evicted from it: a reservation nothing landed in still holds that
        # expert's bytes, so a decode that stops gives the slab back to it (`leave`) instead of freeing it
        self.evicted: dict[int, tuple[int, int]] = {}
        self.last_misses: dict[int, int] = {}      # row -> experts read from the host or prefetched at the last step
        self.stale = True                          # the table must be rebuilt before the next step
        self.deferred = None                       # a quiet step's records, accounted once the next step is launched
        self.fill = False                          # the plan's fill_slabs: copy cold experts in as decode starts
        self.offloaded_rows = [residency.row_of(layer) for layer in residency.offloaded]  # the table rows that record
        self._names = itertools.count()
        self._landing_turn = 0  # the row a round of landings cut to LANDING_SHARE starts at (_within_landing_share)

    @property
    def table(self):
        return self.res.table

    @property
    def settled(self) -> bool:
        """No step can miss or land until decode starts again: the table's own flag (one truth for both)."""
        return self.table is not None and self.table.settled

    def set_reservations(self, ahead: bool) -> None:
        """The plan's reservations (at build, or a replan between decodes; `auto`: the way its trial holds now): a
        decode under way gives its reservations back the old way first, and the next step starts afresh."""
        if ahead != self.ahead and self.table is not None and not self.stale:
            with self.res.lock:
                self.leave()
        if ahead != self.ahead:
            self.launched.clear()  # (a left decode's are accounted: nothing of the old order carries over)
        self.ahead = ahead

    # --- the hooks ---------------------------------------------------------------------------------
    def before_step(self) -> None:
        rt = self.res
        if self.settled and not self.stale:  # nothing to account, reserve or land; no read of the step before
            if self.armed:  # the graph self-check nests a second step inside the first, which has no `after`
                with rt.lock:
                    self._count_settled_step()
            self._arm()
            return
        with rt.lock:
            nested = self.armed
            # (a nested self-check step runs the way its capture did)
            switched = not nested and self._choose_reservations()
            if self.ahead and not nested and not self.stale:  # its landings were reserved while the step before ran
                self._launch_on_reserved()
                return
            if nested and self.ahead:  # a step ran without its `after` (the graph self-check nests a second
                self._flush()          # step inside the first): account every step queued before moving on
            elif nested:
                self.table.readback()  # (before-step: only the outer one's records are pending)
            if self.stale:
                self._enter(resume=switched)
                if self.settled:
                    self._arm()
                    return
            # a quiet last step (every pair a hit, nothing landed) left the reservations as they were:
            # this step runs on them, and that step is accounted in `after_step`, while this one computes
            quiet = None if nested or self.ahead or self.miss is not None else \
                self.table.quiet_records(self.offloaded_rows)
            self._account_deferred()  # at most one step waits: the accounts keep the steps' order
            if quiet is not None:
                self.deferred = quiet
            else:
                records = self.table.collect()  # None right after decode started
                if records is not None:
                    self.reserved.update(self._account(records, self.reserved))
            self._publish_finished_copies()
            if self.eviction is not None and not nested:  # a nested self-check step keeps its capture's ranking
                self._rank_for_step()
            if quiet is None:
                self._reserve()
            offloaded = self._first_offloaded() if self.miss is not None else None
            # hybrid: the cost model's share of misses for the CPU. A nested step (the self-check of a
            # capture) keeps the quota its capture ran with: it must compute the same step
            if offloaded is not None and not nested:
                self.table.set_cpu_quota(self.miss.decode_quota(rt.store, offloaded, rt.device))
            if self.ahead:
                self.launched.append(self.reserved)
                self.reserved = {}
            self._arm()

    def _choose_reservations(self) -> bool:
        """The way this step reserves (the choice's, at the step's start; lock held); a trial changing ways
        mid-decode gives the reservations made the other way back first, and the table is then rebuilt resuming
        the decode (the router averages and the request's state stay). True: it changed ways mid-decode."""
        ahead = self.reservations.for_step()
        if ahead == self.ahead:
            return False
        switched = self.table is not None and not self.stale
        if switched:
            self.leave(interrupt=False)  # the trial has just timed this step's start: not an interruption
        self.ahead = ahead
        return switched

    def _launch_on_reserved(self) -> None:
        """Ahead: the step runs on the landings after_step wrote after the step before it; nothing to wait for.
        The ranking `auto`'s trial picks here chooses the next step's victims (after_step's reserve): of a
        trial's run of two steps under one ranking only the second is timed, whose reservations it chose."""
        if self.eviction is not None:
            self._rank_for_step()
        self.launched.append(self.reserved)
        self.reserved = {}
        self._arm()

    def _rank_for_step(self) -> None:
        """The ranking this step's victims come by (`auto`'s trial may change it); once no average of the router
        is kept (the trial kept lru), the cache holds none either, from this step on: a prefetch's admission
        weighs a held expert as under the lru file, not by averages gone stale."""
        cache = self.res.cache
        cache.ranking = self.eviction.for_step(self.reservations.settled)
        if not self.averages_router:
            cache.usage = None

    @property
    def averages_router(self) -> bool:
        """Whether decode keeps the router's averages up: until `auto`'s trial keeps lru (no trial: the ranking
        given decides whether a step averages at all, OffloadRuntime.router_sink)."""
        return self.eviction is None or self.eviction.reads_usage

    def _arm(self) -> None:
        self.armed = True
        self.on_arm()

    def _first_offloaded(self) -> int | None:
        rt = self.res
        return next((layer for layer in rt.moe_layers if layer not in rt.pinned), None)

    def after_step(self) -> None:
        self.armed = False
        self.on_arm()
        if self.settled:
            with self.res.lock:  # the counters' dict: a server's stats may read it meanwhile
                self._count_settled_step()
            return
        if self.ahead and self.stale:  # left mid-step (leave or forget): accounted there, decode starts afresh
            return
        if self.ahead:
            with self.res.lock:  # the step is on its way: account the one before it, reserve the one after it
                records = self.table.collect()  # first: the step's own records go to the same page-locked buffers
                self.table.readback()
                if records is not None:
                    self._keep_spare(self._account(records, self.launched.popleft()))
                self._publish_finished_copies()
                self._reserve()
            return
        self.table.readback()
        with self.res.lock:  # the step is on its way on the device: the host's bookkeeping of the one before
            self._account_deferred()

    def _account_deferred(self) -> None:
        if self.deferred is not None:
            records, self.deferred = self.deferred, None
            self.reserved.update(self._account(records.readback(), self.reserved))

    def _flush(self) -> None:
        """Ahead: account every queued step in order, the last one's records read back here if its `after`
        has not run (a nested self-check step, an interrupted decode); their unused landings become spare."""
        records = self.table.collect()
        if records is not None and self.launched:
            self._keep_spare(self._account(records, self.launched.popleft()))
        while self.launched:
            self.table.readback()
            self._keep_spare(self._account(self.table.collect(), self.launched.popleft()))

    def _keep_spare(self, unused: dict[int, list[int]]) -> None:
        for row, slabs in unused.items():
            self.spare.setdefault(row, []).extend(slabs)

    # --- leaving and entering ----------------------------------------------------------------------
    def leave(self, interrupt: bool = True) -> None:
        """Something other than a table step is about to use the cache (prefill, an eager decode, a
        reset), or the reservations change ways: give the landing reservations back; the table is rebuilt when
        decode resumes (lock held). `interrupt`: decode stops here (the trials must not time across it)."""
        self.table.settled = False  # settles again as decode resumes, if nothing was evicted
        self._account_deferred()
        if self.ahead:
            self._flush()
        else:
            records = self.table.collect()
            if records is not None:  # the last step before this: count it, keep what landed
                self.reserved.update(self._account(records, self.reserved))
        if interrupt:
            self._interrupted()
        cache = self.res.cache
        for slabs in itertools.chain(self.reserved.values(), self.spare.values()):
            for slab in slabs:
                if cache.owner[slab] is None or cache.owner[slab][1] >= 0:
                    continue
                key = self.evicted.pop(slab, None)
                if key is not None and key not in cache.where:
                    cache.restore(slab, key)  # (the table is rebuilt from the cache as decode resumes)
                else:
                    cache.release(slab)
        self.reserved.clear()
        self.spare.clear()
        self.evicted.clear()
        self.table.discard()
        self.stale = True

    def forget(self) -> None:
        """The slab cache was replaced (reset): nothing reserved, nothing to account, rebuild later."""
        self.table.settled = False  # settles again as decode resumes, if nothing was evicted
        self._interrupted()
        self.reserved.clear()
        self.spare.clear()
        self.launched.clear()
        self.evicted.clear()
        self.table.discard()
        self.deferred = None  # records of slabs that are gone
        self.stale = True

    def _interrupted(self) -> None:
        """Decode stops: the time to the next step is no step's (the trials must not count it)."""
        if self.miss is not None:
            self.miss.decode_interrupted()
        if self.eviction is not None:
            self.eviction.interrupt()
        self.reservations.interrupt()

    def _enter(self, resume: bool = False) -> None:
        """Decode starts (after a prefill, a reset), or `resume`s after a change of reservations' way: the table
        rebuilt from the cache either way; only a start forgets the router averages and starts the request's state."""
        rt = self.res
        if rt.transfers is not None:  # queued prefetches would evict slabs the table points at
            rt.transfers.drop_queue()
            rt.transfers.poll()
            rt.transfers.landed.clear()
            if self.fill:
                self._fill_cold()
        rt.switch_phase("decode")
        rows = []
        for layer in rt.moe_layers:
            if layer in rt.pinned:
                rows.append(list(range(rt.num_experts)))
                continue
            row = [NOT_RESIDENT] * rt.num_experts
            for expert in range(rt.num_experts):
                slab = rt.cache.where.get((layer, expert))
                if slab is not None:  # a copy still in flight is published when it lands; no landing meanwhile
                    row[expert] = slab if rt.cache.state[slab] is SlabState.RESIDENT else ARRIVING
            rows.append(row)
        self.table.rebuild(rows)
        self.table.discard()
        if not resume:
            self.table.usage.zero_()  # a new request's decode: its router favours other experts
            rt.cache.usage = None
            self.on_enter()
        self.stale = False
        self.table.settled = all(slot >= 0 for row in self.offloaded_rows for slot in rows[row])
        if self.settled:
            self.table.reserve([[] for _ in rows])  # no landing slots: nothing can miss
            if self.miss is not None:  # nor go to the CPU: the step is the one captured without its calls
                self.table.set_cpu_quota([0] * (rt.top_k + 1))

    def _fill_cold(self) -> None:
        """Copy every offloaded expert that has no slab into a free one and wait for every copy in flight,
        prefill's too, so that the table is built from resident slabs (counted with the phase before
        decode: loading, not a step's misses). Only the first decode start finds cold experts: with a slab
        for every expert nothing is evicted afterwards."""
        rt = self.res
        cold = rt.cold_experts()
        if len(cold) <= rt.cache.free_slabs:  # else landing reservations are still out: a later start
            rt.transfers.fill(cold)
            rt.transfers.landed.clear()

    def _count_settled_step(self) -> None:
        """A settled step's counters without its records: every pair of each offloaded layer a hit (the
        cache's recency and ranking are not kept: with every expert resident, nothing is evicted)."""
        counters = self.res.counters["decode"]
        pairs = self.table.batch_pairs or self.res.top_k
        for layer in self.res.offloaded:
            layer_counters = counters.setdefault(layer, LayerCounters())
            layer_counters.calls += 1
            layer_counters.hits += pairs

    # --- records -----------------------------------------------------------------------------------
    def _account(self, records, landing: dict[int, list[int]]) -> dict[int, list[int]]:
        """One step's records, whose landings went to `landing` (row -> slabs, in slot order); returns each
        offloaded row's slabs of it that nothing landed in (still reserved)."""
        rt, cache = self.res, self.res.cache
        unused: dict[int, list[int]] = {}
        copies = rt.copy_counters["decode"]
        experts = rt.num_experts
        for row, layer in enumerate(rt.moe_layers):
            if layer in rt.pinned:
                continue
            ids, read = records.routed[row], records.read[row]
            counters = rt.counters["decode"].setdefault(layer, LayerCounters())
            counters.calls += 1
            misses = sum(1 for s in read if s in (NOT_RESIDENT, ARRIVING))  # read from the host
            late = sum(1 for s in read if s == ARRIVING)  # of which a copy (or prefetch) was on its way
            on_cpu = sum(1 for s in read if s == CPU_PAIR)  # hybrid: computed by the CPU backend
            counters.hits += len(ids) - misses - on_cpu
            counters.cpu += on_cpu
            counters.cpu_pairs += on_cpu
            counters.misses += misses - late
            counters.late += late
            slabs = landing.get(row, [])
            prefetched = 0
            for slot, owner in enumerate(records.owner[row][:len(slabs)]):
                if owner >= 0:  # owner E + e: a lookahead prefetch of e
                    cache.land(slabs[slot], (layer, owner % experts), prefetched=owner >= experts)
                    self.evicted.pop(slabs[slot], None)  # written over
                    prefetched += owner >= experts
            copies.bytes_host_reads += (misses + prefetched) * rt.store.block_bytes_of(layer)
            self.last_misses[row] = misses + prefetched
            rt.last_routed[layer] = list(ids)
            unused[row] = [s for s, e in zip(slabs, records.owner[row]) if e < 0]
            # recency, Expired/Speculative (a batched step's tokens may share experts: each once)
            cache.begin_layer(layer, [e for e in dict.fromkeys(ids) if (layer, e) in cache.where])
            cache.end_layer(layer)
        if self.averages_router:  # else the cache keeps none (_rank_for_step), not the stopped ones' stale copy
            cache.set_usage(rt.moe_layers, records.usage)
        return unused

    def _within_landing_share(self, wanted: list[tuple[int, int]], num_slabs: int) -> list[tuple[int, int]]:
        """`wanted` ((row, how many more) landings) cut to the free slabs and LANDING_SHARE of the slabs, less the
        landings held already: a landing a row at a time, round the rows from one further each step, so no row is
        always the one left without (its misses are read from the host and not kept). A free slab evicts nothing,
        so a cold cache fills as fast as before."""
        room = int(num_slabs * LANDING_SHARE) + self.res.cache.free_slabs - \
            sum(len(slabs) for slabs in self.reserved.values())
        if sum(n for _, n in wanted) <= room:
            return wanted
        self._landing_turn = (self._landing_turn + 1) % max(len(wanted), 1)
        rows = wanted[self._landing_turn:] + wanted[:self._landing_turn]
        given = dict.fromkeys((row for row, _ in wanted), 0)
        while room > 0:
            before = room
            for row, n in rows:
                if room > 0 and given[row] < n:
                    given[row] += 1
                    room -= 1
            if room == before:  # every row has what it wanted
                break
        return [(row, given[row]) for row, _ in wanted if given[row]]

    def _publish_finished_copies(self) -> None:
        rt = self.res
        if rt.transfers is None:
            return
        rt.transfers.poll()
        entries = []
        for slab in rt.transfers.landed:
            key = rt.cache.owner[slab]
            if key is not None and key[1] >= 0 and rt.cache.state[slab] is SlabState.RESIDENT:
                entries.append((rt.row_of(key[0]), key[1], slab))
        rt.transfers.landed.clear()
        self.table.set_entries(entries)

    # --- reservations ------------------------------------------------------------------------------
    def _reserve(self) -> None:
        """Each offloaded row's landing slabs for the next step, written to the table: what it holds, the
        spare ones (ahead), then victims by the cache's ranking. A slab of a queued step's set is a
        placeholder in flight, never a victim, so the sets of two queued steps never share a slab."""
        rt, cache = self.res, self.res.cache
        self._keep_spare(self.reserved)
        self.reserved, self.spare = self.spare, {}
        k = rt.top_k
        wanted: list[tuple[int, int]] = []  # (row, how many more)
        for row, layer in enumerate(rt.moe_layers):
            if layer in rt.pinned:
                continue
            have = self.reserved.setdefault(row, [])
            spare = SPARE_AHEAD if self.ahead else SPARE
            want = min(self.table.landing_slots, self.last_misses.get(row, k) + spare)
            while len(have) > want:
                cache.release(have.pop())
            if len(have) < want:
                wanted.append((row, want - len(have)))
        wanted = self._within_landing_share(wanted, cache.num_slabs)
        keys = [(rt.moe_layers[row], -1 - next(self._names)) for row, n in wanted for _ in range(n)]
        if cache.num_slabs >= len(cache.layer_order) * rt.num_experts:
            # a slab for every offloaded expert: landings take free slabs only. A reservation that evicted
            # would make its victim a miss, whose landing's reservation evicts the next: misses for ever
            # (Q4_K at 16 GiB on the H200: 0.7 MB a token for one request, 5.3 MB in a batch of 8)
            keys = keys[:cache.free_slabs]
        if keys:
            before = list(cache.owner)
            slabs = cache.assign_many(keys, urgent=True, count=False)
            victims = [(rt.row_of(before[s][0]), before[s][1], NOT_RESIDENT) for s in slabs
                       if s is not None and before[s] is not None]
            self.evicted.update((s, before[s]) for s in slabs if s is not None and before[s] is not None)
            self.table.set_entries(victims)  # dropped from the table before anything overwrites them
            for key, slab in zip(keys, slabs):
                if slab is not None:
                    self.reserved[rt.row_of(key[0])].append(slab)
        self.table.reserve([self.reserved.get(row, []) for row in range(len(rt.moe_layers))])
