"""resolve_plan: every `auto` of the offload settings decided once, from the settings and facts of the load.

The runtime (offload.py) builds what the plan says and nothing else decides a mode afterwards: the
store's format, the slabs' format and count, the pinned depth, the decode executor (table decode and
its variant, or the placement path), the batched step's executors and where the hybrid CPU path serves
(prefill, and decode only where the backend's calls can run inside the table step). Facts are
what the settings cannot say: the model's shapes, the checkpoint's expert format (a GGUF's, where the
operator reads one), whether a lookahead predictor runs in decode, and, once the operator knows the
activation (`enable_table`), whether the Triton kernels serve this dtype and activation on this device
and whether the hybrid's CPU backend can run inside a CUDA stream (if not, decode leaves it to prefill).
Given those, the function is pure (its pinned-depth choice is logged). Options that cannot go together: offload_compat.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch

from .budget import BudgetError, human_bytes, resolve_budget, resolve_pinned_layers
from .kernels import tuning
from .offload_compat import check
from .offload_settings import OffloadSettings
from .prefix_depth import DepthChoice, default_model
from .store import ExpertStore

@dataclass(frozen=True)
class PlanFacts:
    moe_layers: int                        # how many MoE layers the runtime serves
    num_experts: int
    hidden: int
    inter: int
    top_k: int
    dtype: torch.dtype                     # the model's
    checkpoint_format: str | None = None   # the checkpoint's expert format where the store can keep it (a GGUF's)
    down_formats: tuple[str, ...] = ()     # the down parts' formats the file declares, where they differ
    lookahead: bool = False                # a device predictor prefetches inside table decode steps
    prefetch_capturable: bool = True       # the prefetch policy needs no host work per layer
    table_kernels: bool | None = None      # the Triton decode kernels serve dtype and activation here; None:
                                           # not asked yet (before enable_table: no table decode)
    expert_major_kernels: bool = False     # expert_major.available(dtype)
    quantized_major_kernels: bool = False  # quantized_major.available(dtype)
    cpu_streams: bool = False              # the hybrid's CPU backend can run its calls inside a CUDA stream


@dataclass(frozen=True)
class OffloadPlan:
    settings: OffloadSettings   # with store_dtype and expert_budget resolved (bytes)
    store_format: str
    quantized_slabs: bool
    slab_bytes: int             # one slab's bytes on the GPU
    layer_bytes: int            # one pinned layer's GPU bytes (the model's dtype; its blocks where pinned_blocks)
    depth: DepthChoice          # the pinned prefix and why
    num_slabs: int
    hybrid: bool                # prefill's misses may go to the CPU backend (miss_policy cpu or auto)
    decode_cpu: bool            # decode's too: hybrid, and table decode's CPU calls run inside its step (any backend
                                # on the CPU, kt-kernel's in-stream calls on CUDA), or no table decode (the placement
                                # path's). False: table decode reads its misses over PCIe, as under wait
    lookahead: bool
    table_kernels: bool         # the Triton kernels run the decode and batched executors (CUDA)
    table_decode: str | None    # a lean decode step's executor: slabs | dequantize-into-slabs | quantized-slabs;
                                # None: the placement path
    batch_pinned: str           # a batched step's pinned layers: grouped-gemm | table | expert-major |
                                # table-then-expert-major (table up to batch_table_pairs pairs)
    batch_pinned_kernels: bool  # expert-major on the Triton kernels (else its torch twin)
    batch_offloaded: str        # placement | table | quantized-expert-major (from 2 tokens)
    batch_major_kernels: bool   # quantized expert-major on the Triton kernels
    eviction: str = "vismmoe"   # the slab cache's ranking: lru | vismmoe | auto (a trial in table decode)
    fill_slabs: bool = False    # a slab for every offloaded expert: the cold ones are copied in as table decode
                                # first starts, so its steps find every expert resident (DecodeBoundary)
    prefill: str = "placement"  # a prompt's offloaded layers: placement (routing read on the host, slabs placed) |
                                # streamed (placement, and a long prompt's next offloaded layer copied in while
                                # this one computes) | filled-slabs (every expert in a quantized slab: read
                                # through the row maps)
    prefill_kernels: bool = False  # quantized slabs computed from in place by the Triton kernels (else decoded
                                   # into a bank of one layer, or the torch twin)
    reservations: str = "before-step"  # table decode's landing slabs: ahead (reserved while the step before runs) |
                                       # before-step (after the records of the step before: the step waits for them)
    batch_block_gemv_pairs: int = 0    # a batched step's pinned blocks go pair by pair (one launch of the GEMVs) up to
                                       # this many pairs, expert-major beyond (one token always pair by pair)
    why: dict[str, str] = field(default_factory=dict)  # choice -> a short reason

    @property
    def pinned_depth(self) -> int:
        return self.depth.depth

    @property
    def pinned_blocks(self) -> bool:
        """Pinned layers hold the store's blocks, computed as the slabs are (on quantized slabs: in the model's
        dtype a pinned layer would take the room of E x (slab in dtype / quantized slab) slabs, about 3.6 E in
        Q4_K from BF16, for the same E experts); else a bank in the model's dtype."""
        return self.quantized_slabs

    @property
    def batch_table(self) -> bool:
        return self.batch_offloaded != "placement"

    def describe(self) -> list[str]:
        """Lines for `--stats`: each choice and why."""
        slabs = "quantized" if self.quantized_slabs else "dequantized"
        decode = f"table ({self.table_decode}{', Triton kernels' if self.table_kernels else ''})" \
            if self.table_decode else "placement path"
        misses = f"fetched (wait{', ' + self.why['misses'] if self.why.get('misses') else ''})" if not self.hybrid else f"hybrid, {self.settings.miss_policy}" + \
            ("" if self.decode_cpu else " in prefill, fetched in decode")
        return [f"store: {self.store_format} ({self.why['store']})",
                f"slabs: {self.num_slabs} {slabs} of {human_bytes(self.slab_bytes)} ({self.why['slabs']})",
                f"pinned: {self.pinned_depth} layer(s){' as quantized blocks' if self.pinned_blocks else ''} "
                f"({self.why['pinned']})",
                f"misses: {misses}{', lookahead predictor' if self.lookahead else ''}",
                f"decode: {decode} ({self.why['decode']})"] + \
            ([f"reservations: {self.reservations} ({self.why['reservations']})"] if self.table_decode else []) + [
                f"batched step: pinned layers {self.batch_pinned}, offloaded layers {self.batch_offloaded} "
                f"({self.why['batch']})",
                f"prefill: {self.prefill} ({self.why['prefill']})",
                f"eviction: {self.eviction} ({self.why['eviction']})"] + \
            ([f"fill: every offloaded expert as the first prompt or decode starts ({self.why['fill']})"]
             if self.fill_slabs else [])


