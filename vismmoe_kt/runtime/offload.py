"""OffloadRuntime: the state all VisExperts operators of one model share, built from one OffloadPlan.

resolve_plan (offload_plan.py) decides every `auto` once; the runtime then builds:
    Residency          the pinned banks, the host ExpertStore, the slab pool and its SlabCache, the
                       Transfers, the DecodeTable and the row maps (residency.py)
    executors          the placement path, the table step, the batched steps (executors/)
    DecodeBoundary     the cache's upkeep between lean decode steps (decode_boundary.py)
`run_layer` hands each call to the executor bound for the current phase: the placement path, until
the boundary arms a table step or a batched step begins (the step hooks swap it; nothing is decided
per layer). Settings: offload_settings.py; counters and the summary: offload_stats.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from cpu_kernels.threads import leave_cores_to_workers

from .decode_boundary import DecodeBoundary
from .engine_queries import EngineQueries
from .eviction import FixedEviction, eviction_choice
from .executors.batch_step import BatchStepExecutor
from .executors.cpu_join import TableCpuJoin
from .executors.placement import Placement, PlacementExecutor  # noqa: F401 (Placement: the placement's result)
from .executors.step_lookahead import StepLookahead
from .executors.table_step import TableStepExecutor
from .kernels import expert_major, quantized_major
from .miss_policy import MissPolicy
from .offload_plan import OffloadPlan, PlanFacts, built_backend_check, resolve_plan
from .offload_settings import OffloadSettings
from .offload_stats import layer_stats, summary
from .prefetch import HistoryPrefetch, PrefetchPolicy
from .reservations import FixedReservations, reservations_choice
from .residency import Residency
from .slab_cache import Key
from .table_experts import kernel_usable

ROUTER_KEEP = 0.8  # weight of the past in the router-probability average, per decode token (eviction_study.py)


def _residency(name: str, settable: bool = False) -> property:
    """The facade's view of one Residency attribute (what the rooms above and the tests read)."""
    def get(self):
        return getattr(self.residency, name)

    def put(self, value):
        setattr(self.residency, name, value)
    return property(get, put if settable else None)


def _nothing() -> None:
    pass


def _ignore_prefetch(items: list) -> None:
    pass


