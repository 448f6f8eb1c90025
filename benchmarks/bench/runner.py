"""One configuration, one budget: load, warm up, measure every image size, report, free.

Each configuration loads its own model (the same weights, seed and inputs for all), so nothing one
configuration leaves in memory or in a cache changes the next one's figures.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import torch

from vismmoe_kt.errors import VismmoeError
from vismmoe_kt.runtime.budget import parse_budget, resolve_budget
from vismmoe_kt.runtime.host_memory import empty_host_cache, host_resident_bytes
from vismmoe_kt.core.stats import collect_stats
from benchmarks.bench.accelerate_offload import dispatch_with_accelerate, expert_bytes, non_expert_bytes
from benchmarks.bench.configs import CUDA_REASON, GROUP_REASON, BenchConfig
from benchmarks.bench.figures import FIGURE_KEYS, belady_decode, difference, offload_figures, runtime_counters
from benchmarks.bench.inputs import count_tokens, make_request
from benchmarks.bench.source import ModelSource
from benchmarks.bench.timing import profile_decode, spread, timed_generate, warm_up


@dataclass(frozen=True)
class Settings:
    image_sizes: tuple[int, ...]
    decode_tokens: int
    warmup: int
    repeats: int
    bandwidth: float              # bytes/s, measured in this run
    predictor: str | None = None
    profile: bool = False
    group: Any = None             # vismmoe_kt.parallel.launch.Group under torchrun
    routing: str = "model"        # model | synthetic[:SEED] | trace:PATH (operators/routing_source.py)
    cpu_infer: int | None = None  # CPU expert workers (None: physical cores - 2)
    concurrency: tuple[int, ...] = ()  # also N requests decoded together, for each N (concurrency.py)
    prefill_chunk: int | None = None   # ... their prompts prefilled this many tokens a step (None: whole)

    @property
    def cuda(self) -> bool:
        return torch.cuda.is_available()

    @property
    def device(self) -> str:
        if self.group is not None:
            return self.group.device
        return "cuda:0" if self.cuda else "cpu"


def empty_row(config: BenchConfig, budget: str | None, size: int) -> dict[str, Any]:
    """Every row has every key, so the JSON and the table read the same for run and skipped rows."""
    return {"config": config.name, "description": config.description, "budget": budget, "image_size": size,
            "status": "ok", "reason": None, "warmup_runs": None, "prompt_tokens": None, "visual_tokens": None,
            "visual_tokens_kept": None,
            "prefill_s": None, "decode_tok_s": None, "load_s": None, "peak_gpu_bytes": None,
            "peak_gpu_load_bytes": None, "host_rss_bytes": None, "decode_graphs": None, "pinned_layers": None, "slabs": None, "eviction": None, "placement": None, "cpu_backend": None, "decode_profile": None,
            "concurrency": None,
            **dict.fromkeys(FIGURE_KEYS)}


def skipped_row(config: BenchConfig, budget: str | None, size: int, reason: str) -> dict[str, Any]:
    return {**empty_row(config, budget, size), "status": "skipped", "reason": reason}


def skipped(config: BenchConfig, budget: str | None, settings: Settings, reason: str) -> list[dict[str, Any]]:
    return [skipped_row(config, budget, size, reason) for size in settings.image_sizes]


def _runtime(model):
    return model.vismmoe.context.offload_runtime


def _stop_runtime(model) -> None:
    """Stop the runtime's worker, so nothing keeps the model alive once the caller drops it."""
    runtime = _runtime(model)
    if runtime is not None:
        runtime.close()


def _release_memory(cuda: bool) -> None:
    """Host memory (the store, kt-kernel's copy) and GPU memory must be free before the next load."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        empty_host_cache()


def _graph_state(model) -> str | None:
    """How decode ran: graphed steps of all steps, and why not where it went eager."""
    from vismmoe_kt.engine.decoding import decode_engine

    engine = decode_engine(model)
    stats = engine.stats() if engine is not None else {}
    if not stats:
        return None
    state = f"{stats['graphed_steps']}/{stats['steps']} steps graphed"
    return state + (f" ({stats['reason_eager']})" if stats.get("reason_eager") else "")


def _load(config: BenchConfig, budget: str | None, source: ModelSource, settings: Settings):
    """(model, processor, placement note) for this configuration."""
    devices = {} if settings.device == "cuda:0" else {"generate_device": settings.device, "prefill_device": settings.device}
    if settings.cpu_infer is not None:
        devices["cpu_infer"] = settings.cpu_infer
    if config.accelerate:  # whole model on the host first; accelerate decides what goes to the GPU
        model, processor = source.load(config.rules(None, family=source.family),
                                       {"generate_device": "cpu", "prefill_device": "cpu"})
        experts = resolve_budget(parse_budget(budget), expert_bytes(model))  # a share ("30%") of the experts' bytes
        placed = dispatch_with_accelerate(model, experts + non_expert_bytes(model))
        note = f"{placed['blocks_on_gpu']} of {placed['blocks']} blocks on the GPU"
        return model, processor, note
    model, processor = source.load(config.rules(budget, settings.predictor, source.family), devices,
                                   progress=source.synthetic is not None)
    return model, processor, None if settings.cuda else "no CUDA: every module on the CPU"


def _root_cause(exc: BaseException) -> str:
    """The operator's own message (e.g. the budget's minimum), without the rule engine's wrapping."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc)


