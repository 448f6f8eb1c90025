"""The placement path: prefill, decode outside the lean engine, and the hybrid CPU path, per MoE layer.

    route (done by the model) -> need: which experts the tokens chose  [the one device->host sync]
      -> place: hit / late prefetch (wait on its event) / miss: fetch, or the CPU (MissPolicy)
      -> prefetch: the policy handed in queues the coming layers' experts (prefetch.py); a long prompt
         (streamed prefill) queues the next offloaded layer's missing experts instead
      -> compute: grouped GEMM over the bank rows (+ the CPU's share) -> release the slabs

A pinned layer computes from its bank (quantized blocks as the slabs are). The plan fixes, at
construction, how an offloaded layer's GPU experts compute (from the pool's rows; quantized slabs in place by the expert-major kernels, or
decoded into a bank of one layer where the kernels do not run) and whether the routing's host read
carries the CPU's inputs too (the hybrid mode).

Streamed prefill (`plan.prefill == "streamed"`): a prompt of T tokens with K experts each routes to an
expected 1 - (1 - K/E)^T of a layer's E experts: nearly all of them in a long prompt (236 tokens, 8 of
128: all but 1e-7 of them). So after a layer is placed, the next offloaded layer's experts without a slab
are issued to the copy stream at once, in one batch (Transfers.stream_layer), before that layer's routing is
known: they cross the link while this layer computes and the next one's attention runs, and its placement
then finds them landed or in flight. Why: placed layer by layer, each layer's copies started only after
its routing's host read and ended before its compute, so the link idled through every compute and every
read (0.65 s for a 236-token prompt at 6 GiB of Q4_K slabs, about 11 GB of misses: some 0.2 s of link time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from ..kernels import dequantize
from ..expert_compute import bank_experts, row_chunks
from ..offload_stats import LayerCounters
from ..residency import Residency
from ..table_experts import block_experts
from .filled_prefill import FilledPrefill, experts_from_slabs

# a prompt streams the next layer when its tokens would reach at least this share of a layer's experts
# under independent routing (fewer: the copies of experts nobody routes to would cost link time and slabs)
STREAM_COVERAGE = 0.85
# the streamed copies' prefetch priority: above any policy's (probabilities, at most 1), so the cache's admission
# rule lets them evict a speculative guess; the layer runs next, so they are as good as needed
STREAM_PRIORITY = 2.0


@dataclass
class Placement:
    on_gpu: list[int]   # experts computed from slabs (resident, waited on, or fetched)
    on_cpu: set[int]    # missing experts computed by the CPU backend instead
    slabs: list[int]    # the slab of each on_gpu expert


class PlacementExecutor:
    def __init__(self, res: Residency, owner: Any, boundary: Any, miss: Any):
        """`owner`: what the prefetch policy sees as the runtime (its observe / after_layer hooks)."""
        self.res, self.owner, self.boundary, self.miss = res, owner, boundary, miss
        self.cpu = miss.cpu
        self._compute = (self._from_slabs if res.plan.prefill_kernels else self._from_decoded_bank) \
            if res.quantized_slabs else self._from_pool
        self._cpu_inputs = self._with_cpu_inputs if self.cpu is not None else self._routing_only
        # without slabs the prefetch policy has nothing to fill; the copies' rates feed only `auto`'s cost model
        self._prefetch_after = (self._stream_or_policy if res.plan.prefill == "streamed" else self._policy_after_layer) \
            if res.num_slabs else _no_prefetch
        # each MoE layer's next offloaded layer, where a streamed prompt's copies go next
        later = [layer for layer in res.moe_layers if layer not in res.pinned]
        self._next_offloaded = {layer: next((o for o in later if res.index[o] > res.index[layer]), None)
                                for layer in res.moe_layers}
        self._streamed: dict[int, list] = {}  # layer -> the keys a streamed prompt queued for it
        streams = res.plan.prefill == "streamed" and res.num_slabs
        self._stream_first = self._stream_unstreamed if streams else _no_first_stream
        self._first_offloaded = later[0] if streams and later else None  # what a prompt streams before its forward
        self._begun = False  # the prompt under way was begun by `begin_prompt` (its streams are this pass's)
        self._observe_copies = miss.observed_copies if miss.mode == "auto" else _no_observation
        self._decode_into_bank = self._decode_on_device \
            if res.device.type == "cuda" and dequantize.available(res.store.dtype) else self._decode_on_host
        # filled quantized slabs: the first prompt fills them, then its offloaded layers read the row maps
        self.filled = FilledPrefill(res, res.plan.prefill_kernels) if res.plan.prefill == "filled-slabs" else None
        pinned = self._pinned_blocks if res.pinned_blocks else self._pinned
        self.by_layer: dict[int, Callable] = {layer: pinned for layer in res.pinned}
        self.unfill()

    def unfill(self) -> None:
        """The offloaded layers' path before any fill (and again after a cache reset emptied the slabs)."""
        self._streamed.clear()  # the slabs they were streamed into are gone
        offloaded = self._offloaded if self.filled is None else self._fill_first
        if self.filled is None and self.res.plan.prefill == "streamed" and self.res.quantized_slabs:
            offloaded = self._streamed_or_placed  # a streamed layer computes from its slabs in place, unread
        self.by_layer.update({layer: offloaded for layer in self.res.offloaded})

    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  act: Any, batched: bool = False) -> torch.Tensor:
        """`batched`: a batched decode step's rows (decode, whatever their number)."""
        res = self.res
        phase = "prefill" if hidden.shape[0] > 1 and not batched else "decode"
        self._enter_phase(phase)
        if phase == "prefill" and layer == res.moe_layers[0]:
            if self._streamed and not self._begun:
                with res.lock:  # a new pass over the layers: streams of one that stopped part way are stale
                    self._forget_streams()
            self._begun = False
        counters = res.counters[phase].setdefault(layer, LayerCounters())
        counters.calls += 1
        self.owner.policy.observe(self.owner, layer, top_k_index)
        return self.by_layer[layer](layer, hidden, top_k_index, top_k_weights, act, phase, counters)

    def _enter_phase(self, phase: str) -> None:
        """Leave the decode boundary's upkeep and switch the residency to `phase` (nothing where the phase is
        already `phase` and the boundary left: a prompt's layers after `begin_prompt`, or after its first)."""
        res = self.res
        if phase == res.phase and self.boundary.stale:
            return
        with res.lock:
            self.boundary.leave()
            if phase == "prefill":  # a new prompt: the last decode's routing says nothing about it
                res.last_routed.clear()
            res.switch_phase(phase)

    def begin_prompt(self, tokens: int) -> None:
        """A prefill forward of `tokens` tokens is about to run, before its vision tower and first layers: a long
        prompt's first offloaded layer is streamed now. Why: streamed as that layer (or the pinned layer before
        it) started, its copies waited for the picture's vision tower and the layers before it, while a streamed
        prompt is bound by the link from its first copy to its last (the link's first copy 6.8-8.0 ms into an
        896 px prompt at 16 GiB BF16, H100). What earlier passes streamed and never ran is forgotten first."""
        if self._first_offloaded is None:
            return
        self._enter_phase("prefill")
        with self.res.lock:
            self._forget_streams()
        self._begun = True
        self._stream_unstreamed(self._first_offloaded, "prefill", tokens)

    def _pinned(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                act: Any, phase: str, counters: LayerCounters) -> torch.Tensor:
        self._prefetch_after(layer, hidden)
        return bank_experts(hidden, top_k_index, top_k_weights, self.res.identity, *self.res.banks[layer], act)

    def _pinned_blocks(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, act: Any, phase: str, counters: LayerCounters) -> torch.Tensor:
        """A pinned layer held as quantized blocks: the expert-major kernels (or their twin) on its bank, each
        expert at its own row."""
        self._prefetch_after(layer, hidden)
        res = self.res
        return block_experts(hidden, top_k_index, top_k_weights, act, res.banks[layer][0], None, res.store,
                             layer, res.num_experts, res.plan.prefill_kernels, prompt=hidden.shape[0] > 1)

    def _fill_first(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    act: Any, phase: str, counters: LayerCounters) -> torch.Tensor:
        """The first offloaded layer call with filled slabs: every expert in, then every offloaded layer
        served from the row maps for good (an eager decode too: a slab for every expert, nothing to place)."""
        with self.res.lock:
            self.filled.fill()
        for other in self.res.offloaded:
            self.by_layer[other] = self._from_filled
        return self._from_filled(layer, hidden, top_k_index, top_k_weights, act, phase, counters)

    def _from_filled(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     act: Any, phase: str, counters: LayerCounters) -> torch.Tensor:
        return self.filled.run(layer, hidden, top_k_index, top_k_weights, act)

    def _offloaded(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   act: Any, phase: str, counters: LayerCounters) -> torch.Tensor:
        res = self.res
        self._stream_first(layer, phase, hidden.shape[0])
        # the layer's device->host read: the routing (and, in decode, where the CPU may compute, its inputs)
        host = res.to_host(*self._cpu_inputs(top_k_index, hidden, top_k_weights, phase))
        experts, pairs = torch.unique(host[0], return_counts=True)  # on the host: no further sync
        pairs_of = dict(zip(experts.tolist(), pairs.tolist()))
        try:
            placement = self._place(layer, pairs_of, counters)
            self._prefetch_after(layer, hidden)
            if phase == "decode":  # decode history only: a prompt routes to most experts, replaying it would
                res.last_routed[layer] = list(pairs_of)  # prefetch whole layers for the first decode token
            task = self._submit_cpu(layer, *self._with_host_inputs(host, hidden, top_k_weights), placement.on_cpu,
                                    counters) if placement.on_cpu else None
            out = self._compute_on_gpu(layer, hidden, top_k_index, top_k_weights, act, placement, pairs_of) \
                if placement.on_gpu else None
            if task is not None:
                start = time.perf_counter()
                cpu_out = task.wait().to(hidden.device, non_blocking=True)
                waited = time.perf_counter() - start
                counters.cpu_seconds += waited
                if not placement.on_gpu:  # nothing overlapped the wait: it is the CPU's own time
                    self.miss.observed_cpu(len(placement.on_cpu), sum(pairs_of[e] for e in placement.on_cpu), waited)
                out = cpu_out if out is None else out + cpu_out
        except BaseException:
            self._abandon()
            raise
        self._end_layer(layer, placement.slabs)
        return out

    def _streamed_or_placed(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, act: Any, phase: str, counters: LayerCounters) -> torch.Tensor:
        """Quantized slabs under streamed prefill: a layer whose every expert the stream gave a slab (resident or
        on its way) needs no routing read. Its row map names all of them, the compute stream waits for their
        copies, and the expert-major kernels read whichever experts the tokens chose, so the host queues the
        layer and goes on to the next one while the device works: the prompt's layers overlap their copies
        instead of stopping at each layer's read. Anything else (decode, a short prompt, a layer the stream
        could not cover) is placed after its read. A long prompt's first offloaded layer, which no layer before
        it streamed, is streamed as it starts: its copies are not overlapped, but it is not read either."""
        try:
            slabs = self._begin_streamed(layer, phase, hidden.shape[0], counters)
            if slabs is not None:
                self._prefetch_after(layer, hidden)
                out = experts_from_slabs(self.res, self.res.plan.prefill_kernels, layer, hidden, top_k_index,
                                         top_k_weights, act)
        except BaseException:
            self._abandon()
            raise
        if slabs is None:
            return self._offloaded(layer, hidden, top_k_index, top_k_weights, act, phase, counters)
        self._end_layer(layer, slabs)
        return out

    def _begin_streamed(self, layer: int, phase: str, tokens: int, counters: LayerCounters) -> list[int] | None:
        """Start `layer` on what the stream gave it: each expert's slab (its copies waited for on the device, the
        row map set), or None where the stream did not cover every expert (the layer is to be placed)."""
        res = self.res
        experts = list(range(res.num_experts))
        self._stream_first(layer, phase, tokens)
        with res.lock:
            if phase != "prefill" or layer not in self._streamed or \
                    not all((layer, e) in res.cache.where for e in experts):
                return None
            res.transfers.poll()
            placed = res.cache.begin_layer(layer, experts)
            res.cache.spend_priorities(self._streamed.pop(layer))
            # every expert of the layer counts: its routing is not read, so which it used is not known
            counters.hits += len(placed["hit"])
            counters.late += len(placed["late"])
            slabs = [res.cache.where[(layer, e)] for e in experts]
            res.transfers.wait_for(slabs)
            res.upload_rows(layer, experts, slabs)
            return slabs

    def _end_layer(self, layer: int, slabs: list[int]) -> None:
        """The layer's compute is queued: later copies into its slabs wait for it, and the cache leaves the layer."""
        with self.res.lock:
            self.res.transfers.release(slabs)
            self.res.cache.end_layer(layer)

    def _abandon(self) -> None:
        """A layer call that raised: the cache leaves the layer it was in (else every later layer would be refused
        as starting inside it), later copies into that layer's slabs wait for whatever compute was already queued
        on them, and what a prompt streamed ahead is dropped (`_forget_streams`)."""
        res = self.res
        with res.lock:
            executing, in_use = res.cache.executing, sorted(res.cache.in_use)
            if executing is not None:
                res.cache.end_layer(executing)  # first: a release that raises too (a CUDA error) leaves no layer open
            self._forget_streams()
            res.transfers.release(in_use)

    def _forget_streams(self) -> None:
        """Drop what was streamed for layers that have not run, with its priorities (they would block the next
        prompt's streams in the admission rule) (lock held)."""
        for keys in self._streamed.values():
            self.res.cache.spend_priorities(keys)
        self._streamed.clear()

    @staticmethod
    def _routing_only(top_k_index: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                      phase: str) -> tuple:
        return (top_k_index,)

    @staticmethod
    def _with_cpu_inputs(top_k_index: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                         phase: str) -> tuple:
        """The hybrid mode: a decode step's few rows ride along with its routing (one sync, a few KiB); a prompt's
        do not. A prompt's layer is mostly covered by slabs (streamed, or fetched in one batch), so its CPU share
        is usually empty, and its rows are MiBs (824 x 2048 BF16 at 896 px: 3.4 MB a layer) that the read would
        copy to the host on every offloaded layer for nothing; `_with_host_inputs` reads them where the
        placement did send experts to the CPU."""
        return (top_k_index, hidden, top_k_weights) if phase == "decode" else (top_k_index,)

    def _with_host_inputs(self, host: list[torch.Tensor], hidden: torch.Tensor,
                          top_k_weights: torch.Tensor) -> list[torch.Tensor]:
        """The routing and the CPU share's inputs on the host: read with the routing, or now (a second read)."""
        return host if len(host) == 3 else [host[0], *self.res.to_host(hidden, top_k_weights)]

    def _policy_after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """The coming layers' experts, as the prefetch policy sees them."""
        self.owner.policy.after_layer(self.owner, layer, hidden)

    def _stream_or_policy(self, layer: int, hidden: torch.Tensor) -> None:
        """A long prompt: the next offloaded layer's experts, queued in place of the policy's guesses
        (which, for a prompt, are none: its history is a decode step's). Else the policy's."""
        ahead = self._next_offloaded[layer]
        if self.res.phase != "prefill" or ahead is None or not self._long_prompt(hidden.shape[0]):
            self._policy_after_layer(layer, hidden)
            return
        self._stream(ahead)

    def _stream_unstreamed(self, layer: int, phase: str, tokens: int) -> None:
        """Streamed prefill: a long prompt's first offloaded layer, which no layer before it streamed, is streamed as
        it starts, before its routing is read, so its placement finds its experts in flight as every later layer's.
        Why: placed after the read, its experts were misses, and under `miss_policy: auto` the cost model sent
        some to the CPU, whose wait held the host from streaming the next layer (16 GiB BF16, 896 px, H100: the
        link sat idle 31 ms before layer 2's copies, the default's prompt 836 ms against lru's 810)."""
        if phase == "prefill" and layer not in self._streamed and self._long_prompt(tokens):
            self._stream(layer)

    def _long_prompt(self, tokens: int) -> bool:
        """Whether a prompt of this many tokens is expected to reach most of a layer's experts."""
        res = self.res
        return 1 - (1 - res.top_k / res.num_experts) ** tokens >= STREAM_COVERAGE

    def _stream(self, layer: int) -> None:
        """Every expert of `layer` without a slab to the copy stream now, at the streamed priority."""
        keys = self._streamed[layer] = [(layer, e) for e in range(self.res.num_experts)]
        self.res.transfers.stream_layer(keys, STREAM_PRIORITY)

    def _place(self, layer: int, pairs_of: dict[int, int], counters: LayerCounters) -> Placement:
        """hit / late / miss for each needed expert; misses fetched (waited on) or sent to the CPU."""
        res = self.res
        needed = list(pairs_of)
        with res.lock:
            res.transfers.poll()
            placed = res.cache.begin_layer(layer, needed)
            if layer in self._streamed:  # what a streamed prompt queued for this layer is no longer a guess
                res.cache.spend_priorities(self._streamed.pop(layer))
            if placed["miss"]:
                self._observe_copies(res.transfers.counters)
            on_cpu = self.miss.on_cpu(res.store, layer, placed["miss"], pairs_of, res.device)
            counters.hits += len(placed["hit"])
            counters.late += len(placed["late"])
            counters.misses += len(placed["miss"]) - len(on_cpu)
            counters.cpu += len(on_cpu)
            res.transfers.fetch([(layer, e) for e in placed["miss"] if e not in on_cpu])
            on_gpu = [e for e in needed if e not in on_cpu]
            slabs = [res.cache.where[(layer, e)] for e in on_gpu]
            res.transfers.wait_for(slabs)
            if on_gpu:  # experts computed on the CPU read a slab in use (weight 0): never a slab being copied
                res.upload_rows(layer, on_gpu + sorted(on_cpu), slabs + [slabs[0]] * len(on_cpu))
        return Placement(on_gpu, on_cpu, slabs)

    def _compute_on_gpu(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        act: Any, placement: Placement, pairs_of: dict[int, int]) -> torch.Tensor:
        weights = top_k_weights
        if placement.on_cpu:  # their pairs add nothing here (the CPU returns them)
            cpu_ids = torch.tensor(sorted(placement.on_cpu), device=top_k_index.device)
            weights = top_k_weights.masked_fill(torch.isin(top_k_index, cpu_ids), 0)
        return self._compute(layer, hidden, top_k_index, weights, act, placement, pairs_of)

    def _from_pool(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor,
                   act: Any, placement: Placement, pairs_of: dict[int, int]) -> torch.Tensor:
        pairs_per_slab: dict[int, int] = {}
        for expert, slab in zip(placement.on_gpu, placement.slabs):
            pairs_per_slab[slab] = pairs_per_slab.get(slab, 0) + pairs_of[expert]
        pairs_per_slab[placement.slabs[0]] += sum(pairs_of[e] for e in placement.on_cpu)
        chunks = row_chunks(list(pairs_per_slab.items()))
        res = self.res
        return bank_experts(hidden, top_k_index, weights, res.row_map[res.index[layer]], *res.pool, act, chunks)

    def _from_slabs(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor,
                    act: Any, placement: Placement, pairs_of: dict[int, int]) -> torch.Tensor:
        """Quantized slabs, in place: every routed expert has a slab in the row map `_place` set (the CPU's
        experts the first slab's, at weight 0), which the expert-major kernels read (no bank decoded)."""
        return experts_from_slabs(self.res, True, layer, hidden, top_k_index, weights, act)

    def _from_decoded_bank(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor,
                           act: Any, placement: Placement, pairs_of: dict[int, int]) -> torch.Tensor:
        """Quantized slabs: the layer's experts decoded into a bank at their own indices, computed from there."""
        bank = self._decoded_bank(layer, placement.on_gpu, placement.slabs)
        return bank_experts(hidden, top_k_index, weights, self.res.identity, *bank, act)

    @cached_property
    def _bank_of_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized slabs: a bank of one layer in the model's dtype that a prefill's layer is decoded into
        (made at the first such layer, outside the budget)."""
        return self.res.bank(self.res.num_experts)

    def _decoded_bank(self, layer: int, experts: list[int], slabs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized slabs: `experts` of `layer` decoded from their slabs into the bank of one layer, at
        their own indices (the rest keep stale values that no pair reads)."""
        res, bank = self.res, self._bank_of_layer
        ids = torch.tensor(slabs, dtype=torch.long).to(res.device, non_blocking=True)
        target = torch.tensor(experts, dtype=torch.long).to(res.device, non_blocking=True)
        self._decode_into_bank(layer, ids, target, bank)
        return bank

    def _decode_on_device(self, layer: int, ids: torch.Tensor, target: torch.Tensor,
                          bank: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The dequantize kernel, reading the slabs in place."""
        res, pool, store = self.res, self.res.pool[0], self.res.store
        need = torch.ones(ids.numel(), dtype=torch.int8, device=res.device)
        dequantize.fetch_q8(ids, need, target, bank, pool.data_ptr(), pool.shape[1], res.inter, res.hidden,
                            fmt=store.fmt, down_fmt=store.down_format(layer), staged=True)

    def _decode_on_host(self, layer: int, ids: torch.Tensor, target: torch.Tensor,
                        bank: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The store's torch dequantization (the CPU, or a dtype the kernel does not write)."""
        store = self.res.store
        gate_up, down = store.dequantized(self.res.pool[0][ids, :store.block_bytes_of(layer)], layer)
        bank[0].index_copy_(0, target, gate_up)
        bank[1].index_copy_(0, target, down)

    def _submit_cpu(self, layer: int, ids: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                    on_cpu: set[int], counters: LayerCounters):
        """Hand the activations (already on the host) to the CPU backend; only pairs of `on_cpu`
        experts count there."""
        keep = torch.isin(ids, torch.tensor(sorted(on_cpu)))
        counters.cpu_pairs += int(keep.sum())
        return self.cpu.submit(layer, hidden, ids.masked_fill(~keep, -1), top_k_weights.float())


def _no_prefetch(layer: int, hidden: torch.Tensor) -> None:
    """No slabs: every expert is pinned or read from the host."""


def _no_first_stream(layer: int, phase: str, tokens: int) -> None:
    """Prefill placed layer by layer (or no slabs): nothing is streamed."""


def _no_observation(counters: Any) -> None:
    """A miss policy other than `auto`: no cost model to feed."""