class OffloadRuntime(EngineQueries):
    def __init__(self, settings: OffloadSettings, moe_layers: list[int], num_experts: int, hidden: int,
                 inter: int, dtype: torch.dtype, device: torch.device | str, top_k: int = 8,
                 prefetch: PrefetchPolicy | None = None, lookahead: Any = None, cpu_threads: int | None = None,
                 model_dir: Any = None, sources: Any = (), down_formats: dict[int, str] | None = None,
                 checkpoint_format: str | None = None):
        """`checkpoint_format`: the checkpoint's expert format where the store can keep it as stored (a
        GGUF's: what `store_dtype: auto` takes); `down_formats`: the down parts' formats a file declares."""
        self.requested_settings = self._given = settings  # the rules' own (`auto` unresolved)
        self.moe_layers, self.num_experts, self.hidden, self.inter = list(moe_layers), num_experts, hidden, inter
        self.device, self.top_k = torch.device(device), top_k
        self.policy = prefetch or HistoryPrefetch(settings.prefetch_window, settings.prefetch_gamma)
        self.lookahead = lookahead
        self.facts = PlanFacts(len(self.moe_layers), num_experts, hidden, inter, top_k, dtype, checkpoint_format,
                               tuple((down_formats or {}).values()), lookahead is not None,
                               bool(self.policy.capturable))
        self.plan: OffloadPlan = resolve_plan(settings, self.facts, self.device)
        self.settings, self.depth_choice = self.plan.settings, self.plan.depth
        self.residency = res = Residency(self.plan, self.moe_layers, num_experts, hidden, inter, dtype, self.device,
                                         top_k)
        self.pinned = res.pinned
        self.miss = MissPolicy(self.settings, num_experts, hidden, inter, top_k, len(res.offloaded),
                               num_experts * res.store.block_bytes, cpu_threads, model_dir, sources,
                               model_on_cpu=self.device.type == "cpu")
        self.cpu = res.cpu = self.miss.cpu
        built_backend_check(self.plan, getattr(self.cpu, "name", None))  # `auto` may have fallen back to torch
        if getattr(self.cpu, "streams", False) and self.device.type == "cuda":
            leave_cores_to_workers()  # kt-kernel's pinned workers get the cores torch would otherwise spin on
        self.visual_summary: torch.Tensor | None = None  # h_v, set by the text model's forward at each image prefill
        # the prefetch policies' `prefetch(items)`: nothing to fill without slabs
        self.prefetch = self._queue_prefetch if res.num_slabs else _ignore_prefetch
        # its miss policy: the plan's for decode (_build_executors)
        self.boundary = DecodeBoundary(res, None, self.prepare_lookahead, self._armed)
        self.step_lookahead = StepLookahead(res, lookahead) if lookahead is not None else None
        self.cpu_join = TableCpuJoin(res, self.cpu) if self.cpu is not None else None
        self._batch = False         # inside a decode step of several rows
        self._upkeep = False        # the table's upkeep ran at this step's beginning (`begin_step`)
        self._build_executors()
        self.table_enabled = False  # `enable_table`: this runtime's decode may use the table

    # --- the residency's state, as the rooms above read it ---------------------------------------------
    store, pool, banks, cache = _residency("store"), _residency("pool"), _residency("banks"), _residency("cache")
    transfers, table = _residency("transfers", settable=True), _residency("table")
    lock, counters, loaded = _residency("lock"), _residency("counters"), _residency("loaded")
    cache_counters, copy_counters = _residency("cache_counters"), _residency("copy_counters")
    phase, last_routed, host_reads = _residency("phase"), _residency("last_routed"), _residency("host_reads")
    num_slabs, slab_bytes, layer_bytes = _residency("num_slabs"), _residency("slab_bytes"), _residency("layer_bytes")
    quantized_slabs, row_map = _residency("quantized_slabs"), _residency("row_map")

    # --- executors, chosen once from the plan ------------------------------------------------------------
    def _build_executors(self) -> None:
        res, plan = self.residency, self.plan
        current = self.boundary.eviction
        if getattr(current, "eviction", None) != plan.eviction:  # a trial under way stays
            self.boundary.eviction = eviction_choice(plan.eviction, plan.why["eviction"])
            res.cache.ranking = self.boundary.eviction.current
        elif isinstance(current, FixedEviction):  # the same ranking, for the plan's reason now (what --stats says)
            current.reason = plan.why["eviction"]
        # decode's CPU share (the boundary's quota, the table step's join) only where the plan's decode has one;
        # the placement path (prefill) keeps the miss policy either way
        self.boundary.miss = self.miss if plan.decode_cpu else None
        self.boundary.fill = plan.fill_slabs
        reservations = self.boundary.reservations
        if reservations.reservations != plan.reservations:  # a trial under way stays
            self.boundary.reservations = reservations = reservations_choice(plan.reservations,
                                                                            plan.why["reservations"])
        elif isinstance(reservations, FixedReservations):  # the same way, for the plan's reason now (--stats)
            reservations.reason = plan.why["reservations"]
        self.boundary.set_reservations(reservations.ahead)
        self._placement = placement = PlacementExecutor(res, self, self.boundary, self.miss)
        table = TableStepExecutor(res, plan.table_decode, plan.table_kernels, placement, self.step_lookahead,
                                  self.cpu_join if plan.decode_cpu else None) if plan.table_decode else None
        eager_batch = BatchStepExecutor(res, plan, placement)
        self._arm_table = table.bind_step if table else _nothing  # the CPU pairs' layers, or those without
        self._executors = {(False, False): placement, (False, True): table or placement,
                           (True, False): eager_batch,
                           (True, True): BatchStepExecutor(res, plan, placement, table) if table else eager_batch}
        self._bind()

    def _bind(self) -> None:
        """Which executor serves `run_layer` now: the phase changed (a step armed or over, a batch begun or ended)."""
        self._serve = self._executors[self._batch, self.boundary.armed].run_layer

    def _armed(self) -> None:
        """The boundary armed a table step (its CPU quota set) or ended one."""
        self._arm_table()
        self._bind()

    def _replan(self, **facts: Any) -> None:
        self.facts = replace(self.facts, **facts)
        self.plan = resolve_plan(self._given, self.facts, self.device)
        self.settings = self.residency.settings = self.plan.settings
        self.residency.plan = self.plan  # the sizes stay; the executors read its choices
        self._build_executors()

    @property
    def table_enabled(self) -> bool:
        return self._table_enabled

    @table_enabled.setter
    def table_enabled(self, enabled: bool) -> None:
        """The step hooks bound once: the boundary's where the table serves decode, else nothing (False
        also turns a planned table off: a test's or a benchmark's switch, between requests)."""
        self._table_enabled = enabled and self.plan.table_decode is not None
        self._hooks = (self.boundary.before_step, self.boundary.after_step) if self._table_enabled \
            else (_nothing, _nothing)

    @property
    def batch_experts(self) -> str:
        return self.settings.batch_experts

    @batch_experts.setter
    def batch_experts(self, mode: str) -> None:
        """A test's choice after load (else the rules' or `--set`'s `batch_experts`): the plan again."""
        self._given = replace(self._given, batch_experts=mode)
        self._replan()

    @property
    def batch_table_pairs(self) -> int:
        return self.settings.batch_table_pairs

    # --- start-up ------------------------------------------------------------------------------------
    def raw_down_format(self, layer: int, gate_type: int, up_type: int, down_type: int) -> str | None:
        return self.residency.raw_down_format(layer, gate_type, up_type, down_type)

    def load_layer_raw(self, layer: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       down_format: str | None = None) -> None:
        self.residency.load_layer_raw(layer, gate, up, down, down_format)

    def takes_stored(self, layer: int) -> bool:
        return self.residency.takes_stored(layer)

    def load_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor, stored: tuple | None = None) -> None:
        self.residency.load_layer(layer, gate_up, down, stored)

    def enable_table(self, act: Any) -> bool:
        """Let lean decode read experts through the table where the plan can (offload_plan._table_decode),
        now that the activation is known: the Triton kernels' facts, the executors again. True: the
        caller registers `before_step` / `after_step` as the engine's step hooks."""
        dtype = self.store.dtype
        self._replan(table_kernels=kernel_usable(self.device, dtype, act),
                     expert_major_kernels=expert_major.available(dtype),
                     quantized_major_kernels=quantized_major.available(dtype),
                     cpu_streams=bool(getattr(self.cpu, "streams", False)))
        self.table_enabled = True  # where the plan has table decode
        return self.table_enabled

    # --- per layer and per step -------------------------------------------------------------------------
    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        return self._serve(layer, hidden, top_k_index, top_k_weights, act)

    def begin_prompt(self, tokens: int) -> None:
        """A prefill forward of `tokens` tokens is about to run (the engine says so before its vision tower): the
        placement path may start copying the prompt's first offloaded layer (executors/placement.py)."""
        self._placement.begin_prompt(tokens)

    @property
    def table_armed(self) -> bool:
        return self.boundary.armed

    def before_step(self) -> None:
        self._hooks[0]()

    def after_step(self) -> None:
        self._hooks[1]()

    def graph_variant(self) -> str:
        """What a captured decode step depends on beyond its tensors (read after `before_step`): "cpu
        pairs" where the hybrid mode's CPU calls are in it, "settled" where its layers read a settled
        table (no lookup, staging or records: decode_boundary.py), else ""; " without router averages"
        added once `eviction: auto`'s trial has kept lru. A layer's CPU call costs two host functions and
        four small copies even when it has no CPU pairs, so while the cost model sends no miss to the CPU
        the step is one captured without them (always, where the plan's decode leaves the CPU to prefill)."""
        if not self.table_enabled:
            return ""
        if self.table.settled:
            return "settled"
        variant = "cpu pairs" if self.plan.decode_cpu and self.table.cpu_active else ""
        if self.router_sink() is not None and not self.averages_router():
            variant += " without router averages"  # `auto` kept lru: a lerp a layer fewer (observe_router)
        return variant

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

    @property
    def batch_table(self) -> bool:
        """Whether a batched step's offloaded layers go through the decode table (token by token, device
        work only, with the table's step hooks around the step), not the placement path: a table the
        lean decode uses, without the hybrid's CPU calls or a lookahead predictor (both per token)."""
        return self.table_enabled and self.plan.batch_table

    def prepare_steps(self, max_rows: int) -> None:
        """Decode steps of up to `max_rows` tokens will run: for several rows, the table's record buffers,
        made before any step is captured (captured steps write into them)."""
        res = self.residency
        if max_rows > 1 and self.batch_table and res.table is not None:
            res.table.enable_batch(max_rows)
            pairs = max_rows * self.top_k
            if res.quantized_slabs and (res.batch_staging is None or res.batch_staging.shape[0] < pairs):
                # a staging row per pair for misses that claim no landing slab (outside the expert budget)
                res.batch_staging = torch.zeros(max_rows * self.top_k, res.slab_bytes, dtype=torch.uint8,
                                                device=self.device)

    def begin_step(self, rows: int) -> None:
        """A decode step of `rows` tokens starts: the executor for them (one token: the table step, with the
        lookahead and the hybrid's CPU join where the plan has them; several: the batched step), and the
        table's upkeep where the table serves the step (a batch only through `batch_table`)."""
        self._batch = rows > 1
        self._bind()
        table = self.table
        if self._batch and self.batch_table and table is not None:
            if table.batch_routed is None or rows * self.top_k > table.batch_routed.shape[1]:
                raise ValueError(f"a decode step of {rows} tokens: prepare_steps made room for "
                                 f"{0 if table.batch_routed is None else table.batch_routed.shape[1] // self.top_k}")
            table.batch_pairs = rows * self.top_k
        self._upkeep = self.batch_table if self._batch else self.table_enabled
        if self._upkeep:
            self.before_step()

    def end_step(self) -> None:
        if self._upkeep:
            self._upkeep = False
            self.after_step()
        self._batch = False
        self._bind()
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
        return self.residency.row_of(layer)

    def switch_phase(self, phase: str) -> None:
        self.residency.switch_phase(phase)

    def observe_router(self, moe_index: int, probabilities: torch.Tensor) -> None:
        """A decode token's router probabilities over every expert of MoE layer `moe_index` (1, E),
        from inside the step (device work only): the VisMMOE cache ranks eviction victims by their
        average (decode_boundary.py), what the router favours beyond its top-k. Nothing once `auto`'s trial has
        kept lru: the step is captured anew without them (graph_variant), and the cache drops its copy, so a
        prefetch's admission weighs a held expert as under the lru file (0), not by averages gone stale."""
        if self.averages_router():
            self.table.observe_router(moe_index, probabilities, ROUTER_KEEP)

    def averages_router(self) -> bool:
        """Whether decode steps still keep the router's averages up (false once `auto`'s trial has kept lru): a
        routing source then hands a step no probabilities to average (routing_source.py)."""
        return self.boundary.averages_router

    def router_sink(self) -> Any:
        """`observe_router` where the eviction may use it (table decode with slabs to evict from, the
        VisMMOE ranking or `auto`'s trial of it), else None: an all-resident step, or one whose slabs hold
        every offloaded expert (nothing is ever evicted: `plan.fill_slabs`), computes no extra softmax and
        average (two kernels a layer: 5% of a Q4_K step's device time on the H200)."""
        used = self.table_enabled and self.num_slabs > 0 and not self.plan.fill_slabs and self.plan.eviction != "lru"
        return self.observe_router if used else None

    def prepare_lookahead(self) -> None:
        """As decode starts (outside any capture): the lookahead's side stream, each row's mapped store
        address, and the predictor's per-request features reset."""
        if self.step_lookahead is not None:
            self.step_lookahead.prepare(self.visual_summary)

    def _queue_prefetch(self, items: list[tuple[Key, float]]) -> None:
        """`prefetch` with slabs: replace the prefetch list, (layer, expert) pairs with priorities (higher
        sooner). Ignored while lean decode reads the table: only its boundary may evict then."""
        if self.boundary.stale:
            self.transfers.prefetch([(k, p) for k, p in items if k[0] not in self.pinned])

    # --- statistics and lifetime -----------------------------------------------------------------------
    def layer_stats(self, layer: int) -> dict[str, Any]:
        return layer_stats(self, layer)

    def summary(self) -> dict[str, Any]:
        return summary(self)

    def summary_once(self, layer: int) -> dict[str, Any]:
        """`summary()` for the first MoE layer only, so per-operator statistics can simply be summed."""
        return self.summary() if layer == self.moe_layers[0] else {}

    def reset_cache(self) -> None:
        """Forget every slab's expert (a cold cache), e.g. between benchmark configurations."""
        with self.lock:
            self.residency.reset_cache()
            self.boundary.forget()  # the new cache holds no reservations
            self._placement.unfill()  # filled slabs: the next prompt fills them again

    def close(self) -> None:
        """Stop the copy worker and give back the host store and the GPU banks (unload)."""
        self.residency.close()
        self.table_enabled = False