def _operator_stats(model) -> dict[str, Any]:
    """Each injected operator's own counters, by module name (the --profile breakdown)."""
    return {name: module.stats() for name, module in model.named_modules()
            if getattr(module, "is_injected_operator", False) and hasattr(module, "stats")}


def _compression_kept(before: dict, after: dict) -> float | None:
    ops_before, ops_after = before["operators"].get("VisDecoder"), after["operators"].get("VisDecoder")
    if not ops_after or ops_after["pruned_prefills"] == ops_before["pruned_prefills"]:
        return None  # no decoder, or one that does not prune (compression none)
    kept = ops_after["visual_tokens_after"] - ops_before["visual_tokens_after"]
    return kept / (ops_after["pruned_prefills"] - ops_before["pruned_prefills"])


def measure_size(model, processor, size: int, settings: Settings, row: dict[str, Any], progress) -> None:
    """Warm-up and repetitions at one image size; fills `row` in place."""
    request = make_request(processor, size, settings.device)
    row["prompt_tokens"], row["visual_tokens"] = count_tokens(request, model.vismmoe.adapter.image_token_id(model.config))
    # the warm-ups asked for, and up to two more while they capture decode graphs (a timed repeat pays none)
    row["warmup_runs"] = warm_up(model, request, settings.decode_tokens, settings.warmup,
                                 on_request=lambda: progress.update(1))
    before = collect_stats(model)
    prefill, decode = [], []
    for _ in range(settings.repeats):
        timed = timed_generate(model, request, settings.decode_tokens)
        prefill.append(timed.prefill_s)
        decode.append(timed.decode_tok_s)
        progress.update(1)
    after = collect_stats(model)
    routing = model.vismmoe.context.routing
    measured = routing.history[-settings.repeats:] if routing is not None and routing.replaces else []
    if settings.profile:
        row["decode_profile"] = profile_decode(model, request, settings.decode_tokens)
    row["prefill_s"], row["decode_tok_s"] = spread(prefill), spread(decode)
    row["visual_tokens_kept"] = _compression_kept(before, after)
    row["cpu_backend"] = next((ops["cpu_backend"] for ops in after["operators"].values() if "cpu_backend" in ops), None)
    delta = difference(runtime_counters(after), runtime_counters(before))
    runtime = _runtime(model)
    if delta is not None:
        row.update(offload_figures(delta, settings.repeats, settings.decode_tokens, runtime.store.block_bytes,
                                   settings.bandwidth))
        row.update(pinned_layers=len(runtime.pinned), slabs=runtime.num_slabs,
                   eviction=after["operators"]["VisExperts"].get("eviction"))  # which ranking ran and why
        if measured:  # the routing the measured repetitions replayed
            offloaded = [i for i, layer in enumerate(routing.moe_layers) if layer not in runtime.pinned]
            row["belady_hit_rate_decode"] = belady_decode(measured, settings.decode_tokens, offloaded, runtime.num_slabs)
    elif "CpuExperts" in after["operators"]:
        row["cpu_expert_share"] = 1.0  # every routed expert runs on the CPU backend
    if settings.concurrency and settings.group is None:  # under torchrun: every rank, after this (run_config)
        row["concurrency"] = [measure_level(model, processor, size, settings, n) for n in settings.concurrency]


