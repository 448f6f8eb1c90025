"""OffloadRuntime: the state all VisExperts operators of one model share.

Owns the pinned prefix (each pinned layer's experts as one GPU bank), the ExpertStore (host blocks
of every other layer), the slab pool and its SlabCache, and the Transfers. Per MoE layer and step:

    route (done by the model) -> need: which experts the tokens chose  [the one device->host sync]
      -> place: hit / late prefetch (wait on its event) / miss (urgent fetch)
      -> prefetch: hand the priority list for the coming layers to the transfer worker
      -> compute: grouped GEMM over the bank rows -> release the slabs for eviction

The prefetch policy here is the history policy (the experts the next `window` layers used in the
previous step, priority gamma**(d-1) at distance d); `prefetch()` is the interface the lookahead
predictor feeds instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .budget import BudgetError, choose_pinned_layers, human_bytes, parse_bytes
from .expert_compute import bank_experts, row_chunks
from .slab_cache import CacheCounters, Key, SlabCache
from .cost_model import CostModel, calibrate
from .store import ExpertStore, block_views
from .transfers import TransferCounters, Transfers

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class OffloadSettings:
    expert_budget: int                 # bytes of GPU memory for routed experts (pinned + slabs)
    policy: str = "vismmoe"            # "vismmoe" (pinned prefix + prefetch + safe eviction) or "lru"
    pinned_layers: int | None = None   # None: Eq. 10's choice
    min_pinned_layers: int = 1         # L_semantic
    min_cache_bytes: int | None = None  # C_safe; None: one layer of experts (prefill can always progress)
    prefetch_window: int = 2           # W: layers ahead to prefetch
    prefetch_gamma: float = 0.8        # priority decay with distance
    max_in_flight: int = 16            # prefetch copies outstanding at once
    miss_policy: str = "wait"          # wait (fetch, stall on it) | cpu (compute misses on the CPU) | auto
    cpu_backend: str = "torch"         # torch (reads the store in place) | kt-kernel (own copy) | auto
    cost_model: tuple | None = None    # (fetch_s, cpu_fixed_s, cpu_per_token_s) to pin `auto`; None: measure
    predictor: str | None = None       # a trained LookaheadPredictor (vismmoe-kt calibrate); None: history policy
    prefetch_topk: int = 20            # B: (layer, expert) pairs the predictor queues per layer

    @classmethod
    def from_kwargs(cls, expert_budget: Any, policy: str = "vismmoe", pinned_layers: Any = "auto",
                    min_pinned_layers: int = 1, min_cache_bytes: Any = None, prefetch_window: int = 2,
                    prefetch_gamma: float = 0.8, max_in_flight: int = 16, miss_policy: str = "wait",
                    cpu_backend: str = "torch", cost_model: dict | None = None, predictor: str | None = None,
                    prefetch_topk: int = 20) -> "OffloadSettings":
        if expert_budget is None:
            raise BudgetError("expert_budget is required (bytes or a size like '24GiB')")
        if policy not in ("vismmoe", "lru"):
            raise BudgetError(f"policy {policy!r} is not one of: vismmoe, lru")
        pinned = None if pinned_layers in (None, "auto") else int(pinned_layers)
        if policy == "lru":  # the baseline: the whole budget is an on-demand cache, no prefetch
            pinned, min_pinned_layers, prefetch_window = 0, 0, 0
        if not 0 < prefetch_gamma <= 1:
            raise BudgetError(f"prefetch_gamma must be in (0, 1], got {prefetch_gamma}")
        if miss_policy not in ("wait", "cpu", "auto"):
            raise BudgetError(f"miss_policy {miss_policy!r} is not one of: wait, cpu, auto")
        cost = None
        if cost_model is not None:
            model = CostModel.from_kwargs(cost_model)
            cost = (model.fetch_seconds, model.cpu_seconds_fixed, model.cpu_seconds_per_token)
        return cls(parse_bytes(expert_budget), policy, pinned, int(min_pinned_layers),
                   None if min_cache_bytes is None else parse_bytes(min_cache_bytes),
                   int(prefetch_window), float(prefetch_gamma), int(max_in_flight), miss_policy, cpu_backend, cost,
                   None if predictor is None else str(predictor), int(prefetch_topk))


@dataclass
class Placement:
    on_gpu: list[int]   # experts computed from slabs (resident, waited on, or fetched)
    on_cpu: set[int]    # missing experts computed by the CPU backend instead
    slabs: list[int]    # the slab of each on_gpu expert


@dataclass
class LayerCounters:
    hits: int = 0
    late: int = 0
    misses: int = 0      # fetched and waited for
    cpu: int = 0         # computed on the CPU instead (hybrid mode)
    cpu_pairs: int = 0   # token-expert pairs computed on the CPU
    cpu_seconds: float = 0.0  # host time waiting for the CPU backend after the GPU work was queued
    calls: int = 0


class OffloadRuntime:
    def __init__(self, settings: OffloadSettings, moe_layers: list[int], num_experts: int, hidden: int,
                 inter: int, dtype: torch.dtype, device: torch.device | str, top_k: int = 8):
        self.settings, self.moe_layers = settings, list(moe_layers)
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.device = torch.device(device)
        self.store = ExpertStore(num_experts, hidden, inter, dtype, pin_memory=torch.cuda.is_available())
        self.layer_bytes = num_experts * self.store.block_bytes
        c_safe = settings.min_cache_bytes if settings.min_cache_bytes is not None else self.layer_bytes
        n_pinned = choose_pinned_layers(settings.expert_budget, self.layer_bytes, c_safe, settings.min_pinned_layers,
                                        len(self.moe_layers), settings.pinned_layers)
        self.pinned = set(self.moe_layers[:n_pinned])
        offloaded = len(self.moe_layers) - n_pinned
        slab_budget = settings.expert_budget - n_pinned * self.layer_bytes
        self.num_slabs = min(slab_budget // self.store.block_bytes, offloaded * num_experts)
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
        self.counters = {phase: {} for phase in PHASES}
        # cache and copy counters per phase: the live objects are swapped when the phase changes
        self._cache_counters = {phase: CacheCounters() for phase in PHASES}
        self._copy_counters = {phase: TransferCounters() for phase in PHASES}
        self.phase = "prefill"
        self.loaded: set[int] = set()
        self.top_k = top_k
        self.cpu = self._make_cpu_backend() if settings.miss_policy != "wait" else None
        self.cost = CostModel(*settings.cost_model) if settings.cost_model else None
        self.predictor = self._load_predictor() if settings.predictor else None
        self.visual_summary: torch.Tensor | None = None  # h_v, set by VisDecoder at each prefill with an image
        self._step_active: torch.Tensor | None = None    # (MoE layers, E): experts used so far in this step
        self.host_reads = 0  # device->host synchronisations, one per offloaded layer call

    # --- start-up ------------------------------------------------------------------------------
    def _load_predictor(self):
        from ..predictor.model import LookaheadPredictor

        predictor = LookaheadPredictor.load(self.settings.predictor, expect={
            "num_layers": len(self.moe_layers), "num_experts": self.num_experts, "hidden_size": self.hidden})
        return predictor.to(self.device)

    def _make_cpu_backend(self):
        """The CPU backend of hybrid mode. kt-kernel keeps its own BF16 copy of every expert it serves,
        which on top of the page-locked store doubles host memory: refuse it where that cannot fit."""
        import psutil

        from vismmoe_kt.runtime.cpu.isa import choose_backend
        from vismmoe_kt.runtime.cpu.kt_backend import kt_kernel_supports

        name = choose_backend(self.settings.cpu_backend, shape_ok=kt_kernel_supports(self.hidden, self.inter))
        if name == "torch":
            from vismmoe_kt.runtime.cpu.torch_backend import TorchCpuBackend

            return TorchCpuBackend()
        offloaded = len(self.moe_layers) - len(self.pinned)
        needed = offloaded * (self.layer_bytes + self.num_experts * 3 * self.inter * self.hidden * 2)
        total = psutil.virtual_memory().total
        if needed > 0.9 * total:
            raise BudgetError(
                f"cpu_backend kt-kernel keeps its own copy of the experts beside the store: "
                f"{human_bytes(needed)} of host memory for {offloaded} offloaded layers, this host has "
                f"{human_bytes(total)}; use cpu_backend: torch (reads the store in place)")
        from vismmoe_kt.runtime.cpu.kt_backend import KtKernelBackend

        return KtKernelBackend(self.num_experts, self.top_k, self.hidden, self.inter)

    def _allocate(self) -> None:
        """Slabs and maps, once, before the first layer loads (no allocation afterwards)."""
        if self.pool is not None:
            return
        self.pool = self._bank(max(self.num_slabs, 1))
        self.transfers = Transfers(self.store, self.pool, self.cache, self.lock, self.settings.max_in_flight)
        self._switch_phase(self.phase)
        self.row_map = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.long, device=self.device)
        self._row_host = [[0] * self.num_experts for _ in self.moe_layers]
        self._identity = torch.arange(self.num_experts, device=self.device)
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}

    def _bank(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (rows, 2I, H) and (rows, H, I): the layout grouped GEMM reads without copying."""
        kw = dict(dtype=self.store.dtype, device=self.device)
        return (torch.zeros(rows, 2 * self.inter, self.hidden, **kw), torch.zeros(rows, self.hidden, self.inter, **kw))

    def load_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Take one layer's experts (E, 2I, H) and (E, H, I): to a GPU bank if pinned, else to the store."""
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
            if self.cpu is not None:
                self.cpu.add_layer(layer, *block_views(self.store.layers[layer], self.inter, self.hidden))
        self.loaded.add(layer)

    # --- per layer ------------------------------------------------------------------------------
    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        phase = "prefill" if hidden.shape[0] > 1 else "decode"
        if phase != self.phase:
            with self.lock:
                self._switch_phase(phase)
        counters = self.counters[phase].setdefault(layer, LayerCounters())
        counters.calls += 1
        if self.predictor is not None:
            self._note_routing(layer, top_k_index)
        if layer in self.pinned:
            self._prefetch_after(layer, hidden)
            return bank_experts(hidden, top_k_index, top_k_weights, self._identity, *self.banks[layer], act)
        # the layer's one device->host read: the routing (and, when the CPU may compute, its inputs)
        host = self._to_host(top_k_index, *((hidden, top_k_weights) if self.cpu is not None else ()))
        experts, pairs = torch.unique(host[0], return_counts=True)  # on the host: no further sync
        pairs_of = dict(zip(experts.tolist(), pairs.tolist()))
        placement = self._place(layer, pairs_of, counters)
        self._prefetch_after(layer, hidden)
        self.last_routed[layer] = list(pairs_of)
        task = self._submit_cpu(layer, *host, placement.on_cpu, counters) if placement.on_cpu else None
        out = self._compute_on_gpu(layer, hidden, top_k_index, top_k_weights, act, placement, pairs_of) \
            if placement.on_gpu else None
        if task is not None:
            start = time.perf_counter()
            cpu_out = task.wait().to(hidden.device, non_blocking=True)
            counters.cpu_seconds += time.perf_counter() - start
            out = cpu_out if out is None else out + cpu_out
        with self.lock:
            self.transfers.release(placement.slabs)
            self.cache.end_layer(layer)
        return out

    def _place(self, layer: int, pairs_of: dict[int, int], counters: LayerCounters) -> "Placement":
        """hit / late / miss for each needed expert; misses fetched (waited on) or sent to the CPU."""
        needed = list(pairs_of)
        with self.lock:
            self.transfers.poll()
            placed = self.cache.begin_layer(layer, needed)
            on_cpu = self._cpu_choice(layer, placed["miss"], pairs_of)
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
        chunks = row_chunks(list(pairs_per_slab.items()))
        return bank_experts(hidden, top_k_index, weights, self.row_map[self._index[layer]], *self.pool, act, chunks)

    def _cpu_choice(self, layer: int, missing: list[int], pairs: dict[int, int]) -> set[int]:
        """Which missing experts run on the CPU backend (the rest are fetched)."""
        policy = self.settings.miss_policy
        if policy == "wait" or not missing:
            return set()
        if policy == "cpu":
            return set(missing)
        if self.cost is None:
            self.cost = calibrate(self.store, layer, self.cpu, self.device, self.top_k)
        return {e for e in missing if self.cost.prefers_cpu(pairs[e])}

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

    def decode_capturable(self, layer: int) -> bool:
        """Whether this layer's decode forward is device work only (a CUDA graph can hold it): a pinned
        layer of a model with nothing offloaded. With slabs, even pinned layers hand prefetch lists to
        the transfer worker from the host, which a replayed graph would skip."""
        return layer in self.pinned and self.num_slabs == 0 and self.predictor is None and self.cpu is None

    def _switch_phase(self, phase: str) -> None:
        """Attribute cache and copy events from now on to `phase` (lock held)."""
        self.phase = phase
        self.cache.counters = self._cache_counters[phase]
        if self.transfers is not None:
            self.transfers.counters = self._copy_counters[phase]

    def _upload_rows(self, layer: int, experts: list[int], slabs: list[int]) -> None:
        """Refresh this layer's row map on the device, only when an expert moved to another slab."""
        host = self._row_host[self._index[layer]]
        changed = [(e, s) for e, s in zip(experts, slabs) if host[e] != s]
        if not changed:
            return
        for e, s in changed:
            host[e] = s
        self.row_map[self._index[layer]].copy_(torch.tensor(host), non_blocking=True)

    def _note_routing(self, layer: int, top_k_index: torch.Tensor) -> None:
        """The predictor's routing history: which experts each MoE layer used so far in this step."""
        index = self._index[layer]
        if self._step_active is None or index == 0:
            self._step_active = torch.zeros(len(self.moe_layers), self.num_experts, device=top_k_index.device)
        self._step_active[index].index_fill_(0, top_k_index.flatten(), 1.0)

    def _predict_and_prefetch(self, layer: int, hidden: torch.Tensor) -> None:
        """Run the predictor on the compute stream (Eq. 7 features) and queue its top-B pairs. On CUDA
        the priorities go to the host by an asynchronous copy that the transfer worker waits for, so
        the compute thread never stops for them."""
        from ..predictor.model import history

        c = self.predictor.config
        index = self._index[layer]
        past = history(self._step_active, index, c.history_length).to(self.device)
        visual = self.visual_summary if self.visual_summary is not None else torch.zeros(c.visual_size, device=self.device)
        with torch.no_grad():
            scores = self.predictor(torch.tensor([index], device=self.device), past[None],
                                    hidden.float().mean(dim=0, keepdim=True), visual.float().to(self.device)[None])[0]
            values, flat = self.predictor.top_pairs(index, scores, len(self.moe_layers), self.settings.prefetch_topk)
        if values.numel() == 0:
            return

        def items(v: list[float], i: list[int]) -> list[tuple[Key, float]]:
            return [((self.moe_layers[l], e), p) for (l, e), p in self.predictor.to_items(index, v, i)
                    if self.moe_layers[l] not in self.pinned]

        if self.transfers.cuda:
            self.transfers.prefetch_later(values, flat, items)
        else:
            self.prefetch(items(values.tolist(), flat.tolist()))

    def _prefetch_after(self, layer: int, hidden: torch.Tensor | None = None) -> None:
        """Queue the coming layers' experts: the predictor's top-B, else the history policy (the next
        `window` offloaded layers' experts from the previous step)."""
        window = self.settings.prefetch_window
        if not self.num_slabs:
            return
        if self.predictor is not None and hidden is not None:
            self._predict_and_prefetch(layer, hidden)
            return
        if window <= 0:
            return
        order = self.moe_layers
        start = self._index[layer]
        items: list[tuple[Key, float]] = []
        distance = 0
        for step in range(1, len(order)):
            ahead = order[(start + step) % len(order)]
            if ahead in self.pinned:
                continue
            distance += 1
            if distance > window:
                break
            priority = self.settings.prefetch_gamma ** (distance - 1)
            items += [((ahead, e), priority) for e in self.last_routed.get(ahead, [])]
        if items:
            self.prefetch(items)

    def prefetch(self, items: list[tuple[Key, float]]) -> None:
        """Replace the prefetch list: (layer, expert) pairs with priorities (higher sooner)."""
        if self.transfers is not None and self.num_slabs:
            self.transfers.prefetch([(k, p) for k, p in items if k[0] not in self.pinned])

    # --- statistics -------------------------------------------------------------------------------
    def layer_stats(self, layer: int) -> dict[str, int]:
        out = {}
        for phase in PHASES:
            c = self.counters[phase].get(layer, LayerCounters())
            out.update({f"{phase}_hits": c.hits, f"{phase}_late": c.late, f"{phase}_misses": c.misses})
            if self.cpu is not None:
                out.update({f"{phase}_cpu_experts": c.cpu, f"{phase}_cpu_pairs": c.cpu_pairs,
                            f"{phase}_cpu_wait_seconds": round(c.cpu_seconds, 6)})
        return out

    def summary(self) -> dict[str, Any]:
        """Whole-runtime figures per phase (copies, stalls, evictions), resolving pending CUDA timings."""
        if self.transfers is not None and self.transfers.cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, Any] = {
            "policy": self.settings.policy,
            "pinned_layers": len(self.pinned),
            "slabs": self.num_slabs,
            "expert_budget": human_bytes(self.settings.expert_budget),
            "miss_policy": self.settings.miss_policy,
            "host_reads": self.host_reads,  # device->host synchronisations: one per offloaded layer call
            "bytes_host_store": self.store.nbytes,
            "bytes_gpu_experts": sum(t.numel() * t.element_size() for bank in self.banks.values() for t in bank)
            + (sum(t.numel() * t.element_size() for t in self.pool) if self.pool is not None and self.num_slabs else 0),
        }
        for phase in PHASES:
            cache, copies = self._cache_counters[phase], self._copy_counters[phase]
            copies.resolve()
            out.update({
                f"{phase}_evictions": cache.evictions, f"{phase}_prefetches": cache.prefetches,
                f"{phase}_fetches": cache.fetches, f"bytes_copied_{phase}": copies.bytes_copied,
                f"{phase}_copy_seconds": round(copies.copy_seconds, 6),
                f"{phase}_stall_seconds": round(copies.stall_seconds, 6),
            })
        if self.cpu is not None:
            out["cpu_backend"] = self.cpu.describe()
            out["bytes_cpu_backend"] = self.cpu.host_bytes
        for total in ("evictions", "prefetches", "fetches", "copy_seconds", "stall_seconds"):
            out[total] = round(sum(out[f"{phase}_{total}"] for phase in PHASES), 6)
        out["bytes_copied"] = sum(out[f"bytes_copied_{phase}"] for phase in PHASES)
        return out

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
            if self.transfers is not None:
                self.transfers.cache = self.cache
                self.transfers.read_done.clear()

    def summary_once(self, layer: int) -> dict[str, Any]:
        """`summary()` for the first MoE layer only, so per-operator statistics can simply be summed."""
        return self.summary() if layer == self.moe_layers[0] else {}

    def close(self) -> None:
        if self.transfers is not None:
            self.transfers.close()
