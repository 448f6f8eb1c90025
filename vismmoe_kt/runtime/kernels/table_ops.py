"""The decode table's steps (runtime/decode_table.py) as Triton kernels, each one launch inside the
step's graph: a layer's lookup with its landing claims (`plan`), the weighted combine of the pair
outputs with the publish of what landed (`combine`), and the claim and publish around the lookahead
prefetch's copies (prefetch_copy.py). DecodeTable's torch methods are their twins.

Claims go through atomics (`_claim`): a compare-and-swap takes an entry from NOT_RESIDENT (-1) to
ARRIVING (-2), an atomic add takes the row's next landing slot, so a layer's own miss and a
prefetch of the same expert, or two tokens missing one expert, never both land it. The combine sums
each token's K outputs in a fixed order: deterministic.
"""

from __future__ import annotations

import torch
from kernel_launch import cdiv, launch, next_power_of_2

from . import triton_support
from .triton_support import tl, triton

if tl is not None:
    @triton.jit
    def _claim(table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, rows, ids, wanted, owners,
               E1: tl.constexpr, R: tl.constexpr, LANES: tl.constexpr):
        """DecodeTable._claim: each wanted pair's entry NOT_RESIDENT -> ARRIVING (compare-and-swap:
        a layer's own miss and a prefetch of the same expert race for it), then its row's next
        landing slot (atomic add); a claim that finds no slot left is undone. Returns the slabs."""
        entry = table_ptr + rows * E1 + ids
        # lanes not wanted compare against a value no entry holds, so their swap never happens
        old = tl.atomic_cas(entry, tl.where(wanted, -1, -7).to(tl.int64), tl.full([LANES], -2, tl.int64))
        got = wanted & (old == -1)
        rank = tl.atomic_add(used_ptr + rows, got.to(tl.int64), mask=got)
        lands = got & (rank < tl.load(count_ptr + rows, mask=got, other=0))
        tl.store(entry, tl.full([LANES], -1, tl.int64), mask=got & (lands == 0))  # undo: nothing will land
        slab = tl.load(landing_ptr + rows * R + rank, mask=lands, other=-1)
        tl.store(owner_ptr + rows * (R + 1) + rank, owners, mask=lands)
        return tl.where(lands, slab, -1)

    @triton.jit
    def _plan_kernel(ids_ptr, table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, routed_ptr, read_ptr, slots_ptr,
                     land_ptr, quota_ptr, row, E1: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr,
                     STRIDE: tl.constexpr):
        """DecodeTable.lookup for one token per program (program t: pairs t K..): slots, claimed landing
        slabs, the step's records; the last quota[m] of a token's m misses go to the CPU (slot -3: no
        claim, no host read). Tokens of one step claim through the same atomics, so of two tokens
        missing one expert, one lands it and the other reads it from the host."""
        k = tl.arange(0, KP)
        ok = k < K
        first = tl.program_id(0) * K
        ids = tl.load(ids_ptr + first + k, mask=ok, other=0).to(tl.int64)
        slots = tl.load(table_ptr + row * E1 + ids, mask=ok, other=0, volatile=True)  # a prefetch may publish
        miss = ok & (slots == -1)
        rank = tl.cumsum(miss.to(tl.int64), 0) - 1
        misses = tl.sum(miss.to(tl.int64), 0)
        on_cpu = miss & (rank >= misses - tl.load(quota_ptr + misses))  # the last quota[m] misses
        slots = tl.where(on_cpu, -3, slots)
        rows = tl.zeros([KP], tl.int64) + row
        land = _claim(table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, rows, ids, miss & (on_cpu == 0), ids,
                      E1, R, KP)
        tl.store(slots_ptr + first + k, slots, mask=ok)
        tl.store(land_ptr + first + k, land, mask=ok)
        tl.store(routed_ptr + row * STRIDE + first + k, ids, mask=ok)  # the records' rows: STRIDE apart
        tl.store(read_ptr + row * STRIDE + first + k, slots, mask=ok)

    @triton.jit
    def _combine_kernel(y_ptr, w_ptr, out_ptr, ids_ptr, land_ptr, table_ptr, row, H,
                        E1: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, PUBLISH: tl.constexpr,
                        BLOCK: tl.constexpr):
        """out[t] = sum over k in order of w[t, k] * y[t K + k] (deterministic); with PUBLISH, the first
        program also points the table at what landed (DecodeTable.publish)."""
        token = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            w = tl.load(w_ptr + token * K + k).to(tl.float32)
            acc += w * tl.load(y_ptr + (token * K + k) * H + cols, mask=ok, other=0.0)
        tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
        if PUBLISH:  # each token's first program publishes that token's landings
            if tl.program_id(0) == 0:
                lane = tl.arange(0, KP)
                valid = lane < K
                ids = tl.load(ids_ptr + token * K + lane, mask=valid, other=0).to(tl.int64)
                land = tl.load(land_ptr + token * K + lane, mask=valid, other=-1)
                tl.store(table_ptr + row * E1 + ids, land, mask=valid & (land >= 0))

    @triton.jit
    def _prefetch_claim_kernel(rows_ptr, ids_ptr, table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, slab_ptr, B,
                               E: tl.constexpr, R: tl.constexpr, BP: tl.constexpr):
        """Lookahead candidates (row, expert; -1: none) claim entries and landing slots, in their order."""
        lane = tl.arange(0, BP)
        ok = lane < B
        ids = tl.load(ids_ptr + lane, mask=ok, other=-1).to(tl.int64)
        rows = tl.load(rows_ptr + lane, mask=ok, other=0).to(tl.int64)
        valid = ok & (ids >= 0)
        ids = tl.maximum(ids, 0)
        slots = tl.load(table_ptr + rows * (E + 1) + ids, mask=valid, other=0, volatile=True)
        slab = _claim(table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, rows, ids, valid & (slots == -1),
                      ids + E, E + 1, R, BP)
        tl.store(slab_ptr + lane, slab, mask=ok)

    @triton.jit
    def _prefetch_publish_kernel(rows_ptr, ids_ptr, slab_ptr, table_ptr, B, E: tl.constexpr, BP: tl.constexpr):
        """After the copies (stream order): point the table at the prefetched slabs."""
        lane = tl.arange(0, BP)
        slab = tl.load(slab_ptr + lane, mask=lane < B, other=-1)
        ids = tl.load(ids_ptr + lane, mask=slab >= 0, other=0).to(tl.int64)
        rows = tl.load(rows_ptr + lane, mask=slab >= 0, other=0).to(tl.int64)
        tl.store(table_ptr + rows * (E + 1) + ids, slab, mask=slab >= 0)


