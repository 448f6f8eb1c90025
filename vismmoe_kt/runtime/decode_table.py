"""DecodeTable: the device-side state a decode step reads and writes, so that no MoE layer needs the host.

Shapes: L MoE layers (rows, in execution order), E experts, K experts per token, R landing slots
per row (K, more when lookahead prefetch also lands there), B prefetch candidates of one call.

    slots    (L, E + 1)  the slab holding each expert, or NOT_RESIDENT (-1: read it from the host
                         store, and land it), or ARRIVING (-2: read it from the host, a copy of it is
                         on the way, or its landing is claimed); a pinned layer's row is the identity
                         into its own bank; column E is a dump for the masked scatters below
    landing  (L, R)      slabs reserved for each layer's landings this step, `count` of them valid
    used     (L,)        landing slots taken so far (a step run twice, e.g. by the graph self-check,
                         continues where the first run stopped, never writing a slab twice)
    owner    (L, R + 1)  what landed in each slot: the expert (a miss read through), E + the expert
                         (a lookahead prefetch), -1 if none (column R: dump)
    routed   (L, K)      this step's expert ids, and `read` (L, K): the slot each pair was read from
                         (a batched step of T tokens records into batch_routed / batch_read (L, T K),
                         token t's pairs at columns t K.., once `enable_batch` made them)
    usage    (L, E)      per expert, an average over decode tokens of its router probability
                         (`observe_router`; the cache ranks eviction victims by it)
    cpu_quota (K + 1,)   hybrid mode: of a layer's m missing pairs, how many the CPU computes
                         (`set_cpu_quota`, from the cost model's split; zeros: none). Those are the
                         last cpu_quota[m] misses in routing order (the router's lowest weights, where
                         a quantized CPU copy's error weighs least): they claim nothing, read nothing
                         from the host, and their slot reads CPU_PAIR (-3) for the kernels and records

Inside the step (device ops only, so a CUDA graph holds them):
  * `lookup`: a missing expert claims its table entry (NOT_RESIDENT -> ARRIVING, compare-and-swap)
    and the layer's next landing slot (atomic add on `used`); the experts kernel reads it from the
    host and writes it there; `publish` then points the table at it.
  * `prefetch` (lookahead, on a side stream while earlier layers compute): predicted (row, expert)
    pairs claim entries and landing slots the same way, are copied from the host into their slots,
    then published. The claims make a layer's own miss and a prefetch of the same expert exclusive:
    whoever claims first lands it; the other reads from the host and lands nothing.
Between steps the host (DecodeBoundary) reads `routed`, `read`, `owner` back through page-locked
buffers, tells the slab cache what landed, and writes the next reservations and any invalidations,
all on the compute stream, so they are ordered after every read of the old contents and before the
next step.

Safety, by construction: a slab is pointed at only after its weights were written (landing writes
precede `publish` on the stream; copies are published when their event has passed, prefetches by a
launch after their copy's), and a slab is overwritten only after the table stopped pointing at it
(invalidation precedes the reservation); the side stream joins the compute stream before the step
ends, so nothing of a step is in flight at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import torch

from .kernels import prefetch_copy, table_ops
from .store import block_views

NOT_RESIDENT, ARRIVING, CPU_PAIR = -1, -2, -3


@dataclass
class StepReadback:
    routed: list[list[int]]        # per row: the step's expert ids
    read: list[list[int]]          # per row: the slot each was read from (-1: the host)
    owner: list[list[int]]         # per row: per landing slot, what landed (expert, E + expert if prefetched, -1: none)
    usage: "np.ndarray"            # (L, E): per row, per expert, the averaged router probability


@dataclass
class QuietRecords:
    """A quiet step's records (DecodeTable.quiet_records), as taken: tensors until they are accounted."""
    routed: torch.Tensor
    read: torch.Tensor
    owner: torch.Tensor
    usage: "np.ndarray"

    def readback(self) -> StepReadback:
        return StepReadback(self.routed.tolist(), self.read.tolist(), self.owner.tolist(), self.usage)