def _store_format(settings: OffloadSettings, facts: PlanFacts) -> tuple[str, str]:
    if settings.store_dtype != "auto":
        return settings.store_dtype, "given"
    fmt = facts.checkpoint_format
    if fmt is None:
        return "model", "auto: no quantized expert format in the checkpoint"
    if settings.predictor:
        return "model", f"auto: the checkpoint's {fmt} experts, but the lookahead predictor needs the model's dtype"
    if _cpu_reads_model_dtype(settings):
        return "model", (f"auto: the checkpoint's {fmt} experts, but miss_policy {settings.miss_policy} with cpu_backend "
                         f"{settings.cpu_backend} computes misses from the model's dtype")
    if settings.miss_policy == "auto":  # and the torch backend: _auto_misses then fetches every miss
        return fmt, (f"auto: the checkpoint's {fmt} experts as the file stores them (the torch CPU backend cannot read "
                     "them: misses are fetched)")
    return fmt, f"auto: the checkpoint's {fmt} experts as the file stores them"


def _cpu_reads_model_dtype(settings: OffloadSettings) -> bool:
    """Whether the CPU miss path the settings ask for would compute from the model's dtype: a CPU share asked for
    (cpu) of a backend that is not kt-kernel (the torch backend reads the store in place; `auto` may fall back to
    it), or auto's split with the backend left to choose. kt-kernel takes a GGUF's blocks as stored, and auto with
    the torch backend fetches every miss of a quantized store (_auto_misses): a GPU's decode does so with that
    backend anyway (a torch CPU call cannot run inside the table step's stream), and the blocks hold 3.6x (Q4_K) the
    experts a BF16 budget holds (BENCHMARKS.md: 6 GiB of Q4_K slabs decode 2x the rate of 16 GiB of BF16)."""
    if settings.miss_policy == "wait" or settings.cpu_backend == "kt-kernel":
        return False
    return settings.miss_policy == "cpu" or settings.cpu_backend == "auto"