def available() -> bool:
    """Whether the table's kernels run (Triton present)."""
    return triton_support.available()


def plan(table, row: int, ids: torch.Tensor, offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, land) for the T x K experts `ids` of T decode tokens (K = table.top_k) of one offloaded
    layer, in one launch; their records where DecodeTable.records(offset) says, token t's at t K on."""
    pairs, k = ids.numel(), table.top_k
    slots = torch.empty(pairs, dtype=torch.long, device=ids.device)
    land = torch.empty(pairs, dtype=torch.long, device=ids.device)
    if pairs % k or (pairs > k and offset is None):
        raise ValueError(f"plan of {pairs} pairs: whole tokens of {k}, and several only into a batched step's records")
    routed, read = table.records(offset)  # views: row r at r * stride
    _plan_kernel[(pairs // k,)](ids, table.slots, table.landing, table.count, table.used, table.owner, routed, read,
                                slots, land, table.cpu_quota, row, E1=table.slots.shape[1], K=k,
                                KP=next_power_of_2(k), R=table.landing_slots, STRIDE=routed.stride(0))
    return slots, land


def combine(y: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype, table=None, row: int = 0,
            ids: torch.Tensor | None = None, land: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H) in `dtype` from the (P, H) pair outputs; with `table`, also its publish step."""
    tokens, k = top_k_weights.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=y.device)
    publish = table is not None
    block = 1024
    launch(_combine_kernel, (cdiv(hidden, block), tokens),
           y, top_k_weights.contiguous(), out, ids if publish else y, land if publish else y,
           table.slots if publish else y, row, hidden, E1=table.slots.shape[1] if publish else 1, K=k,
           KP=next_power_of_2(k), PUBLISH=publish, BLOCK=block)
    return out