def data_parallel_levels(model, processor, settings: Settings) -> dict[int, list[dict[str, Any]]]:
    """Under torchrun, on every rank: each image size's levels with every rank decoding N requests of its
    own (data parallel + expert parallelism, concurrency.measure_data_parallel)."""
    from vismmoe_kt.engine.decoding import decode_engine
    from benchmarks.bench.concurrency import measure_data_parallel

    if decode_engine(model) is None:
        reason = "batched generation runs on the lean decode path"
        return {size: [{"requests": n, "status": "skipped", "reason": reason} for n in settings.concurrency]
                for size in settings.image_sizes}
    return {size: [{"status": "ok", **measure_data_parallel(model, processor, n, size, settings.decode_tokens,
                                                            settings.group, settings.prefill_chunk)}
                   for n in settings.concurrency] for size in settings.image_sizes}


def measure_level(model, processor, size: int, settings: Settings, n: int) -> dict[str, Any]:
    """N requests at `size` px decoded together, or why this configuration cannot."""
    from vismmoe_kt.engine.decoding import decode_engine
    from benchmarks.bench.concurrency import concurrent_requests, decode_pcie_bytes, measure_concurrency

    if decode_engine(model) is None:
        return {"requests": n, "status": "skipped", "reason": "batched generation runs on the lean decode path"}
    runtime = _runtime(model)
    pcie = (lambda: decode_pcie_bytes(runtime)) if runtime is not None else None
    requests = concurrent_requests(processor, n, size, settings.device)
    return {"status": "ok", **measure_concurrency(model, requests, settings.decode_tokens, pcie, settings.prefill_chunk)}


def run_config(config: BenchConfig, budget: str | None, source: ModelSource, settings: Settings,
               progress) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows (one per image size) and, with --profile, each operator's counters after the run."""
    steps = len(settings.image_sizes) * (settings.warmup + settings.repeats)
    if config.needs_cuda and not settings.cuda:
        progress.update(steps)
        return skipped(config, budget, settings, CUDA_REASON), None
    if config.needs_group and settings.group is None:
        progress.update(steps)
        return skipped(config, budget, settings, GROUP_REASON), None
    start = time.perf_counter()
    if settings.cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        model, processor, placement = _load(config, budget, source, settings)
    except (VismmoeError, torch.cuda.OutOfMemoryError) as exc:  # a budget below the minimum, or no room
        _release_memory(settings.cuda)
        progress.update(steps)
        reason = f"does not fit on the GPU: {exc}" if isinstance(exc, torch.cuda.OutOfMemoryError) else _root_cause(exc)
        return skipped(config, budget, settings, reason), None
    load_s = time.perf_counter() - start
    peak_load = torch.cuda.max_memory_allocated() if settings.cuda else None
    if settings.routing != "model":  # every configuration replays the same sequence of requests' routing
        from vismmoe_kt.operators.source_router import install_routing

        install_routing(model, settings.routing)
    rows, leader = [], None
    if settings.group is not None:  # rank 0 measures one request; the other ranks serve their experts to it
        from vismmoe_kt.parallel import launch

        if not settings.group.leader:
            try:
                launch.follow(model, settings.group)
                if settings.concurrency:  # then every rank decodes requests of its own
                    data_parallel_levels(model, processor, settings)
            finally:
                _stop_runtime(model)
                del model, processor
                _release_memory(settings.cuda)
            return [], None
        leader = launch.Leader(model, settings.group)
    try:
        for size in settings.image_sizes:
            row = empty_row(config, budget, size)
            row.update(load_s=load_s, placement=placement, peak_gpu_load_bytes=peak_load)
            if settings.cuda:  # the peak at this image size: weights plus this size's activations
                torch.cuda.reset_peak_memory_stats()
            try:
                measure_size(model, processor, size, settings, row, progress)
            except torch.cuda.OutOfMemoryError as exc:  # activations of a larger image: this row only
                row = skipped_row(config, budget, size, f"out of GPU memory at {size} px: {exc}")
                _release_memory(settings.cuda)
            if settings.cuda:
                row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
            row["host_rss_bytes"] = host_resident_bytes()
            row["decode_graphs"] = _graph_state(model)
            rows.append(row)
        if leader is not None and settings.concurrency:
            leader.stop()  # the followers leave rank 0's forwards; every rank now brings requests of its own
            leader = None
            levels = data_parallel_levels(model, processor, settings)
            for row in rows:
                if row["status"] == "ok":
                    row["concurrency"] = levels[row["image_size"]]
        profile = _operator_stats(model) if settings.profile else None
    finally:
        if leader is not None:
            leader.stop()  # the followers move on to the next configuration
        _stop_runtime(model)
        del model, processor
        _release_memory(settings.cuda)
    return rows, profile
