"""OffloadRuntime: the state all VisExperts operators of one model share.

Owns the pinned prefix (each pinned layer's experts as one GPU bank), the ExpertStore (host blocks
of every other layer), the slab pool and its SlabCache, the Transfers, and the DecodeTable.

Lean decode steps (one token, between the engine's step hooks) go through the table: every layer
reads its experts where they lie (slab or host store) with no host work, so the whole step is one
CUDA graph; the DecodeBoundary keeps the cache between steps (decode_table.py, decode_boundary.py).
With a `lookahead` (the predictor on the device), each table step also prefetches: at every MoE
layer the predictor scores the next layers' experts on a side stream, and the likely ones not
resident are copied into landing slots of their layers while the compute stream runs on (the
side stream joins it before the step ends: still one graph).
Everything else (prefill, decode outside the lean engine, the hybrid CPU path) takes the placement
path, per MoE layer:

    route (done by the model) -> need: which experts the tokens chose  [the one device->host sync]
      -> place: hit / late prefetch (wait on its event) / miss: fetch, or the CPU (MissPolicy)
      -> prefetch: the policy handed in queues the coming layers' experts (prefetch.py)
      -> compute: grouped GEMM over the bank rows (+ the CPU's share) -> release the slabs

Settings: offload_settings.py; counters and the summary: offload_stats.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from .budget import BudgetError, human_bytes, resolve_budget, resolve_pinned_layers
from .engine_queries import EngineQueries
from .expert_compute import bank_experts, row_chunks
from .host_memory import empty_host_cache
from .miss_policy import MissPolicy
from .offload_settings import OffloadSettings
from .offload_stats import PHASES, LayerCounters, layer_stats, summary
from .prefetch import HistoryPrefetch, PrefetchPolicy
from .decode_boundary import DecodeBoundary
from .cpu.threads import leave_cores_to_workers
from .decode_table import CPU_PAIR, DecodeTable
from .slab_cache import CacheCounters, Key, SlabCache
from .store import ExpertStore, block_views, raw_down_format
from . import decode_kernel, expert_major, quantized_major
from .table_experts import (combine, fetch_dequantized, kernel_usable, pair_outputs, quantized_batch_outputs,
                            quantized_slab_outputs)
from .transfers import TransferCounters, Transfers


ROUTER_KEEP = 0.8  # weight of the past in the router-probability average, per decode token (eviction_study.py)


@dataclass
class Placement:
    on_gpu: list[int]   # experts computed from slabs (resident, waited on, or fetched)
    on_cpu: set[int]    # missing experts computed by the CPU backend instead
    slabs: list[int]    # the slab of each on_gpu expert


# a batched step on quantized slabs goes expert-major from this many tokens: on the H200 (Q4_K,
# `decode_kernel_bench --batch --quantized`, 2026-12-01, tiles swept) the expert-major kernels took
# 91 us a layer at 2 tokens against 112 for token-by-token GEMVs, 233 vs 442 at 8, 393 vs 883 at 16
QUANTIZED_MAJOR_MIN_TOKENS = 2
BATCH_EXPERTS = ("auto", "table", "grouped-gemm", "expert-major")  # a batched step's resident experts


class OffloadRuntime(EngineQueries):
    def __init__(self, settings: OffloadSettings, moe_layers: list[int], num_experts: int, hidden: int,
                 inter: int, dtype: torch.dtype, device: torch.device | str, top_k: int = 8,
                 prefetch: PrefetchPolicy | None = None, lookahead: Any = None, cpu_threads: int | None = None,
                 model_dir: Any = None, sources: Any = (), down_formats: dict[int, str] | None = None):
        self.settings, self.moe_layers = settings, list(moe_layers)
        self.requested_settings = settings  # the rules' own (an operator that resolved `auto` keeps them here)
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.device = torch.device(device)
        # `auto` is resolved by the operator, which sees the checkpoint (a GGUF's format); here: the model's dtype
        fmt = "model" if settings.store_dtype == "auto" else settings.store_dtype
        self.store = ExpertStore(num_experts, hidden, inter, dtype, pin_memory=torch.cuda.is_available(), fmt=fmt)
        self.layer_bytes = num_experts * self.store.slab_bytes  # GPU bytes of a pinned layer (in `dtype`)
        if isinstance(settings.expert_budget, str):  # a share of the routed experts ("30%"): now their bytes are known
            settings = replace(settings, expert_budget=resolve_budget(settings.expert_budget,
                                                                      len(self.moe_layers) * self.layer_bytes))
            self.settings = settings
        # quantized slabs keep the store's blocks as they are (the decode GEMVs decode them as they read)
        self.quantized_slabs = self._wants_quantized_slabs(settings, lookahead)
        # a quantized slab holds the largest block among the layers (down parts in their files' formats, where given)
        self.slab_bytes = max([self.store.block_bytes] + [self.store.block_bytes_with(fmt) for fmt in
                                                          (down_formats or {}).values()]) \
            if self.quantized_slabs else self.store.slab_bytes
        c_safe = settings.min_cache_bytes if settings.min_cache_bytes is not None else num_experts * self.slab_bytes
        # Eq. 10's range, then (auto) the depth with the least predicted time per decode token, and why
        # (a quantized store's misses read its blocks, fewer bytes than the slabs the budget holds)
        read_bytes = self.store.block_bytes if self.store.quantized else 0
        unpriced = (f"a pinned layer's {human_bytes(self.layer_bytes)} in {dtype} would hold "
                    f"{self.layer_bytes // self.slab_bytes} quantized slabs") if self.quantized_slabs else None
        self.depth_choice = resolve_pinned_layers(settings.expert_budget, self.layer_bytes, c_safe,
                                                  settings.min_pinned_layers, len(self.moe_layers),
                                                  settings.pinned_layers, read_bytes=read_bytes, unpriced=unpriced)
        n_pinned = self.depth_choice.depth
        self.pinned = set(self.moe_layers[:n_pinned])
        offloaded = len(self.moe_layers) - n_pinned
        slab_budget = settings.expert_budget - n_pinned * self.layer_bytes
        # (a quantized store adds K + 1 slabs and K blocks of staging beyond the budget: decode's scratch; quantized
        # slabs add a layer of experts in `dtype` that a prefill computes from)
        self.num_slabs = min(slab_budget // self.slab_bytes, offloaded * num_experts)
        if offloaded and self.num_slabs < num_experts:
            raise BudgetError(
                f"expert budget {human_bytes(settings.expert_budget)} leaves {self.num_slabs} slabs after "
                f"{n_pinned} pinned layer(s); at least one layer's {num_experts} experts must fit "
                f"(minimum {human_bytes(n_pinned * self.layer_bytes + self.layer_bytes)})")
        self.lock = threading.RLock()
        self.cache = SlabCache(self.num_slabs, [l for l in self.moe_layers if l not in self.pinned], settings.policy)
        self.banks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # pinned layer -> (gate_up, down)
        self.pool: tuple[torch.Tensor, torch.Tensor] | None = None      # slabs: gate_up (S, 2I, H), down (S, H, I)
        self.transfers: Transfers | None = None
        self.row_map: torch.Tensor | None = None   # (num MoE layers, E) bank row per expert, on the device
        self._row_host: list[list[int]] = []
        self._identity: torch.Tensor | None = None
        self.last_routed: dict[int, list[int]] = {}
        self.counters: dict[str, dict[int, LayerCounters]] = {phase: {} for phase in PHASES}
        # cache and copy counters per phase: the live objects are swapped when the phase changes
        self.cache_counters = {phase: CacheCounters() for phase in PHASES}
        self.copy_counters = {phase: TransferCounters() for phase in PHASES}
        self.phase = "prefill"
        self.loaded: set[int] = set()
        self.top_k = top_k
        if self.store.quantized and lookahead is not None:
            raise BudgetError(f"store_dtype {settings.store_dtype} does not work with the lookahead predictor yet (its "
                              "prefetch copies move the model's dtype); use store_dtype: model, or no predictor")
        if self.store.quantized and settings.miss_policy != "wait" and settings.cpu_backend == "torch":
            raise BudgetError(f"store_dtype {settings.store_dtype} with the hybrid mode needs cpu_backend: kt-kernel "
                              "(the torch backend computes on the store's blocks in place, which are quantized bytes)")
        self.miss = MissPolicy(settings, num_experts, hidden, inter, top_k, len(self.moe_layers) - n_pinned,
                               num_experts * self.store.block_bytes, cpu_threads, model_dir, sources)
        self.cpu = self.miss.cpu
        if self.store.quantized and getattr(self.cpu, "name", None) == "torch":  # `auto` fell back to torch
            raise BudgetError(f"store_dtype {settings.store_dtype} with the hybrid mode needs kt-kernel, and "
                              "cpu_backend auto chose torch here (kt-kernel missing, or the CPU or sizes unsuited)")
        if getattr(self.cpu, "streams", False) and self.device.type == "cuda":
            leave_cores_to_workers()  # kt-kernel's pinned workers get the cores torch would otherwise spin on
        self.policy = prefetch or HistoryPrefetch(settings.prefetch_window, settings.prefetch_gamma)
        self.visual_summary: torch.Tensor | None = None  # h_v, set by the text model's forward at each image prefill
        self.host_reads = 0  # device->host synchronisations, one per offloaded layer call
        self.table: DecodeTable | None = None
        self.boundary = DecodeBoundary(self)
        self.table_armed = False   # set by the boundary around a lean decode step
        self.batch_step = False    # set around a batched decode step (several sequences' tokens, one each)
        # a batched step's pinned layers (BATCH_EXPERTS): auto takes the table kernel (each pair reads its
        # expert) up to batch_table_pairs pairs, and beyond, the expert-major tensor-core kernels (each
        # routed expert read once, runtime/expert_major.py) where they run, else grouped GEMM. H200, one
        # layer's experts, random distinct experts per token (`decode_kernel_bench --batch`), us per layer
        # table / grouped / expert-major: 2 tokens 60.6 / 118.1 / 92.6, 4: 106.5 / 169.1 / 123.4,
        # 8: 192.2 / 246.0 / 175.9, 16: 355.6 / 342.3 / 243.6
        self.batch_experts = "auto"
        self.batch_table_pairs = 32
        self.table_enabled = False  # `enable_table`: this runtime's decode may use the table
        self._use_kernel = False
        # the predictor inside table steps: candidates(row, hidden, routed) -> (rows, experts) device
        # tensors, end_step(routed) and start_decode(visual), device work only (predictor/device_lookahead.py)
        self.lookahead = lookahead
        self.host_addresses: torch.Tensor | None = None  # (rows,) each offloaded layer's mapped store, for prefetch copies
        self._host_blocks: list[torch.Tensor | None] = []  # per row: its store blocks (None: pinned), the twin's source
        self._side: Any = None  # the lookahead's stream (CUDA)
        self._cpu_stream: Any = None  # the hybrid's CPU calls in table decode (CUDA)
        self._bank_of_layer: tuple[torch.Tensor, torch.Tensor] | None = None  # quantized slabs: a prefill's layer
        self._batch_staging: torch.Tensor | None = None  # quantized slabs: a batched step's misses without a landing slab

    # --- start-up ------------------------------------------------------------------------------
    def _wants_quantized_slabs(self, settings: OffloadSettings, lookahead: Any) -> bool:
        """slab_format: quantized is checked (an error says what it lacks); auto is quantized wherever
        it works, since fewer bytes per slab hold more experts and copy fewer bytes per miss."""
        if settings.slab_format == "quantized":
            self._check_quantized_slabs(settings, lookahead)
            return True
        return (settings.slab_format == "auto" and self.store.quantized and settings.miss_policy == "wait"
                and lookahead is None and self.hidden % 256 == 0 and self.inter % 256 == 0)

    def _check_quantized_slabs(self, settings: OffloadSettings, lookahead: Any) -> None:
        if not self.store.quantized:
            raise BudgetError("slab_format quantized keeps the store's blocks in the slabs: it needs a quantized store "
                              f"(store_dtype q8_0, q4_0, q4_k or q5_k), not store_dtype {settings.store_dtype}")
        if self.hidden % 256 or self.inter % 256:
            raise BudgetError(f"slab_format quantized decodes whole 256-weight tiles: hidden {self.hidden} and expert "
                              f"intermediate {self.inter} must be multiples of 256")
        if lookahead is not None:
            raise BudgetError("slab_format quantized does not work with the lookahead predictor yet")


    def _allocate(self) -> None:
        """Slabs and maps, once, before the first layer loads (no allocation afterwards)."""
        if self.pool is not None:
            return
        # one row past the slabs: a scratch slab the decode twin's masked landing writes go to; a quantized store
        # adds K rows (a decode miss without a landing slab is dequantized there) and a dump row
        extra = 1 + (self.top_k + 1 if self.store.quantized else 0)
        rows = self.num_slabs + extra if self.num_slabs else extra
        if self.quantized_slabs:  # one tensor of blocks: gate and up rows, then down rows, in the store's format
            self.pool = (torch.zeros(rows, self.slab_bytes, dtype=torch.uint8, device=self.device),)
        else:
            self.pool = self._bank(rows)
        self.transfers = Transfers(self.store, self.pool, self.cache, self.lock, self.settings.max_in_flight)
        # with lookahead, prefetches land in the same per-layer slots as misses: room for both
        slots = 2 * self.top_k if self.lookahead is not None else self.top_k
        self.table = DecodeTable(len(self.moe_layers), self.num_experts, self.top_k, self.device, slots)
        self.switch_phase(self.phase)
        self.row_map = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.long, device=self.device)
        self._row_host = [[0] * self.num_experts for _ in self.moe_layers]
        self._identity = torch.arange(self.num_experts, device=self.device)
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}

    def _bank(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (rows, 2I, H) and (rows, H, I): the layout grouped GEMM reads without copying."""
        kw = dict(dtype=self.store.dtype, device=self.device)
        return (torch.zeros(rows, 2 * self.inter, self.hidden, **kw), torch.zeros(rows, self.hidden, self.inter, **kw))

    def raw_down_format(self, layer: int, gate_type: int, up_type: int, down_type: int) -> str | None:
        """The down part's format if `load_layer_raw` can take `layer` as a file stores it (offloaded, gate
        and up in the store's format, down in it or in another block format whose rows fit, e.g. a
        Q4_K_M file's Q6_K; no CPU backend wanting the model's dtype); None: dequantize and requantize."""
        if layer in self.pinned or not self.store.quantized or self.cpu is not None:
            return None
        return raw_down_format(self.store.fmt, self.inter, gate_type, up_type, down_type)

    def load_layer_raw(self, layer: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       down_format: str | None = None) -> None:
        """An offloaded layer from block bytes as a GGUF stores them ((E, I, H), (E, I, H), (E, H, I)):
        into the store of the same format as they are (down in `down_format`, where it differs), with
        no dequantizing and requantizing."""
        self._allocate()
        block_bytes = self.store.block_bytes_with(down_format or self.store.fmt) if self.quantized_slabs else 0
        if block_bytes > self.slab_bytes:
            raise BudgetError(f"slab_format quantized sized its slabs for {self.slab_bytes} bytes, but layer {layer}'s "
                              f"experts with {down_format} down experts take {block_bytes} (the file's header did not "
                              "say so): use slab_format dequantized")
        self.store.fill_layer_raw(layer, gate, up, down, down_format)
        self.loaded.add(layer)

    def takes_stored(self, layer: int) -> bool:
        """Whether `load_layer` would give the CPU backend a GGUF's experts as stored for `layer`."""
        return (layer not in self.pinned and self.settings.cpu_dtype == "auto"
                and getattr(self.cpu, "takes_stored", lambda: False)())

    def load_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor, stored: tuple | None = None) -> None:
        """Take one layer's experts (E, 2I, H) and (E, H, I): to a GPU bank if pinned, else to the store
        (and to the hybrid's CPU backend: `stored`, a GGUF's quantized experts as stored, where given)."""
        if layer not in self.moe_layers:
            raise ValueError(f"layer {layer} is not an MoE layer of this model ({self.moe_layers})")
        self._allocate()
        if layer in self.pinned:
            bank = self._bank(self.num_experts)
            bank[0].copy_(gate_up)
            bank[1].copy_(down)
            self.banks[layer] = bank
        else:
            self.store.fill_layer(layer, gate_up, down)
            if self.cpu is not None and stored is not None and self.takes_stored(layer):
                self.cpu.add_layer_stored(layer, *stored)
            elif self.cpu is not None and self.store.quantized:  # kt-kernel takes the model's dtype, on the host
                self.cpu.add_layer(layer, gate_up.cpu(), down.cpu())
            elif self.cpu is not None:
                self.cpu.add_layer(layer, *block_views(self.store.layers[layer], self.inter, self.hidden))
        self.loaded.add(layer)

    # --- per layer ------------------------------------------------------------------------------
    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        if self.batch_step and layer in self.pinned:  # device work only: a batched step's graph holds it
            return self._batch_bank_experts(layer, hidden, top_k_index, top_k_weights, act)
        if self.table_armed and self.batch_step and self._quantized_major(top_k_index):
            return self._run_batch_quantized(layer, hidden, top_k_index, top_k_weights, act)
        if self.table_armed and self.batch_step:  # a batched step through the table: token by token, so a
            k = top_k_index.shape[1]              # miss one token lands is a hit for the next
            return torch.cat([self._run_from_table(layer, hidden[t:t + 1], top_k_index[t:t + 1], top_k_weights[t:t + 1],
                                                   act, offset=t * k) for t in range(hidden.shape[0])])
        if self.table_armed and top_k_index.numel() == self.top_k:  # a lean decode step: no host work
            return self._run_from_table(layer, hidden, top_k_index, top_k_weights, act)
        phase = "prefill" if hidden.shape[0] > 1 and not self.batch_step else "decode"
        if phase != self.phase or not self.boundary.stale:
            with self.lock:
                self.boundary.leave()
                if phase == "prefill":  # a new prompt: the last decode's routing says nothing about it
                    self.last_routed.clear()
                self.switch_phase(phase)
        counters = self.counters[phase].setdefault(layer, LayerCounters())
        counters.calls += 1
        self.policy.observe(self, layer, top_k_index)
        if layer in self.pinned:
            self._prefetch_after(layer, hidden)
            return bank_experts(hidden, top_k_index, top_k_weights, self._identity, *self.banks[layer], act)
        # the layer's one device->host read: the routing (and, when the CPU may compute, its inputs)
        host = self._to_host(top_k_index, *((hidden, top_k_weights) if self.cpu is not None else ()))
        experts, pairs = torch.unique(host[0], return_counts=True)  # on the host: no further sync
        pairs_of = dict(zip(experts.tolist(), pairs.tolist()))
        placement = self._place(layer, pairs_of, counters)
        self._prefetch_after(layer, hidden)
        if phase == "decode":  # decode history only: a prompt routes to most experts, replaying it would
            self.last_routed[layer] = list(pairs_of)  # prefetch whole layers for the first decode token
        task = self._submit_cpu(layer, *host, placement.on_cpu, counters) if placement.on_cpu else None
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
        with self.lock:
            self.transfers.release(placement.slabs)
            self.cache.end_layer(layer)
        return out

    def _run_from_table(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, act: Any, offset: int | None = None) -> torch.Tensor:
        """One decode token's experts, each read from its slab or the host store (device work only).
        On CUDA three launches besides the two expert kernels' (plan, and combine with publish).
        `offset`: a batched step's token, whose records go to the table's batch columns from there."""
        row, ids, top_k, kernel = self._index[layer], top_k_index.reshape(-1), top_k_index.shape[1], self._use_kernel
        table = self.table
        if layer in self.pinned:  # the bank holds every expert at its own index: nothing to look up
            if self.lookahead is not None:
                table.routed[row].copy_(ids)  # the predictor's routing history
                self._look_ahead(row, hidden)
            y = pair_outputs(hidden, ids, ids, table.no_landing, self.banks[layer], None, act, top_k, kernel)
            return combine(y, top_k_weights, hidden.dtype, kernel)
        slots, land = table.lookup(row, ids, kernel, offset)
        if self.lookahead is not None:  # started before this layer's experts: they compute meanwhile
            self._look_ahead(row, hidden)
        on_cpu = self._cpu_begin(layer, hidden, ids, slots, top_k_weights) if self.graph_variant() else None
        if self.quantized_slabs:  # misses copied as they are into their landing (or scratch) slabs, then decoded
            y = quantized_slab_outputs(hidden, ids, slots, land, self.pool[0], self.store.layers[layer], self.store,
                                       layer, self.num_slabs + 1, act, top_k, kernel)
        elif self.store.quantized:  # misses dequantized into their landing (or scratch) slabs first
            read = fetch_dequantized(ids, slots, land, self.pool, self.store.layers[layer], self.store,
                                     self.num_slabs + 1, kernel, layer)
            y = pair_outputs(hidden, ids, read, table.no_landing, self.pool, None, act, top_k, kernel)
        else:
            y = pair_outputs(hidden, ids, slots, land, self.pool, self.store.layers[layer], act, top_k, kernel)
        if kernel:  # combines and publishes in one launch
            out = decode_kernel.combine(y, top_k_weights, hidden.dtype, table, row, ids, land)
        else:
            table.publish(row, ids, land)
            out = combine(y, top_k_weights, hidden.dtype)
        return out if on_cpu is None else out + on_cpu()

    def _quantized_major(self, top_k_index: torch.Tensor) -> bool:
        """Whether a batched step's offloaded layer runs all its tokens at once on quantized slabs, each
        routed expert decoded once per block of its tokens (`batch_experts` expert-major); else token by
        token, one GEMV per pair. auto: expert-major from QUANTIZED_MAJOR_MIN_TOKENS tokens."""
        if not self.quantized_slabs or self._batch_staging is None or top_k_index.shape[0] < 2:
            return False
        if self.batch_experts == "auto":
            return top_k_index.shape[0] >= QUANTIZED_MAJOR_MIN_TOKENS
        return self.batch_experts == "expert-major"

    def _run_batch_quantized(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        """A batched step's offloaded layer on quantized slabs: one lookup for its T x K pairs (their
        records at the batch columns from 0), then every pair at once (table_experts.quantized_batch_outputs);
        the combine publishes what landed. Device work only."""
        row, kernel = self._index[layer], self._use_kernel and quantized_major.available(self.store.dtype)
        ids = top_k_index.reshape(-1)
        slots, land = self.table.lookup(row, ids, self._use_kernel, offset=0)
        y = quantized_batch_outputs(hidden, top_k_index, slots, land, self.pool[0], self._batch_staging,
                                    self.store.layers[layer], self.store, layer, self.num_experts, act, kernel)
        if self._use_kernel:  # combines and publishes each token's landings in one launch
            return decode_kernel.combine(y, top_k_weights, hidden.dtype, self.table, row, ids, land)
        self.table.publish(row, ids, land)
        return combine(y, top_k_weights, hidden.dtype)

    def _cpu_begin(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                   top_k_weights: torch.Tensor):
        """Hybrid decode from the table: start the CPU on this layer's CPU pairs (slot CPU_PAIR, the
        cost model's share of the misses; ids of the others -1, which the backend skips) and return
        what waits for its output. On CUDA both halves (kt-kernel's host functions and the small
        copies around them) go on a stream of their own, forked after the plan and joined before the
        sum, so the GPU's pairs compute meanwhile, the compute stream never stalls on a host
        function, and the step stays one graph; on the CPU the backend runs there and then."""
        cpu_ids = torch.where(slots == CPU_PAIR, ids, -1).view(1, -1)
        if self.device.type == "cuda":  # on a stream of its own: the GPU's pairs never wait on a host function
            compute = torch.cuda.current_stream(self.device)
            if self._cpu_stream is None:
                self._cpu_stream = torch.cuda.Stream(self.device)
            side = self._cpu_stream
            side.wait_stream(compute)
            for t in (hidden, cpu_ids, top_k_weights):
                t.record_stream(side)  # the compute stream may free them while the side stream reads
            with torch.cuda.stream(side):
                self.cpu.begin_on_stream(layer, hidden, cpu_ids, top_k_weights)
                out = self.cpu.end_on_stream(self.device, hidden.dtype)

            def joined() -> torch.Tensor:
                compute.wait_stream(side)
                out.record_stream(compute)
                return out
            return joined
        out = self.cpu.submit(layer, hidden, cpu_ids, top_k_weights.float()).wait().to(hidden.dtype)
        return lambda: out

    def _look_ahead(self, row: int, hidden: torch.Tensor) -> None:
        """Score the next layers' experts and prefetch the likely ones, on the side stream; at the
        last layer, join it (a captured step must end on one stream) and close the step's features."""
        lookahead, table = self.lookahead, self.table
        cuda = self.device.type == "cuda"
        if row == len(self.moe_layers) - 1:
            if cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._side)
            lookahead.end_step(table.routed)
            return
        if not lookahead.predicts_at(row):  # `prefetch_stride`: the last run's window covers this row
            return
        if not cuda:
            rows, experts = lookahead.candidates(row, hidden, table.routed)
            table.prefetch(rows, experts, self.pool, self._host_blocks, False)
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        hidden.record_stream(self._side)  # the compute stream may free it while the side stream reads
        with torch.cuda.stream(self._side):
            rows, experts = lookahead.candidates(row, hidden, table.routed)
            table.prefetch(rows, experts, self.pool, self._host_blocks, True, self.host_addresses)

    def observe_router(self, moe_index: int, probabilities: torch.Tensor) -> None:
        """A decode token's router probabilities over every expert of MoE layer `moe_index` (1, E),
        from inside the step (device work only): the VisMMOE cache ranks eviction victims by their
        average (decode_boundary.py), what the router favours beyond its top-k."""
        self.table.observe_router(moe_index, probabilities, ROUTER_KEEP)

    def router_sink(self) -> Any:
        """`observe_router` where the eviction uses it (table decode with slabs to evict from, the
        VisMMOE policy), else None: an all-resident step computes no extra softmax."""
        used = self.table_enabled and self.num_slabs > 0 and self.settings.policy == "vismmoe"
        return self.observe_router if used else None

    def prepare_lookahead(self) -> None:
        """As decode starts (outside any capture): the side stream, each row's mapped store address,
        and the predictor's per-request features reset."""
        if self.lookahead is None:
            return
        if self.device.type == "cuda" and self._side is None:
            self._side = torch.cuda.Stream(self.device)
        if self.host_addresses is None:  # every layer is loaded by now; the store never moves
            self._host_blocks = [self.store.layers.get(layer) for layer in self.moe_layers]
            addresses = [blocks.data_ptr() if blocks is not None else 0 for blocks in self._host_blocks]
            self.host_addresses = torch.tensor(addresses, dtype=torch.long, device=self.device)
        self.lookahead.start_decode(self.visual_summary)

    def _place(self, layer: int, pairs_of: dict[int, int], counters: LayerCounters) -> "Placement":
        """hit / late / miss for each needed expert; misses fetched (waited on) or sent to the CPU."""
        needed = list(pairs_of)
        with self.lock:
            self.transfers.poll()
            placed = self.cache.begin_layer(layer, needed)
            if placed["miss"] and self.miss.mode == "auto":
                self.miss.observed_copies(self.transfers.counters)
            on_cpu = self.miss.on_cpu(self.store, layer, placed["miss"], pairs_of, self.device)
            counters.hits += len(placed["hit"])
            counters.late += len(placed["late"])
            counters.misses += len(placed["miss"]) - len(on_cpu)
            counters.cpu += len(on_cpu)
            self.transfers.fetch([(layer, e) for e in placed["miss"] if e not in on_cpu])
            on_gpu = [e for e in needed if e not in on_cpu]
            slabs = [self.cache.where[(layer, e)] for e in on_gpu]
            self.transfers.wait_for(slabs)
            if on_gpu:  # experts computed on the CPU read a slab in use (weight 0): never a slab being copied
                self._upload_rows(layer, on_gpu + sorted(on_cpu), slabs + [slabs[0]] * len(on_cpu))
        return Placement(on_gpu, on_cpu, slabs)

    def _compute_on_gpu(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        act: Any, placement: "Placement", pairs_of: dict[int, int]) -> torch.Tensor:
        weights = top_k_weights
        if placement.on_cpu:  # their pairs add nothing here (the CPU returns them)
            cpu_ids = torch.tensor(sorted(placement.on_cpu), device=top_k_index.device)
            weights = top_k_weights.masked_fill(torch.isin(top_k_index, cpu_ids), 0)
        pairs_per_slab: dict[int, int] = {}
        for expert, slab in zip(placement.on_gpu, placement.slabs):
            pairs_per_slab[slab] = pairs_per_slab.get(slab, 0) + pairs_of[expert]
        pairs_per_slab[placement.slabs[0]] += sum(pairs_of[e] for e in placement.on_cpu)
        if self.quantized_slabs:  # the layer's experts decoded into a bank at their own indices, computed from there
            bank = self._decoded_bank(layer, placement.on_gpu, placement.slabs)
            return bank_experts(hidden, top_k_index, weights, self._identity, *bank, act)
        chunks = row_chunks(list(pairs_per_slab.items()))
        return bank_experts(hidden, top_k_index, weights, self.row_map[self._index[layer]], *self.pool, act, chunks)

    def _decoded_bank(self, layer: int, experts: list[int], slabs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized slabs: `experts` of `layer` decoded from their slabs into a bank of one layer in the
        model's dtype (made once, outside the budget), at their own indices (the rest keep stale values
        that no pair reads)."""
        if self._bank_of_layer is None:
            self._bank_of_layer = self._bank(self.num_experts)
        bank, pool = self._bank_of_layer, self.pool[0]
        ids = torch.tensor(slabs, dtype=torch.long).to(self.device, non_blocking=True)
        target = torch.tensor(experts, dtype=torch.long).to(self.device, non_blocking=True)
        if self.device.type == "cuda" and decode_kernel.available(self.store.dtype):
            need = torch.ones(len(slabs), dtype=torch.int8, device=self.device)
            decode_kernel.fetch_q8(ids, need, target, bank, pool.data_ptr(), pool.shape[1], self.inter, self.hidden,
                                   fmt=self.store.fmt, down_fmt=self.store.down_format(layer), staged=True)
        else:
            gate_up, down = self.store.dequantized(pool[ids, :self.store.block_bytes_of(layer)], layer)
            bank[0].index_copy_(0, target, gate_up)
            bank[1].index_copy_(0, target, down)
        return bank

    def _to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Device->host copies issued together and waited for once (counted in `host_reads`)."""
        self.host_reads += 1
        if self.device.type != "cuda":
            return list(tensors)
        copies = [t.to("cpu", non_blocking=True) for t in tensors]  # page-locked destinations
        torch.cuda.current_stream(self.device).synchronize()
        return copies

    def _submit_cpu(self, layer: int, ids: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                    on_cpu: set[int], counters: LayerCounters):
        """Hand the activations (already on the host) to the CPU backend; only pairs of `on_cpu`
        experts count there."""
        keep = torch.isin(ids, torch.tensor(sorted(on_cpu)))
        counters.cpu_pairs += int(keep.sum())
        return self.cpu.submit(layer, hidden, ids.masked_fill(~keep, -1), top_k_weights.float())

    def enable_table(self, act: Any) -> bool:
        """Let lean decode read experts through the table, where it can: the hybrid CPU path only where
        its calls can run inside the step (below), not a prefetch policy with per-layer host logic unless a device
        lookahead stands in for it in decode, and on CUDA only where the Triton kernels serve the dtype
        and activation. True: the caller registers `boundary.before_step` / `after_step` as the
        engine's step hooks."""
        on_cuda = self.device.type == "cuda"
        self._use_kernel = on_cuda and kernel_usable(self.device, self.store.dtype, act)
        capturable = self.policy.capturable or self.lookahead is not None
        # the hybrid CPU path joins a table step where its calls need no host wait: kt-kernel's in-stream
        # calls on CUDA, any backend on the CPU (misses split by the cost model: DecodeTable.cpu_quota)
        cpu_ok = self.cpu is None or not on_cuda or getattr(self.cpu, "streams", False)
        self.table_enabled = capturable and cpu_ok and (self._use_kernel or not on_cuda)
        return self.table_enabled

    def before_step(self) -> None:
        if self.table_enabled:
            self.boundary.before_step()

    def after_step(self) -> None:
        if self.table_enabled:
            self.boundary.after_step()

    def graph_variant(self) -> bool:
        """What a captured decode step depends on beyond its tensors (read after `before_step`):
        whether the hybrid mode's CPU calls are in it. A layer's CPU call costs two host functions and
        four small copies even when it has no CPU pairs, so while the cost model sends no miss to the
        CPU the step is one captured without them."""
        return self.table_enabled and self.cpu is not None and self.table.cpu_active

    def decode_capturable(self, layer: int) -> bool:
        """Whether this layer's decode forward is device work only (a CUDA graph can hold it): every
        layer once the table serves decode; without it, a pinned layer of a model with nothing
        offloaded (with slabs, the placement path hands prefetch lists to the transfer worker)."""
        if self.table_enabled:
            return True
        # grouped GEMM on CUDA is capture-safe in BF16 only (its other fallback reads offsets on the host)
        grouped_ok = self.device.type != "cuda" or self.store.dtype == torch.bfloat16
        return (layer in self.pinned and self.num_slabs == 0 and self.policy.capturable and self.cpu is None
                and grouped_ok)

    def _batch_bank_experts(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        """A pinned layer's experts for a batched step's rows, by `batch_experts`: the table kernel or
        the expert-major kernels where Triton serves the layer (the expert-major twin on the CPU when
        asked for), grouped GEMM otherwise."""
        mode = self.batch_experts
        if mode == "auto":
            mode = "grouped-gemm" if not self._use_kernel else "table" \
                if top_k_index.numel() <= self.batch_table_pairs else "expert-major"
        if mode == "expert-major":
            gate_up, down = self.banks[layer]
            if self._use_kernel and expert_major.available(gate_up.dtype):
                y = expert_major.experts_expert_major(hidden, top_k_index, gate_up, down)
            else:  # its torch twin (CPU, or weights the kernels do not take): same blocks, eagerly
                y = expert_major.experts_by_block(hidden, top_k_index.shape[1],
                                                  *expert_major.expert_blocks(top_k_index.reshape(-1), gate_up.shape[0]),
                                                  gate_up, down, act)
            return combine(y, top_k_weights, hidden.dtype, self._use_kernel)
        if mode == "table" and not self._use_kernel:
            mode = "grouped-gemm"  # the table's kernels need the GPU
        if mode == "table":
            ids = top_k_index.reshape(-1)
            y = pair_outputs(hidden, ids, ids, torch.full_like(ids, -1), self.banks[layer], None, act,
                             top_k_index.shape[1], True)
            return combine(y, top_k_weights, hidden.dtype, True)
        return bank_experts(hidden, top_k_index, top_k_weights, self._identity, *self.banks[layer], act)

    @property
    def batch_table(self) -> bool:
        """Whether a batched step's offloaded layers go through the decode table (token by token, device
        work only, with the table's step hooks around the step), not the placement path: a table the
        lean decode uses, without the hybrid's CPU calls or a lookahead predictor (both per token)."""
        return self.table_enabled and self.cpu is None and self.lookahead is None

    def prepare_batch(self, max_rows: int) -> None:
        """Batched steps of up to `max_rows` tokens will run: the table's record buffers for them, made
        before any step is captured (captured steps write into them)."""
        if self.batch_table and self.table is not None:
            self.table.enable_batch(max_rows)
            if self.quantized_slabs and (self._batch_staging is None or self._batch_staging.shape[0] < max_rows * self.top_k):
                # a staging row per pair for misses that claim no landing slab (outside the expert budget)
                self._batch_staging = torch.zeros(max_rows * self.top_k, self.slab_bytes, dtype=torch.uint8,
                                                  device=self.device)

    def begin_batch_step(self, rows: int = 0) -> None:
        """A batched step of `rows` tokens starts (before the table's own step hook)."""
        self.batch_step = True
        if self.batch_table and self.table is not None:
            if self.table.batch_routed is None or rows * self.top_k > self.table.batch_routed.shape[1]:
                raise ValueError(f"a batched step of {rows} tokens: prepare_batch made room for "
                                 f"{0 if self.table.batch_routed is None else self.table.batch_routed.shape[1] // self.top_k}")
            self.table.batch_pairs = rows * self.top_k

    def end_batch_step(self) -> None:
        self.batch_step = False
        if self.table is not None:
            self.table.batch_pairs = 0

    def batch_capturable(self, layer: int) -> bool:
        """Whether this layer's part of a batched decode step is device work only: a pinned layer (its
        bank, grouped GEMM: capture-safe on CUDA in BF16), and an offloaded one through the table
        (`batch_table`); otherwise the placement path, which reads the routing on the host."""
        if layer not in self.pinned:
            return self.batch_table
        return self.device.type != "cuda" or self.store.dtype == torch.bfloat16

    def row_of(self, layer: int) -> int:
        return self._index[layer]

    def switch_phase(self, phase: str) -> None:
        """Attribute cache and copy events from now on to `phase` (lock held)."""
        self.phase = phase
        self.cache.counters = self.cache_counters[phase]
        if self.transfers is not None:
            self.transfers.counters = self.copy_counters[phase]

    def _upload_rows(self, layer: int, experts: list[int], slabs: list[int]) -> None:
        """Refresh this layer's row map on the device, only when an expert moved to another slab."""
        host = self._row_host[self._index[layer]]
        changed = [(e, s) for e, s in zip(experts, slabs) if host[e] != s]
        if not changed:
            return
        for e, s in changed:
            host[e] = s
        self.row_map[self._index[layer]].copy_(torch.tensor(host), non_blocking=True)

    def _prefetch_after(self, layer: int, hidden: torch.Tensor) -> None:
        """The coming layers' experts, as the prefetch policy sees them (nothing to do without slabs)."""
        if self.num_slabs:
            self.policy.after_layer(self, layer, hidden)

    def prefetch(self, items: list[tuple[Key, float]]) -> None:
        """Replace the prefetch list: (layer, expert) pairs with priorities (higher sooner). Ignored
        while lean decode reads the table: only its boundary may evict then."""
        if self.transfers is not None and self.num_slabs and self.boundary.stale:
            self.transfers.prefetch([(k, p) for k, p in items if k[0] not in self.pinned])

    # --- statistics -------------------------------------------------------------------------------
    def layer_stats(self, layer: int) -> dict[str, Any]:
        return layer_stats(self, layer)

    def summary(self) -> dict[str, Any]:
        return summary(self)

    def reset_cache(self) -> None:
        """Forget every slab's expert (a cold cache), e.g. between benchmark configurations."""
        with self.lock:
            if self.transfers is not None and self.transfers.cuda:
                torch.cuda.synchronize(self.device)
                self.transfers.poll()
            counters = self.cache.counters
            self.cache = SlabCache(self.num_slabs, self.cache.layer_order, self.settings.policy)
            self.cache.counters = counters
            self.last_routed.clear()
            self.boundary.forget()  # the new cache holds no reservations
            if self.transfers is not None:
                self.transfers.cache = self.cache
                self.transfers.read_done.clear()

    def summary_once(self, layer: int) -> dict[str, Any]:
        """`summary()` for the first MoE layer only, so per-operator statistics can simply be summed."""
        return self.summary() if layer == self.moe_layers[0] else {}

    def close(self) -> None:
        """Stop the copy worker and give back the host store and the GPU banks (unload)."""
        if self.transfers is not None:
            self.transfers.close()
        if self.transfers is not None and self.transfers.cuda:
            torch.cuda.synchronize(self.device)
        self.store.release()
        self.banks.clear()
        self.pool = self.transfers = self.table = None
        self.table_enabled = False
        empty_host_cache()