def _slab_format(settings: OffloadSettings, quantized_store: bool, facts: PlanFacts, tiles: bool) -> tuple[bool, str]:
    """auto is quantized wherever it works, since fewer bytes per slab hold more experts and copy fewer
    bytes per miss (quantized itself was checked against offload_compat's table)."""
    if settings.slab_format != "auto":
        return settings.slab_format == "quantized", "given"
    lacks = [what for what, missing in (("a quantized store", not quantized_store),
                                        ("miss_policy wait", settings.miss_policy != "wait"),
                                        ("no lookahead predictor", facts.lookahead),
                                        ("hidden and intermediate multiples of 256", not tiles)) if missing]
    if lacks:
        return False, f"auto: dequantized, quantized slabs need {', '.join(lacks)}"
    return True, "auto: quantized, the store's blocks as they are"


def resolve_plan(settings: OffloadSettings, facts: PlanFacts, device: torch.device | str) -> OffloadPlan:
    device = torch.device(device)
    store_format, store_why = _store_format(settings, facts)
    # sizes only: a store allocates nothing until a layer fills it (and refuses rows of partial blocks)
    sizing = ExpertStore(facts.num_experts, facts.hidden, facts.inter, facts.dtype, pin_memory=False, fmt=store_format)
    model_layer_bytes = facts.num_experts * sizing.slab_bytes  # a layer's experts in `dtype`
    budget = resolve_budget(settings.expert_budget, facts.moe_layers * model_layer_bytes)  # a share ("30%") -> bytes
    quantized_store, tiles = sizing.quantized, facts.hidden % 256 == 0 and facts.inter % 256 == 0
    misses_why = _auto_misses(settings, quantized_store)
    if misses_why:
        settings = replace(settings, miss_policy="wait")
    check({"slab_format": settings.slab_format, "store_dtype": settings.store_dtype,  # as given (auto stays auto)
           "miss_policy": settings.miss_policy, "cpu_dtype": settings.cpu_dtype, "cpu_backend": settings.cpu_backend,
           "store": "quantized" if quantized_store else "model", "store_format": store_format,
           "lookahead": facts.lookahead, "whole_tiles": tiles, "hidden": facts.hidden, "inter": facts.inter})
    settings = replace(settings, store_dtype=store_format, expert_budget=budget)
    quantized_slabs, slabs_why = _slab_format(settings, quantized_store, facts, tiles)
    # a quantized slab holds the largest block among the layers (down parts in their files' formats, where given)
    slab_bytes = max([sizing.block_bytes] + [sizing.block_bytes_with(fmt) for fmt in facts.down_formats]) \
        if quantized_slabs else sizing.slab_bytes
    c_safe = settings.min_cache_bytes if settings.min_cache_bytes is not None else facts.num_experts * slab_bytes
    # on quantized slabs a pinned layer keeps its blocks too (OffloadPlan.pinned_blocks): at 6 GiB of Q4_K one
    # costs 128 slabs, where a BF16 bank took the room of 455
    layer_bytes = facts.num_experts * slab_bytes if quantized_slabs else model_layer_bytes
    # Eq. 10's range, then (auto) the depth with the least predicted time per decode token, and why
    # (a quantized store's misses read its blocks, fewer bytes than the slabs the budget holds)
    read_bytes = sizing.block_bytes if quantized_store else 0
    depth = resolve_pinned_layers(budget, layer_bytes, c_safe, settings.min_pinned_layers, facts.moe_layers,
                                  settings.pinned_layers,
                                  model=default_model(facts.moe_layers, model_layer_bytes, read_bytes=read_bytes,
                                                      slab_bytes=slab_bytes),
                                  read_bytes=read_bytes)
    n_pinned = depth.depth
    offloaded = facts.moe_layers - n_pinned
    # (a quantized store adds K + 1 slabs and K blocks of staging beyond the budget: decode's scratch; quantized
    # slabs add a layer of experts in `dtype` that a prefill computes from)
    num_slabs = min((budget - n_pinned * layer_bytes) // slab_bytes, offloaded * facts.num_experts)
    if offloaded and num_slabs < facts.num_experts:
        raise BudgetError(
            f"expert budget {human_bytes(budget)} leaves {num_slabs} slabs after "
            f"{n_pinned} pinned layer(s); at least one layer's {facts.num_experts} experts must fit "
            f"(minimum {human_bytes(n_pinned * layer_bytes + layer_bytes)})")
    hybrid = settings.miss_policy != "wait"
    why = {"store": store_why, "slabs": slabs_why, "pinned": depth.reason, "misses": misses_why}
    kernels = device.type == "cuda" and bool(facts.table_kernels)
    table_decode = _table_decode(settings, facts, device, quantized_slabs, quantized_store, kernels, why)
    decode_cpu = _decode_cpu(settings, facts, device, hybrid, table_decode, why)
    batch_pinned = {"auto": "table-then-expert-major" if kernels else "grouped-gemm",
                    "table": "table" if kernels else "grouped-gemm"}.get(settings.batch_experts, settings.batch_experts)
    if table_decode is None or decode_cpu or facts.lookahead:  # both run per token: the placement path serves them
        batch_offloaded = "placement"
    elif quantized_slabs and settings.batch_experts in ("auto", "expert-major"):
        batch_offloaded = "quantized-expert-major"
    else:
        batch_offloaded = "table"
    why["batch"] = f"batch_experts {settings.batch_experts}" + ("" if kernels else ", no Triton kernels")
    block_gemv_pairs = _block_gemv_pairs(settings, device)
    if quantized_slabs:
        why["batch"] += f"; pinned blocks pair by pair up to {block_gemv_pairs} pairs" if block_gemv_pairs < sys.maxsize \
            else "; pinned blocks pair by pair at every size"
    eviction, why["eviction"] = _eviction(settings, num_slabs, offloaded * facts.num_experts, table_decode, device)
    # a budget that holds every offloaded expert: loading the ones no prompt has routed to yet costs one copy
    # each, once (as a static split loads its layers), and then no decode step can miss (a settled table)
    fill = table_decode is not None and offloaded > 0 and num_slabs >= offloaded * facts.num_experts
    if fill:
        why["fill"] = f"{num_slabs} slabs hold all {offloaded * facts.num_experts} offloaded experts"
    prefill, why["prefill"] = _prefill(fill, quantized_slabs, offloaded, settings.miss_policy)
    reservations, why["reservations"] = _reservations(settings, table_decode, decode_cpu, facts.lookahead,
                                                      fill or offloaded == 0, torch.device(device))
    return OffloadPlan(settings, store_format, quantized_slabs, slab_bytes, layer_bytes, depth, num_slabs, hybrid,
                       decode_cpu, facts.lookahead, kernels, table_decode, batch_pinned,
                       kernels and facts.expert_major_kernels, batch_offloaded,
                       kernels and facts.quantized_major_kernels, eviction, fill, prefill,
                       kernels and facts.quantized_major_kernels, reservations, block_gemv_pairs, why)


def _block_gemv_pairs(settings: OffloadSettings, device: torch.device) -> int:
    """Up to how many pairs a batched step computes pinned quantized blocks pair by pair (the GEMVs in one launch,
    each pair reading its expert's blocks) before the expert-major kernels (each routed expert decoded once):
    under auto the device's measured crossover (tuning.json `quantized_batch_gemv_pairs`), under table always,
    under expert-major and grouped-gemm from 2 tokens on (their own meaning on banks: a blocks layer has no
    grouped GEMM)."""
    if settings.batch_experts == "auto":
        return int(tuning.get("quantized_batch_gemv_pairs", device))
    return sys.maxsize if settings.batch_experts == "table" else 0


def _prefill(fill: bool, quantized_slabs: bool, offloaded: int, miss_policy: str) -> tuple[str, str]:
    """How a prompt's offloaded layers get their experts. Filled quantized slabs: nothing to place, so no routing
    on the host. Else placement, streamed unless every miss is the CPU's (miss_policy cpu): a long prompt routes
    to nearly every expert of a layer, so the next offloaded layer's missing experts can cross the link while
    this one computes, at no cost to the prompt, where a CPU share of a layer is on that layer's critical path
    (under auto the cost model still splits what streaming left missing)."""
    if fill and quantized_slabs:
        return "filled-slabs", "every offloaded expert in a quantized slab"
    if not offloaded:
        return "placement", "every layer pinned"
    if fill:
        return "placement", "every offloaded expert has a slab, but the slabs are not quantized"
    if miss_policy == "cpu":
        return "placement", "not every offloaded expert has a slab; miss_policy cpu gives every miss to the CPU"
    unread = ", and a layer it covered computed from its quantized slabs unread" if quantized_slabs else ""
    return "streamed", f"not every offloaded expert has a slab: a long prompt's next layer is copied in a layer ahead{unread}"


def _auto_misses(settings: OffloadSettings, quantized_store: bool) -> str:
    """Why `miss_policy: auto` fetches every miss (empty: it does not): the torch CPU backend computes on
    the store's blocks in place, and a quantized store's blocks are quantized bytes. A GGUF's Q4_K experts
    under the default rules then run as under wait instead of stopping; `cpu` asked for stays an error
    (offload_compat.py), as does kt-kernel's own choice of the backend."""
    if settings.miss_policy == "auto" and quantized_store and settings.cpu_backend == "torch":
        return "auto: the torch CPU backend cannot compute on a quantized store's blocks (cpu_backend kt-kernel can)"
    return ""


def _reservations(settings: OffloadSettings, table_decode: str | None, decode_cpu: bool, lookahead: bool,
                  settled: bool, device: torch.device) -> tuple[str, str]:
    """When table decode reserves each step's landing slabs. Ahead: while step t runs, the host accounts step
    t - 1 and reserves step t + 1's slabs (disjoint from t's), so step t + 1 is queued without waiting for
    t's records; the cost is a second landing set held and reservations one step older. Before-step (also
    where ahead or auto was asked for and cannot be) stays where a step's own host work depends on the step
    before: the hybrid's CPU quota per miss count, and the lookahead predictor's per-request state. Auto stays
    auto where ahead could run and could differ: decode's steps decide by timing both (reservations.py); not
    with a slab for every offloaded expert (a settled table reserves nothing) or without an accelerator (the
    upkeep and the step share the cores: nothing runs beside the step)."""
    blockers = [why for why, holds in (("decode has a CPU share, whose quota follows each step's misses", decode_cpu),
                                       ("the lookahead predictor prefetches into the landing slots", lookahead))
                if holds]
    if settings.reservations == "before-step":
        return "before-step", "given"
    asked = "auto" if settings.reservations == "auto" else "ahead asked for"
    if table_decode is None:
        return "before-step", f"{asked}, but no table decode"
    if blockers:  # the plan says why `ahead` could not be (--stats)
        return "before-step", f"{asked}, but {'; '.join(blockers)}"
    if settings.reservations == "auto":  # which is faster is the machine's to say (reservations.py)
        if settled:
            return "before-step", "auto: every layer pinned or a slab for every offloaded expert, nothing to reserve"
        if device.type != "cuda":
            return "before-step", "auto: no accelerator, the host's upkeep and the step share the cores"
        return "auto", "decode's steps time before-step against ahead first, keep the faster"
    return "ahead", "given: the host accounts a step and reserves the next one's landings while the device runs"


def _eviction(settings: OffloadSettings, num_slabs: int, offloaded_experts: int, table_decode: str | None,
              device: torch.device) -> tuple[str, str]:
    """The slab cache's ranking. `auto` is decided here where nothing can be measured or nothing differs;
    else it stays `auto`, and table decode's first steps choose by timing them (eviction.py)."""
    if settings.eviction is None:
        return settings.policy, f"policy {settings.policy}"
    if settings.eviction != "auto":
        return settings.eviction, "given"
    if num_slabs >= offloaded_experts:
        return "lru", "auto: a slab for every offloaded expert, nothing to rank (a tie keeps the simpler)"
    if table_decode is None:
        return "vismmoe", "auto: no table decode, whose step boundary the trial times"
    if device.type != "cuda":  # the trial weighs host work between device steps; a CPU step is all host work
        return "vismmoe", "auto: no accelerator, a step's time is the cores' compute, not the ranking beside it"
    return "auto", "auto: the first decode steps time lru against vismmoe and keep the faster, a tie lru"


def _table_decode(settings: OffloadSettings, facts: PlanFacts, device: torch.device, quantized_slabs: bool,
                  quantized_store: bool, kernels: bool, why: dict[str, str]) -> str | None:
    """Lean decode reads experts through the table where it can: not a prefetch policy with per-layer
    host logic unless a device lookahead stands in for it in decode, and on CUDA only where the Triton
    kernels serve the dtype and activation. The hybrid's CPU backend never refuses it (_decode_cpu)."""
    on_cuda = device.type == "cuda"
    reasons = [reason for reason, fails in (
        ("not enabled (no activation known yet)", facts.table_kernels is None),
        ("the prefetch policy has host work per layer", not (facts.prefetch_capturable or facts.lookahead)),
        ("no Triton kernels for this dtype and activation", on_cuda and not kernels)) if fails]
    if reasons:
        why["decode"] = "; ".join(reasons)
        return None
    why["decode"] = "each layer reads its experts where they lie: one graph per step"
    return "quantized-slabs" if quantized_slabs else "dequantize-into-slabs" if quantized_store else "slabs"


def _decode_cpu(settings: OffloadSettings, facts: PlanFacts, device: torch.device, hybrid: bool,
                table_decode: str | None, why: dict[str, str]) -> bool:
    """Whether decode's misses may go to the hybrid's CPU backend. A table step holds the CPU's calls only
    where they run inside it (on the CPU, or kt-kernel's in-stream calls on CUDA). A backend that waits
    on the host (torch) would take decode off the one-graph step onto per-layer host reads, to save
    misses that PCIe reads faster than the CPU computes them even inside the step (BENCHMARKS.md,
    hybrid mode): there decode fetches as under wait and the backend serves prefill. Without table
    decode the placement path's decode keeps the hybrid's split."""
    if not hybrid or table_decode is None or device.type != "cuda" or facts.cpu_streams:
        return hybrid
    why["decode"] += (f"; misses in decode go over PCIe: the CPU backend (cpu_backend {settings.cpu_backend}) "
                      "cannot run inside a CUDA stream; it serves prefill")
    return False


def built_backend_check(plan: OffloadPlan, backend_name: str | None) -> None:
    """After the hybrid's CPU backend is built: `auto` may have fallen back to torch (offload_compat.py)."""
    check({"store": "quantized" if plan.store_format != "model" else "model", "store_format": plan.store_format,
           "backend_built": backend_name})
