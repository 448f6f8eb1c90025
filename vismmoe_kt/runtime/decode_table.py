"""DecodeTable: the device-side state a decode step reads and writes, so that no MoE layer needs the host.

Shapes: L MoE layers (rows, in execution order), E experts, K experts per token, R = K landing slots.

    slots    (L, E + 1)  the slab holding each expert, or NOT_RESIDENT (-1: read it from the host
                         store, and land it), or ARRIVING (-2: read it from the host, its copy is on
                         the way); a pinned layer's row is the identity into its own bank; column E
                         is a dump for the masked scatters below
    landing  (L, R)      slabs reserved for each layer's misses this step, `count` of them valid
    used     (L,)        landing slots taken so far (a step run twice, e.g. by the graph self-check,
                         continues where the first run stopped, never writing a slab twice)
    owner    (L, R + 1)  the expert that landed in each slot, -1 if none (column R: dump)
    routed   (L, K)      this step's expert ids, and `read` (L, K): the slot each pair was read from

Inside the step (`lookup` then `publish`, device ops only, so a CUDA graph holds them): a missing
expert takes the layer's next landing slot if one is left; the experts kernel reads it from the host
and writes it there; `publish` then points the table at it. Between steps the host (DecodeBoundary)
reads `routed`, `read`, `owner`, `used` back through page-locked buffers, tells the slab cache what
landed, and writes the next reservations and any invalidations, all on the compute stream, so they
are ordered after every read of the old contents and before the next step.

Safety, by construction: a slab is pointed at only after its weights were written (landing writes
precede `publish` on the stream; copies are published when their event has passed), and a slab is
overwritten only after the table stopped pointing at it (invalidation precedes the reservation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decode_kernel

NOT_RESIDENT, ARRIVING = -1, -2


@dataclass
class StepReadback:
    routed: list[list[int]]        # per row: the step's expert ids
    read: list[list[int]]          # per row: the slot each was read from (-1: the host)
    owner: list[list[int]]         # per row: per landing slot, the expert that landed (-1: none)


class DecodeTable:
    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device):
        self.num_layers, self.num_experts, self.top_k, self.device = num_layers, num_experts, top_k, device
        kw = dict(dtype=torch.long, device=device)
        self.slots = torch.full((num_layers, num_experts + 1), -1, **kw)
        self.landing = torch.full((num_layers, top_k), -1, **kw)
        self.count = torch.zeros(num_layers, **kw)
        self.used = torch.zeros(num_layers, **kw)
        self.owner = torch.full((num_layers, top_k + 1), -1, **kw)
        self.routed = torch.zeros(num_layers, top_k, **kw)
        self.read = torch.full((num_layers, top_k), -1, **kw)
        self.no_landing = torch.full((top_k,), -1, **kw)
        cuda = device.type == "cuda"
        self._host = [torch.empty(t.shape, dtype=torch.long, pin_memory=cuda)
                      for t in (self.routed, self.read, self.owner)]
        self._event: torch.cuda.Event | None = None
        self._pending = False

    # --- inside the step (device ops only) ---------------------------------------------------------
    def lookup(self, row: int, ids: torch.Tensor, use_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, landing slab per pair) for one token's K expert ids of an offloaded layer; records
        the step. `use_kernel`: the same in one Triton launch (decode_kernel.plan)."""
        if use_kernel:
            return decode_kernel.plan(self, row, ids)
        slots = self.slots[row].index_select(0, ids)
        self.routed[row].copy_(ids)
        self.read[row].copy_(slots)
        miss = slots == NOT_RESIDENT
        rank = self.used[row] + torch.cumsum(miss, 0) - 1
        lands = miss & (rank < self.count[row])
        slot_of = self.landing[row].index_select(0, rank.clamp(0, self.top_k - 1))
        return slots, torch.where(lands, slot_of, -1)

    def publish(self, row: int, ids: torch.Tensor, land: torch.Tensor) -> None:
        """After the experts were written to their landing slabs: point the table at them, record the
        owners (decode_kernel.combine does this in its own launch)."""
        lands = land >= 0
        rank = self.used[row] + torch.cumsum(lands, 0) - 1  # landed pairs are the first misses, in order
        self.slots[row].scatter_(0, torch.where(lands, ids, self.num_experts), land)
        self.owner[row].scatter_(0, torch.where(lands, rank, self.top_k), torch.where(lands, ids, -1))
        self.used[row:row + 1] += lands.sum()

    # --- between steps (host) ----------------------------------------------------------------------
    def readback(self) -> None:
        """Start copying the step's records to the host (after the step, asynchronously)."""
        for host, device in zip(self._host, (self.routed, self.read, self.owner)):
            host.copy_(device, non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
        self._pending = True

    def collect(self) -> StepReadback | None:
        """The last step's records (waits for its copy, normally long done), or None if none is pending."""
        if not self._pending:
            return None
        if self._event is not None:
            self._event.synchronize()
        self._pending = False
        routed, read, owner = (t.tolist() for t in self._host)
        return StepReadback(routed, read, owner)

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
        """Each row's landing slabs for the next step (at most K; fewer means fewer misses land)."""
        padded = [slabs + [-1] * (self.top_k - len(slabs)) for slabs in landing]
        self.landing.copy_(self._upload(padded))
        self.count.copy_(self._upload([len(slabs) for slabs in landing]))
        self.used.zero_()
        self.owner.fill_(-1)