class DecodeTable:
    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device,
                 landing_slots: int | None = None):
        self.num_layers, self.num_experts, self.top_k, self.device = num_layers, num_experts, top_k, device
        self.landing_slots = landing_slots or top_k  # R
        kw = dict(dtype=torch.long, device=device)
        self.slots = torch.full((num_layers, num_experts + 1), -1, **kw)
        self.landing = torch.full((num_layers, self.landing_slots), -1, **kw)
        self.count = torch.zeros(num_layers, **kw)
        self.used = torch.zeros(num_layers, **kw)
        self.owner = torch.full((num_layers, self.landing_slots + 1), -1, **kw)
        self.routed = torch.zeros(num_layers, top_k, **kw)
        self.read = torch.full((num_layers, top_k), -1, **kw)
        self.no_landing = torch.full((top_k,), -1, **kw)
        self.usage = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)
        self.cpu_quota = torch.zeros(top_k + 1, **kw)
        self._quota: list[int] = [0] * (top_k + 1)
        cuda = device.type == "cuda"
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
                      for t in (self.routed, self.read, self.owner, self.usage)]
        self._event: torch.cuda.Event | None = None
        self._pending = False
        self._read_pairs = 0
        self.batch_routed: torch.Tensor | None = None  # (L, K * max rows): a batched step's records
        self.batch_read: torch.Tensor | None = None
        self._batch_host: list[torch.Tensor] = []
        self.batch_pairs = 0  # pairs per layer the step under way records there (0: a single token's step)
        # every offloaded expert in a resident slab as decode started (DecodeBoundary): no step can miss, so
        # the steps read their slabs straight from `slots` and record nothing
        self.settled = False

    def enable_batch(self, rows: int) -> None:
        """Record buffers for batched steps of up to `rows` tokens (made once: captured steps write them)."""
        if self.batch_routed is not None and self.batch_routed.shape[1] >= rows * self.top_k:
            return
        kw = dict(dtype=torch.long, device=self.device)
        self.batch_routed = torch.zeros(self.num_layers, rows * self.top_k, **kw)
        self.batch_read = torch.full((self.num_layers, rows * self.top_k), -1, **kw)
        cuda = self.device.type == "cuda"
        self._batch_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
                            for t in (self.batch_routed, self.batch_read)]

    def records(self, offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a lookup writes its token's (routed, read): the single step's rows, or a batched step's
        columns `offset`.. of the batch buffers (views; each row one layer)."""
        if offset is None:
            return self.routed, self.read
        k = self.top_k
        return self.batch_routed[:, offset:offset + k], self.batch_read[:, offset:offset + k]

    # --- inside the step (device ops only) ---------------------------------------------------------
    def lookup(self, row: int, ids: torch.Tensor, use_kernel: bool = False,
               offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, landing slab per pair) for one token's K expert ids of an offloaded layer; records
        the step (a batched step's token at `offset`: records()) and claims the landings. `use_kernel`:
        the same in one Triton launch (kernels.table_ops.plan). Several tokens' T x K ids (a batched step,
        `offset` given): token t as the token at offset + t K, one after another (the kernel runs them
        at once; either way, of tokens missing the same expert one claims it, the others read the host)."""
        if use_kernel:
            return table_ops.plan(self, row, ids, offset)
        k = self.top_k
        if ids.numel() > k:
            if offset is None or ids.numel() % k:
                raise ValueError(f"lookup of {ids.numel()} pairs: whole tokens of {k}, into a batched step's records")
            parts = [self.lookup(row, ids[t:t + k], False, offset + t) for t in range(0, ids.numel(), k)]
            return torch.cat([slots for slots, _ in parts]), torch.cat([land for _, land in parts])
        routed, read = self.records(offset)
        slots = self.slots[row].index_select(0, ids)
        miss = slots == NOT_RESIDENT
        rank = torch.cumsum(miss.long(), 0) - 1  # each miss's place among the layer's misses
        misses = miss.long().sum().view(1)
        on_cpu = miss & (rank >= misses - self.cpu_quota.index_select(0, misses))  # the last ones; no host read
        slots = torch.where(on_cpu, CPU_PAIR, slots)
        routed[row].copy_(ids)
        read[row].copy_(slots)
        rows = torch.full_like(ids, row)
        return slots, self._claim(rows, ids, miss & ~on_cpu, ids)

    @property
    def cpu_active(self) -> bool:
        """Whether the quota sends any miss to the CPU: a step captured without the CPU's calls (no
        host functions in its graph) serves every step while it does not."""
        return any(self._quota)

    def set_cpu_quota(self, quota: list[int]) -> None:
        """Between steps: per count of missing pairs, how many the CPU computes (a write on the stream
        only when it changes)."""
        if len(quota) != self.top_k + 1 or any(not 0 <= q <= m for m, q in enumerate(quota)):
            raise ValueError(f"cpu quota needs {self.top_k + 1} entries, entry m in 0..m: {quota}")
        if list(quota) != self._quota:
            self._quota = list(quota)
            self.cpu_quota.copy_(torch.tensor(quota, dtype=torch.long))

    def _claim(self, rows: torch.Tensor, ids: torch.Tensor, wanted: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
        """The landing slab each wanted (row, expert) pair takes, -1 where its row has none left; the
        entries of those that took one become ARRIVING and their slots record `owners`. The twin of
        the kernels' compare-and-swap and atomic add (one stream: nothing races it), and like them
        it never reads a device value on the host."""
        key = rows * (self.num_experts + 1) + ids  # a pair asked for twice: only its first ask claims
        earlier = (key[:, None] == key[None, :]) & wanted[None, :] & torch.ones_like(wanted[:, None] & wanted).tril(-1)
        wanted = wanted & ~earlier.any(1)
        mine = (rows[:, None] == torch.arange(self.num_layers, device=rows.device)) & wanted[:, None]  # (P, L)
        rank = self.used[rows] + (torch.cumsum(mine, 0) * mine).sum(1) - 1  # the pair's place among its row's claims
        self.used += mine.sum(0)
        lands = wanted & (rank < self.count[rows])
        at = torch.where(lands, rank, self.landing_slots)  # column R: the dump
        slab = torch.where(lands, self.landing[rows, at.clamp(max=self.landing_slots - 1)], -1)
        self.owner.view(-1).scatter_(0, rows * (self.landing_slots + 1) + at, torch.where(lands, owners, -1))
        column = torch.where(lands, ids, self.num_experts)
        self.slots.view(-1).scatter_(0, rows * (self.num_experts + 1) + column, torch.full_like(ids, ARRIVING))
        return slab

    def observe_router(self, row: int, probabilities: torch.Tensor, keep: float) -> None:
        """usage[row] <- keep * usage[row] + (1 - keep) * the router's probabilities (T, E) of the step's
        tokens, averaged (a step of several rows pads only where no layer is offloaded: nothing to evict)."""
        rows = probabilities.reshape(-1, probabilities.shape[-1])
        # one row is its own mean: no reduction kernel (a launch per offloaded layer of a single request's step)
        mean = rows[0].float() if rows.shape[0] == 1 else rows.float().mean(dim=0)
        self.usage[row].lerp_(mean, 1.0 - keep)  # keep * usage + (1 - keep) * mean in one kernel, not two

    def publish(self, row: int, ids: torch.Tensor, land: torch.Tensor) -> None:
        """After the experts were written to their landing slabs: point the table at them
        (kernels.table_ops.combine does this in its own launch)."""
        lands = land >= 0
        self.slots[row].scatter_(0, torch.where(lands, ids, self.num_experts), land)

    def prefetch(self, rows: torch.Tensor, experts: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor],
                 host_blocks: list[torch.Tensor | None], use_kernel: bool = False,
                 host_addresses: torch.Tensor | None = None) -> None:
        """Copy predicted (row, expert) pairs ((B,) each, -1: none) that nothing holds or claims into
        landing slots of their rows, then publish them. Pinned rows hold everything, so nothing happens
        there. Device ops only (a side stream inside the step's graph). `use_kernel`: Triton, reading
        the mapped host store at `host_addresses` (L,) (kernels.prefetch_copy.prefetch); else the torch twin
        (host_blocks: each row's (E, block) store, None for pinned rows; the pools' last row is scratch)."""
        valid = (experts >= 0) & (experts < self.num_experts) & (rows >= 0) & (rows < self.num_layers)
        rows, experts = torch.where(valid, rows, 0), torch.where(valid, experts, 0)
        if use_kernel:
            return prefetch_copy.prefetch(self, rows, torch.where(valid, experts, -1), pools, host_addresses)
        wanted = valid & (self.slots[rows, experts] == NOT_RESIDENT)
        slab = self._claim(rows, experts, wanted, experts + self.num_experts)
        lands = slab >= 0
        gate_up_pool, down_pool = pools
        inter, hidden = gate_up_pool.shape[1] // 2, gate_up_pool.shape[2]
        block = torch.zeros(rows.numel(), 3 * inter * hidden, dtype=gate_up_pool.dtype, device=rows.device)
        for row, blocks in enumerate(host_blocks):  # gathered row by row: no host read of `rows`
            if blocks is not None:
                here = (lands & (rows == row))[:, None]
                block = torch.where(here, blocks[experts].to(block.device), block)
        gate_up, down = block_views(block, inter, hidden)
        target = torch.where(lands, slab, gate_up_pool.shape[0] - 1)
        gate_up_pool.index_copy_(0, target, gate_up)
        down_pool.index_copy_(0, target, down)
        column = torch.where(lands, experts, self.num_experts)
        self.slots.view(-1).scatter_(0, rows * (self.num_experts + 1) + column, slab)

    # --- between steps (host) ----------------------------------------------------------------------
    def readback(self) -> None:
        """Start copying the step's records to the host (after the step, asynchronously)."""
        for host, device in zip(self._host, (self.routed, self.read, self.owner, self.usage)):
            host.copy_(device, non_blocking=True)
        if self.batch_pairs:  # a batched step's records: its tokens' columns
            for host, device in zip(self._batch_host, (self.batch_routed, self.batch_read)):
                host[:, :self.batch_pairs].copy_(device[:, :self.batch_pairs], non_blocking=True)
        self._read_pairs = self.batch_pairs
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
        self._pending = True

    def collect(self) -> StepReadback | None:
        """The last step's records (waits for its copy, normally long done), or None if none is pending."""
        if not self._pending:
            return None
        routed, read = self._waited_records()
        self._pending = False
        routed, read, owner = routed.tolist(), read.tolist(), self._host[2].tolist()
        usage = self._host[3].numpy().copy()  # (L, E) array: the cache ranks with numpy (the buffer is reused)
        return StepReadback(routed, read, owner, usage)

    def _waited_records(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending step's (routed, read) on the host, once its copy is done: a batched step's every
        token's pairs in token order, else the single step's rows (views of the page-locked buffers)."""
        if self._event is not None:
            self._event.synchronize()
        if self._read_pairs:
            return tuple(t[:, :self._read_pairs] for t in self._batch_host)
        return self._host[0], self._host[1]

    def quiet_records(self, rows: list[int]) -> "QuietRecords | None":
        """The last step's records, taken without converting them, if that step changed nothing the next
        step's reservations depend on: every pair of the table's `rows` read from a slab (no host read,
        no CPU pair) and nothing landed there. Else None, and they stay pending for `collect`. A quiet
        step claimed none of its landing slots, so the next step can run on the same reservations while
        the host accounts this one (DecodeBoundary defers it: the host's upkeep off the critical path)."""
        if not self._pending:
            return None
        routed, read = self._waited_records()
        # numpy on the page-locked copies: host work, no torch op a sync watcher would take for a device read.
        # Only the table's `rows` (the offloaded layers): a pinned layer reads its bank and records nothing
        if (read.numpy()[rows] < 0).any() or (self._host[2].numpy()[rows, :self.landing_slots] >= 0).any():
            return None
        self._pending = False
        # copies: the page-locked buffers take the next step's records while these wait to be accounted
        return QuietRecords(routed.clone(), read.clone(), self._host[2].clone(), self._host[3].numpy().copy())

    def discard(self) -> None:
        self._pending = False

    def _upload(self, values: list, dtype=torch.long) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":  # page-locked source: the copy is asynchronous and safe to reuse
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def set_entries(self, entries: list[tuple[int, int, int]]) -> None:
        """(row, expert, slot) entries: slot -1 invalidates (on the current stream)."""
        if not entries:
            return
        flat = self._upload([row * (self.num_experts + 1) + e for row, e, _ in entries])
        self.slots.view(-1).index_copy_(0, flat, self._upload([s for _, _, s in entries]))

    def rebuild(self, rows: list[list[int]]) -> None:
        """The whole table from the host's view (every row: E slots), e.g. when decode starts."""
        full = [row + [-1] for row in rows]
        self.slots.copy_(self._upload(full))

    def reserve(self, landing: list[list[int]]) -> None:
        """Each row's landing slabs for the next step (at most R; fewer means fewer misses land)."""
        padded = [slabs + [-1] * (self.landing_slots - len(slabs)) for slabs in landing]
        self.landing.copy_(self._upload(padded))
        self.count.copy_(self._upload([len(slabs) for slabs in landing]))
        self.used.zero_()
        self.owner.fill_(-1)
