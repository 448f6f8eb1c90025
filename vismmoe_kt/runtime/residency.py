"""Residency: where every expert of the offloaded model lies, and the counters of what moved.

The pinned banks (each pinned layer's experts as one GPU bank: in the model's dtype, or, on quantized slabs,
the store's blocks as a slab holds them), the ExpertStore (host blocks of every
other layer), the slab pool and its SlabCache, the Transfers, the DecodeTable and the row maps (each
offloaded layer's bank row per expert, for grouped GEMM over the pool), sized by the OffloadPlan. The
decode executors (executors/) read from here and the DecodeBoundary keeps it between table steps;
neither decides a mode: the plan did.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .budget import BudgetError
from .host_memory import empty_host_cache
from .offload_plan import OffloadPlan
from .offload_stats import PHASES, LayerCounters
from .slab_cache import CacheCounters, SlabCache
from .store import ExpertStore, block_views, raw_down_format
from .decode_table import DecodeTable
from .transfers import TransferCounters, Transfers


class Residency:
    def __init__(self, plan: OffloadPlan, moe_layers: list[int], num_experts: int, hidden: int, inter: int,
                 dtype: torch.dtype, device: torch.device, top_k: int, cpu: Any = None):
        self.plan, self.settings = plan, plan.settings
        self.moe_layers, self.num_experts, self.hidden, self.inter = list(moe_layers), num_experts, hidden, inter
        self.device, self.top_k = device, top_k
        self.cpu = cpu  # the hybrid's CPU backend (it gets each offloaded layer as it loads), or None
        self.store = ExpertStore(num_experts, hidden, inter, dtype, pin_memory=torch.cuda.is_available(),
                                 fmt=plan.store_format)
        self.layer_bytes, self.slab_bytes, self.num_slabs = plan.layer_bytes, plan.slab_bytes, plan.num_slabs
        self.quantized_slabs, self.pinned_blocks = plan.quantized_slabs, plan.pinned_blocks
        self.pinned = set(self.moe_layers[:plan.pinned_depth])
        self.offloaded = [layer for layer in self.moe_layers if layer not in self.pinned]
        self.lock = threading.RLock()
        # the plan's ranking; `auto` starts with VisMMOE's until decode's trial sets one (eviction.py)
        self.cache = SlabCache(self.num_slabs, self.offloaded, "vismmoe" if plan.eviction == "auto" else plan.eviction)
        # pinned layer -> (gate_up, down) in the model's dtype; (blocks,) uint8 (E, block bytes) where pinned_blocks
        self.banks: dict[int, tuple[torch.Tensor, ...]] = {}
        self.pool: tuple[torch.Tensor, ...] | None = None  # slabs: gate_up (S, 2I, H), down (S, H, I); or blocks
        self.transfers: Transfers | None = None
        self.table: DecodeTable | None = None
        self.row_map: torch.Tensor | None = None   # (num MoE layers, E) bank row per expert, on the device
        self.row_host: list[list[int]] = []
        self.identity: torch.Tensor | None = None
        self.index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.last_routed: dict[int, list[int]] = {}
        self.counters: dict[str, dict[int, LayerCounters]] = {phase: {} for phase in PHASES}
        # cache and copy counters per phase: the live objects are swapped when the phase changes
        self.cache_counters = {phase: CacheCounters() for phase in PHASES}
        self.copy_counters = {phase: TransferCounters() for phase in PHASES}
        self.phase = "prefill"
        self.loaded: set[int] = set()
        self.host_reads = 0  # device->host synchronisations, one per offloaded layer call
        self.batch_staging: torch.Tensor | None = None  # quantized slabs: a batched step's misses with no landing

    def allocate(self) -> None:
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
            self.pool = self.bank(rows)
        self.transfers = Transfers(self.store, self.pool, self.cache, self.lock, self.settings.max_in_flight)
        # with lookahead, prefetches land in the same per-layer slots as misses: room for both
        slots = 2 * self.top_k if self.plan.lookahead else self.top_k
        self.table = DecodeTable(len(self.moe_layers), self.num_experts, self.top_k, self.device, slots)
        self.switch_phase(self.phase)
        self.row_map = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.long, device=self.device)
        self.row_host = [[0] * self.num_experts for _ in self.moe_layers]
        self.identity = torch.arange(self.num_experts, device=self.device)

    def bank(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (rows, 2I, H) and (rows, H, I): the layout grouped GEMM reads without copying."""
        kw = dict(dtype=self.store.dtype, device=self.device)
        return (torch.zeros(rows, 2 * self.inter, self.hidden, **kw), torch.zeros(rows, self.hidden, self.inter, **kw))

    # --- loading ------------------------------------------------------------------------------------
    def raw_down_format(self, layer: int, gate_type: int, up_type: int, down_type: int) -> str | None:
        """The down part's format if `load_layer_raw` can take `layer` as a file stores it (offloaded or pinned
        as blocks, gate and up in the store's format, down in it or in another block format whose rows fit,
        e.g. a Q4_K_M file's Q6_K; no CPU backend wanting the model's dtype); None: dequantize and requantize."""
        if (layer in self.pinned and not self.pinned_blocks) or not self.store.quantized or self.cpu is not None:
            return None
        return raw_down_format(self.store.fmt, self.inter, gate_type, up_type, down_type)

    def load_layer_raw(self, layer: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       down_format: str | None = None) -> None:
        """An offloaded layer (or one pinned as blocks) from block bytes as a GGUF stores them ((E, I, H),
        (E, I, H), (E, H, I)): into the store of the same format as they are (down in `down_format`, where
        it differs), with no dequantizing and requantizing; a pinned layer's then into its GPU bank."""
        self.allocate()
        block_bytes = self.store.block_bytes_with(down_format or self.store.fmt) if self.quantized_slabs else 0
        if block_bytes > self.slab_bytes:
            raise BudgetError(f"slab_format quantized sized its slabs for {self.slab_bytes} bytes, but layer {layer}'s "
                              f"experts with {down_format} down experts take {block_bytes} (the file's header did not "
                              "say so): use slab_format dequantized")
        self.store.fill_layer_raw(layer, gate, up, down, down_format)
        if layer in self.pinned:
            self._pin_blocks(layer)
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
        self.allocate()
        if layer in self.pinned and self.pinned_blocks:
            self.store.fill_layer(layer, gate_up, down)
            self._pin_blocks(layer)
        elif layer in self.pinned:
            bank = self.bank(self.num_experts)
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

    def _pin_blocks(self, layer: int) -> None:
        """A pinned layer's blocks, as the store holds them, into a GPU bank of their own (the host copy goes)."""
        blocks = self.store.take_layer(layer)
        self.banks[layer] = (blocks.to(self.device, copy=True),)

    # --- per layer ----------------------------------------------------------------------------------
    def cold_experts(self) -> list[tuple[int, int]]:
        """The offloaded experts no slab holds (none, without a look at each, once the cache holds them all)."""
        if len(self.cache.where) >= len(self.offloaded) * self.num_experts:
            return []
        return [(layer, e) for layer in self.offloaded for e in range(self.num_experts) if (layer, e) not in self.cache.where]

    def row_of(self, layer: int) -> int:
        return self.index[layer]

    def switch_phase(self, phase: str) -> None:
        """Attribute cache and copy events from now on to `phase` (lock held)."""
        self.phase = phase
        self.cache.counters = self.cache_counters[phase]
        if self.transfers is not None:
            self.transfers.counters = self.copy_counters[phase]

    def upload_rows(self, layer: int, experts: list[int], slabs: list[int]) -> None:
        """Refresh this layer's row map on the device, only when an expert moved to another slab."""
        host = self.row_host[self.index[layer]]
        changed = [(e, s) for e, s in zip(experts, slabs) if host[e] != s]
        if not changed:
            return
        for e, s in changed:
            host[e] = s
        self.row_map[self.index[layer]].copy_(torch.tensor(host), non_blocking=True)

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Device->host copies issued together and waited for once (counted in `host_reads`)."""
        self.host_reads += 1
        if self.device.type != "cuda":
            return list(tensors)
        copies = [t.to("cpu", non_blocking=True) for t in tensors]  # page-locked destinations
        torch.cuda.current_stream(self.device).synchronize()
        return copies

    # --- lifetime -----------------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Forget every slab's expert (a cold cache); the caller tells the boundary (lock held)."""
        if self.transfers is not None and self.transfers.cuda:
            torch.cuda.synchronize(self.device)
            self.transfers.poll()
        counters = self.cache.counters
        ranking = self.cache.ranking  # the ranking in force stays (a fixed one, or what a trial chose)
        self.cache = SlabCache(self.num_slabs, self.cache.layer_order, ranking.name)
        self.cache.counters, self.cache.ranking = counters, ranking
        self.last_routed.clear()
        if self.transfers is not None:
            self.transfers.cache = self.cache
            self.transfers.read_done.clear()

    def close(self) -> None:
        """Stop the copy worker and give back the host store and the GPU banks (unload)."""
        if self.transfers is not None:
            self.transfers.close()
        if self.transfers is not None and self.transfers.cuda:
            torch.cuda.synchronize(self.device)
        self.store.release()
        self.banks.clear()
        self.pool = self.transfers = self.table = None
        empty_host_cache()
