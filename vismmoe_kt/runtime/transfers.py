"""Transfers: copies of host blocks into GPU slabs, ahead of compute where possible.

On CUDA there are two copy streams. A host worker thread drains the prefetch queue (a priority list
of logical experts, replaced whenever the runtime learns more) onto the transfer stream, keeping at
most `max_in_flight` copies outstanding so that a newer list takes effect quickly. Urgent fetches
(a needed expert that was not queued) go on a high-priority stream, ahead of the queue. A long prompt's
next layer (`stream_layer`) goes on the transfer stream at once, whatever is in flight. Copies issued together
are one batch: one stream context, consecutive experts into consecutive quantized slabs as one copy, and
one event, which stands for each slab of the batch; the compute stream waits only on the events of the
experts it needs now. A copy into a slab first waits on the compute that last read the slab, so eviction
never races a kernel.

On the CPU (tests, or a machine without a GPU) copies are synchronous and the queue is drained at
once, so the same runtime logic runs everywhere.

All cache state is touched under the runtime's lock, which this class shares.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from .eviction import CycleRanking
from .slab_cache import Key, SlabCache, SlabState
from .store import ExpertStore


@dataclass
class TransferCounters:
    bytes_copied: int = 0
    copies: int = 0
    stall_events: list = field(default_factory=list)  # (start, end) CUDA timing events around compute-stream waits
    copy_events: list = field(default_factory=list)   # (start, end[, copies]) CUDA timing events around copies
    stall_seconds: float = 0.0
    copy_seconds: float = 0.0
    copies_timed: int = 0      # copies whose seconds are in copy_seconds (copies counts them when issued)
    bytes_host_reads: int = 0  # expert bytes the decode kernels read from the host store directly (zero-copy)

    def resolve(self) -> None:
        """Turn finished CUDA timing events into seconds (keeps the lists short)."""
        for attr, total in (("stall_events", "stall_seconds"), ("copy_events", "copy_seconds")):
            pending = []
            for start, end, *copies in getattr(self, attr):
                if end.query():
                    setattr(self, total, getattr(self, total) + start.elapsed_time(end) / 1000)
                    self.copies_timed += (copies[0] if copies else 1) if attr == "copy_events" else 0
                else:
                    pending.append((start, end, *copies))
            setattr(self, attr, pending)


class Transfers:
    def __init__(self, store: ExpertStore, pool: tuple[torch.Tensor, torch.Tensor], cache: SlabCache,
                 lock: threading.RLock, max_in_flight: int = 16):
        self.store, self.pool, self.cache, self.lock = store, pool, cache, lock
        self.device = pool[0].device
        self.cuda = self.device.type == "cuda"
        self.max_in_flight = max_in_flight
        self.events: dict[int, torch.cuda.Event] = {}     # slab -> copy done
        self.urgent: set[int] = set()                     # slabs of urgent copies in flight: the link is busy
        self.read_done: dict[int, torch.cuda.Event] = {}  # slab -> compute that last read it is done
        self.queue: list[tuple[float, Key]] = []          # prefetch candidates, highest priority last
        self.counters = TransferCounters()
        self._wake = threading.Condition(lock)
        self._stop = False
        self._ring: list[tuple[torch.Tensor, torch.Tensor]] = []  # page-locked slots for `prefetch_later`
        self._ring_next = 0
        self._pending_list = None  # (event, values, indices, n, to_items) waiting for the worker
        self._drops = 0  # drop_queue calls so far
        self._worker = None
        self.landed: list[int] = []  # slabs whose copies completed since the decode boundary last looked
        self.stream_victims = CycleRanking()  # whose slabs a streamed layer takes (`stream_layer`)
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.urgent_stream = torch.cuda.Stream(self.device, priority=-1)
            self._worker = threading.Thread(target=self._drain_forever, name="vismmoe-prefetch", daemon=True)
            self._worker.start()

    # --- copies (lock held) -----------------------------------------------------------------
    def _sources(self, key: Key, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        """The block's two parts in the slab dtype: views of the store, or (Q8_0) the block's bytes
        moved to `device` whole (the PCIe bytes) and dequantized there; for quantized slabs, the block."""
        if not self.store.quantized:
            return self.store.block_parts(*key)
        layer, expert = key
        if len(self.pool) == 1:
            return (self.store.layers[layer][expert],)
        block = self.store.layers[layer][expert:expert + 1]
        if device is not None:
            block = block.to(device, non_blocking=True)  # page-locked source: an asynchronous copy
        gate_up, down = self.store.dequantized(block, layer)
        return gate_up[0], down[0]

    def _copy_assigned(self, slabs: list[int | None], keys: list[Key], urgent: bool) -> None:
        """`_copy_batch` of the keys the cache gave a slab (None: refused)."""
        taken = [(slab, key) for slab, key in zip(slabs, keys) if slab is not None]
        self._copy_batch([slab for slab, _ in taken], [key for _, key in taken], urgent)

    def _copy_batch(self, slabs: list[int], keys: list[Key], urgent: bool) -> None:
        """Copies of `keys` into `slabs`, issued together: on CUDA in one stream context, timed as one and
        done at one event (each slab's copy is done when the batch is), consecutive experts of a quantized
        layer into consecutive slabs as one copy (`copy_runs`). Why: issued one by one, each copy made two
        timing events, a stream context and views in Python, up to 128 times for a prompt's layer, while a
        Q4_K expert crosses the link in about 50 us (docs/design.md, Transfers)."""
        if not slabs:
            return
        try:
            self._issue(slabs, keys, urgent)
        except BaseException:  # an error part way (out of memory dequantizing, an interrupt): nothing of the batch
            self._abandon(slabs, urgent)  # may be taken for landed
            raise

    def _abandon(self, slabs: list[int], urgent: bool) -> None:
        """A batch that failed: its slabs hold nothing, and on CUDA a later copy into one waits for whatever part
        of the batch the stream still runs."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.urgent_stream if urgent else self.stream)
        for slab in slabs:
            self.events.pop(slab, None)
            self.urgent.discard(slab)
            if self.cuda:
                self.read_done[slab] = done
            if self.cache.state[slab] is SlabState.IN_FLIGHT:
                self.cache.abandon(slab)

    def _issue(self, slabs: list[int], keys: list[Key], urgent: bool) -> None:
        for key in keys:
            self.counters.bytes_copied += self.store.block_bytes_of(key[0])
        self.counters.copies += len(slabs)
        if not self.cuda:
            start = time.perf_counter()
            for dst, src in self._copies(slabs, keys):
                dst.copy_(src)
            elapsed = time.perf_counter() - start
            self.counters.copy_seconds += elapsed
            self.counters.copies_timed += len(slabs)
            if urgent:  # synchronous: compute waits for the whole copy
                self.counters.stall_seconds += elapsed
            for slab in slabs:
                self.cache.complete(slab)
                self.landed.append(slab)
            return
        stream = self.urgent_stream if urgent else self.stream
        if urgent:
            self.urgent.update(slabs)
        # a copy into a slab first waits for the compute that last read it (one event may stand for many slabs)
        for event in _distinct(self.read_done.pop(s) for s in slabs if s in self.read_done):
            stream.wait_event(event)
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record(stream)
            for dst, src in self._copies(slabs, keys, self.device):
                dst.copy_(src, non_blocking=True)
            done.record(stream)
        for slab in slabs:
            self.events[slab] = done
        self.counters.copy_events.append((begin, done, len(slabs)))

    def _copies(self, slabs: list[int], keys: list[Key], device: torch.device | None = None):
        """(target, source) pairs that copy `keys` into `slabs`: quantized slabs by runs of consecutive experts
        into consecutive slabs where a slab is exactly a block (else a block at a time), the model's dtype part
        by part, a quantized store into slabs of the model's dtype block by block (dequantized on `device`)."""
        if len(self.pool) == 1:  # quantized slabs: the blocks' bytes as they are
            pool = self.pool[0]
            for layer, expert, slab, count in copy_runs(slabs, keys):
                nbytes, blocks = self.store.block_bytes_of(layer), self.store.layers[layer]
                if nbytes == pool.shape[1]:  # contiguous rows: the run in one copy
                    yield pool[slab:slab + count], blocks[expert:expert + count]
                else:  # a strided target: one block at a time
                    for i in range(count):
                        yield pool[slab + i, :nbytes], blocks[expert + i]
            return
        for slab, key in zip(slabs, keys):
            yield from zip((self.pool[0][slab], self.pool[1][slab]), self._sources(key, device))

    def poll(self) -> None:
        """Mark finished copies resident (a batch's event asked once)."""
        finished: dict[int, bool] = {}
        for slab, event in list(self.events.items()):
            if id(event) not in finished:
                finished[id(event)] = event.query()
            if finished[id(event)]:
                del self.events[slab]
                self.urgent.discard(slab)
                self.cache.complete(slab)
                self.landed.append(slab)

    def fetch(self, keys: list[Key]) -> list[int]:
        """Urgent copies for needed experts that have no slab; waits for in-flight copies if it must."""
        slabs = self.cache.assign_many(keys, urgent=True)
        while None in slabs:  # every other slab is Required or in flight: let a copy land, then retry
            if not self.events:
                for slab in slabs:  # the ones assigned so far get no copy
                    if slab is not None:
                        self.cache.abandon(slab)
                raise RuntimeError("expert cache has no slab to give up; the budget is below one layer")
            slab, event = next(iter(self.events.items()))
            event.synchronize()
            self.poll()
            missing = [k for k, s in zip(keys, slabs) if s is None]
            got = iter(self.cache.assign_many(missing, urgent=True))
            slabs = [s if s is not None else next(got) for s in slabs]
        self._copy_urgently(slabs, keys)
        for slab in slabs:
            self.cache.use(slab)
        return slabs

    def fill(self, keys: list[Key]) -> None:
        """Copy experts that have no slab into free slabs, then wait until every copy in flight (these and
        any before them) has landed: a budget that holds every offloaded expert loads the ones no prompt
        has routed to yet, once, and decode starts with every slab resident (decode_boundary.py)."""
        if self.cache.free_slabs < len(keys):
            raise RuntimeError(f"fill: {len(keys)} experts but {self.cache.free_slabs} free slabs")
        if keys:
            self._copy_urgently(self.cache.assign_many(keys, urgent=True), keys)
        for event in list(self.events.values()):
            event.synchronize()
        self.poll()

    def _copy_urgently(self, slabs: list[int], keys: list[Key]) -> None:
        if self._dequantizes_on_device():
            self._fetch_dequantized(slabs, keys)
        else:
            self._copy_batch(slabs, keys, urgent=True)

    def _dequantizes_on_device(self) -> bool:
        """A quantized store on CUDA with the Triton kernels: a fetch moves each layer's blocks in one
        launch and dequantizes them there (kernels.dequantize.fetch_q8), instead of a dozen small torch
        kernels per expert (which made a prefill touching every expert of every layer 3x slower)."""
        from .kernels import dequantize

        return self.cuda and self.store.quantized and len(self.pool) == 2 and self.store.pin_memory and \
            dequantize.available(self.pool[0].dtype)

    def _fetch_dequantized(self, slabs: list[int], keys: list[Key]) -> None:
        """Urgent copies of `keys` into `slabs`, one launch per layer among them, on the urgent stream."""
        from .kernels import dequantize

        stream = self.urgent_stream
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for slab, (layer, expert) in zip(slabs, keys):
            by_layer.setdefault(layer, []).append((slab, expert))
        for layer, pairs in by_layer.items():
            for slab, _ in pairs:
                if slab in self.read_done:
                    stream.wait_event(self.read_done.pop(slab))
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                begin.record(stream)
                ids = torch.tensor([e for _, e in pairs], dtype=torch.long).to(self.device, non_blocking=True)
                target = torch.tensor([s for s, _ in pairs], dtype=torch.long).to(self.device, non_blocking=True)
                need = torch.ones(len(pairs), dtype=torch.int8, device=self.device)
                dequantize.fetch_q8(ids, need, target, self.pool, self.store.layers[layer].data_ptr(),
                                    self.store.block_bytes_of(layer), self.store.inter, self.store.hidden,
                                    fmt=self.store.fmt, down_fmt=self.store.down_format(layer))
                done.record(stream)
            for slab, _ in pairs:
                self.events[slab] = done
                self.urgent.add(slab)
            self.counters.bytes_copied += len(pairs) * self.store.block_bytes_of(layer)
            self.counters.copies += len(pairs)
            self.counters.copy_events.append((begin, done, len(pairs)))

    def wait_for(self, slabs: list[int]) -> None:
        """Make the current (compute) stream wait for these slabs' copies, timing the wait."""
        pending = _distinct(self.events[s] for s in slabs if s in self.events)
        if not pending:
            return
        compute = torch.cuda.current_stream(self.device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(compute)
        for event in pending:
            compute.wait_event(event)
        end.record(compute)
        self.counters.stall_events.append((begin, end))

    def release(self, slabs: list[int]) -> None:
        """The current stream's work reads these slabs: later copies into them wait for it."""
        if not self.cuda or not slabs:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for slab in slabs:
            self.read_done[slab] = event

    # --- prefetch ---------------------------------------------------------------------------
    def prefetch(self, items: list[tuple[Key, float]]) -> None:
        """Replace the prefetch queue with `items` (logical expert, priority: higher first)."""
        with self.lock:
            self.queue = sorted(((p, k) for k, p in items if k not in self.cache.where), key=lambda x: x[0])
            if self.cuda:
                self._wake.notify()
            else:
                self._drain(limit=len(self.queue))

    def stream_layer(self, keys: list[Key], priority: float) -> int:
        """Copy those of `keys` that have no slab now, as one batch on the prefetch stream, whatever else is in
        flight, and drop the prefetch queue's guesses: a long prompt's next offloaded layer, needed once the
        layer computing now is done (streamed prefill, executors/placement.py). Through the queue the worker
        issued them `max_in_flight` at a time and waited for each group, leaving the link idle between
        groups. `priority` is the prefetch priority the cache admits them with; the victims are the slabs whose
        layer runs again last (eviction.CycleRanking), not the cache's ranking. Returns how many were issued."""
        with self.lock:
            self.drop_queue()
            missing = [key for key in keys if key not in self.cache.where]
            slabs = self.cache.assign_in_slab_order(missing, priority, ranking=self.stream_victims)
            self._copy_assigned(slabs, missing, urgent=False)
            return sum(slab is not None for slab in slabs)

    def prefetch_later(self, values: torch.Tensor, flat: torch.Tensor, to_items) -> None:
        """Queue a priority list still on the GPU: copy it to page-locked host buffers asynchronously and
        let the worker turn it into the prefetch queue once the copy's event has passed."""
        with self.lock:
            if not self._ring or self._ring[0][0].numel() < values.numel():
                self._ring = [(torch.empty(values.numel(), pin_memory=True),
                               torch.empty(values.numel(), dtype=torch.long, pin_memory=True)) for _ in range(8)]
            # eight slots: a newer list replaces an older one long before its slot comes round again
            self._ring_next = (self._ring_next + 1) % len(self._ring)
            host_values, host_index = self._ring[self._ring_next]
            n = values.numel()
            host_values[:n].copy_(values, non_blocking=True)
            host_index[:n].copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._pending_list = (event, host_values, host_index, n, to_items)
            self._wake.notify()

    def drop_queue(self) -> None:
        """Forget every queued prefetch, and a priority list still on its way (lock held), also one the worker is
        reading back right now (`_take_pending_list` sees the drop when it takes the lock again)."""
        self.queue.clear()
        self._pending_list = None
        self._drops += 1

    def _take_pending_list(self) -> None:
        """Worker side of `prefetch_later` (lock held on entry and exit; released while waiting)."""
        pending, self._pending_list = self._pending_list, None
        if pending is None:
            return
        event, host_values, host_index, n, to_items = pending
        drops = self._drops
        self.lock.release()
        try:
            event.synchronize()
            items = to_items(host_values[:n].tolist(), host_index[:n].tolist())
        finally:
            self.lock.acquire()
        if self._drops == drops:  # not dropped meanwhile (a stream, decode leaving)
            self.queue = sorted(((p, k) for k, p in items if k not in self.cache.where), key=lambda x: x[0])

    def _drain(self, limit: int) -> bool:
        """Issue up to `limit` queued prefetches (lock held). False when the cache refuses more. Only while
        the link is idle: an urgent copy in flight is a layer waiting, and a prefetch beside it would
        share the link's bandwidth with it (the worker tries again once a copy lands)."""
        if self.urgent:
            return True
        batch: list[tuple[float, Key]] = []
        while self.queue and len(batch) < limit:
            priority, key = self.queue.pop()
            if key not in self.cache.where:
                batch.append((priority, key))
        if not batch:
            return True
        keys = [k for _, k in batch]
        slabs = self.cache.assign_many(keys, [p for p, _ in batch])
        self._copy_assigned(slabs, keys, urgent=False)
        if None in slabs:
            self.queue.clear()  # lower priorities cannot take a slab either
            return False
        return True

    def _drain_forever(self) -> None:
        while True:
            with self.lock:
                while not self._stop and not self.queue and self._pending_list is None:
                    self._wake.wait()
                if self._stop:
                    return
                self._take_pending_list()
                self.poll()
                room = self.max_in_flight - len(self.events)
                if room > 0:
                    self._drain(limit=room)
                oldest = next(iter(self.events.values()), None) if self.queue else None
            if oldest is not None:
                oldest.synchronize()  # outside the lock; frees the GIL while the copy engine works

    def close(self) -> None:
        if self._worker is not None:
            with self.lock:
                self._stop = True
                self._wake.notify()
            self._worker.join(timeout=5)


def copy_runs(slabs: list[int], keys: list[Key]) -> list[tuple[int, int, int, int]]:
    """(layer, first expert, first slab, count) runs that cover the copies of `keys` into `slabs`: consecutive
    experts of one layer going into consecutive slabs make one run (a prompt's first fill takes free slabs in
    order, so a whole layer is often one), in the order of `keys` otherwise."""
    runs: list[list[int]] = []
    for slab, (layer, expert) in zip(slabs, keys):
        last = runs[-1] if runs else None
        if last is not None and last[0] == layer and last[1] + last[3] == expert and last[2] + last[3] == slab:
            last[3] += 1
        else:
            runs.append([layer, expert, slab, 1])
    return [tuple(run) for run in runs]


def _distinct(events) -> list:
    """The distinct events among `events` (a batch's one event stands for each of its slabs), in order."""
    seen: dict[int, object] = {}
    for event in events:
        seen.setdefault(id(event), event)
    return list(seen.values())
