"""LoadContext: what the operators of one loaded model share, typed, in one place.

The rule engine (ours, or KTransformers' own `inject`) builds operators one at a time, each with the
loader object. What they share lives on that loader as `loader.context`, made on first use, so the
operators also work under upstream's loaders, which have no such attribute. Fields:

    decode            DecodeOptions: our decode path or transformers' loop, CUDA graphs (engine options,
                      set by `load(..., decode=, graphs=)` or the CLI; not a rule kwarg)
    offload_runtime   the OffloadRuntime every VisExperts of the model uses (the first one makes it)
    expert_set_runtimes  a second expert set's runtime by name (VisionExperts: ERNIE-4.5-VL's vision experts)
    cpu_backend       the CPU expert backend of the CpuExperts layers (one worker pool for all)
    gpu_prefill       the CpuExperts layers' LayerwisePrefill (long prompts' experts on the GPU), or None
    cpu_threads       its worker count (`load(..., cpu_infer=N)` or `--cpu_infer`; None: physical
                      cores - 2, cpu_kernels/threads.py)
    model_device      the device modules go to by default (our loader sets it; None under upstream's)
    token_is_visual   which rows of the hidden states the layers process now are visual tokens
                      (written by the text model's forward, read by ReaLB's operators)
    saliency          the vision tower's saliency recorder (VisionSaliency), read when pruning
    text_model        the text model whose forward is ours (a VisDecoder rule): the engine may hold
                      its cache and run the decode steps itself
    text_forward      that text model's forward (TextForward): batched generation prefills through it
                      a chunk at a time
    pruning           what the last prefill kept (the engine's cache bookkeeping)
    expert_parallel   the expert-parallel operators in layer order (followers drive them)
    ep_fixed_rows     the pass under way is a decode step of at most this many rows on any rank,
                      whose expert-parallel exchanges are the fixed-size ones; 0: another pass (set on
                      every rank by parallel/launch.py or lockstep.py)
    ep_step_rows      the rows of the last such step (kept after it: captured steps are kept per size)
    ep_step_hooks     (before(rows), after) callables around every decode step:
                      expert parallelism announcing it to the group (`ep_step_hook` calls them)
    graph_variants    callables read after the step hooks' `before`: a captured decode step is kept
                      per distinct tuple of their answers (what the step's launches depend on beyond
                      its tensors, e.g. whether the hybrid mode enqueues its CPU calls)
    decode_state      the engine's decode state for this model (made by the engine on first use)
    routing           a routing source that replaces the routers' choice (benchmarks: synthetic or
                      replayed routing on random weights; its operators sit on the routers), or None
    model_pass        what the model's forward under way computes (which requests, slots, positions),
                      published by the engine for operators that key state by position
    checks            requirements between rules, checked once every operator exists (rule order
                      does not matter)

Every field is typed. An object of a room core may import (runtime/) is named by its class; one made
by a room above core (the engine, vision, operators) by a `typing.Protocol` of what its readers use,
defined in core because core is the lowest room that names it (core/context_parts.py). The expert
runtime is the exception that proves the rule: its class is below core, but the engine (which may not
import runtime/) reads it from here, so `offload_runtime` is typed by the protocol the engine talks to
it through (core/expert_runtime.py), which the runtime implements without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable

import torch
from torch import nn

from ..errors import RuleError
from .context_parts import DecodeState, PrefillForward, RoutingTable, SaliencySource
from .model_pass import ModelPass
from .expert_runtime import ExpertRuntime

if TYPE_CHECKING:  # runtime/ is below core: its classes are named as they are (not imported at run time: heavy)
    from cpu_kernels.base import CpuExpertBackend
    from ..runtime.layerwise_prefill import LayerwisePrefill

DECODE_MODES = ("lean", "hf")
GRAPH_MODES = ("auto", "cuda", "replay", "off")


@dataclass
class DecodeOptions:
    decode: str = "lean"  # lean: our decode path (static cache, captured steps) | hf: transformers' generate
    graphs: str = "auto"  # auto: CUDA graphs on a CUDA device | cuda | replay (the CPU twin) | off

    def __post_init__(self):
        if isinstance(self.graphs, bool):  # YAML reads a bare `off` / `on` as a boolean
            self.graphs = "auto" if self.graphs else "off"
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode {self.decode!r} is not one of: {', '.join(DECODE_MODES)}")
        if self.graphs not in GRAPH_MODES:
            raise ValueError(f"graphs {self.graphs!r} is not one of: {', '.join(GRAPH_MODES)}")


@dataclass
class PruningState:
    active: bool = False                     # this model's prefill prunes visual tokens
    needs_vision_saliency: bool = False      # ... choosing by the vision tower's attention
    keep: torch.Tensor | None = None         # sequence indices the last pruned prefill kept ...
    prune_at: int | None = None              # ... in the layers from this one on
    pruned_prefills: int = 0


@dataclass
class LoadContext:
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    offload_runtime: ExpertRuntime | None = None  # runtime.offload.OffloadRuntime, as the engine sees it
    expert_set_runtimes: dict[str, ExpertRuntime] = field(default_factory=dict)  # a second expert set's (VisionExperts)
    cpu_backend: CpuExpertBackend | None = None
    gpu_prefill: LayerwisePrefill | None = None
    cpu_threads: int | None = None
    model_device: str | None = None  # where the loader puts modules by default (None under upstream's loop)
    token_is_visual: torch.Tensor | None = None
    saliency: SaliencySource | None = None        # vision.saliency.SaliencyRecorder
    text_model: nn.Module | None = None
    text_forward: PrefillForward | None = None    # engine.text_forward.TextForward of that text model
    pruning: PruningState = field(default_factory=PruningState)
    expert_parallel: list[nn.Module] = field(default_factory=list)  # operators.ep_experts' operators
    ep_fixed_rows: int = 0
    ep_step_rows: int = 0
    ep_step_hooks: list[tuple[Callable[[int], None], Callable[[], None]]] = field(default_factory=list)
    graph_variants: list[Callable[[], Hashable]] = field(default_factory=list)
    decode_state: DecodeState | None = None       # engine.decoding.Decoding
    routing: RoutingTable | None = None           # operators.routing_source.RoutingSource: replaces the routers' choice
    model_pass: ModelPass | None = None           # what the forward under way computes (the runner says)
    checks: list[Callable[[], None]] = field(default_factory=list)

    def ep_step_hook(self, rows: Callable[[], int]) -> tuple[Callable[[], None], Callable[[], None]]:
        """A (before, after) step hook running `ep_step_hooks` around a decode step of rows() rows (the
        hooks registered when the step runs: a group may form after the engine)."""
        entered: list[Callable[[], None]] = []

        def before() -> None:
            for start, end in list(self.ep_step_hooks):
                start(rows())
                entered.append(end)

        def after() -> None:
            while entered:
                entered.pop()()
        return before, after

    def check(self) -> None:
        """Run the checks operators registered (after injection); each raises RuleError or ValueError."""
        for check in self.checks:
            try:
                check()
            except ValueError as exc:
                raise RuleError(str(exc)) from None


def context_of(loader: Any) -> LoadContext:
    """The loader's LoadContext, made on first use (upstream's loaders have none of their own). Without
    a loader (operators built by hand) each operator gets a context of its own."""
    if loader is None:
        return LoadContext()
    context = getattr(loader, "context", None)
    if context is None:
        context = LoadContext()
        try:
            loader.context = context
        except AttributeError:
            raise ValueError(f"operators need a loader object that can hold attributes, got {type(loader).__name__}") from None
    if not isinstance(context, LoadContext):
        raise ValueError(f"{type(loader).__name__}.context is a {type(context).__name__}, not vismmoe-kt's LoadContext")
    return context


def context_of_model(model: Any) -> LoadContext | None:
    """The context of a loaded model: ours (`model.vismmoe`) or upstream's (`model.gguf_loader`); None
    for a model loaded without operators."""
    info = getattr(model, "vismmoe", None)
    if info is not None and getattr(info, "context", None) is not None:
        return info.context
    loader = getattr(model, "gguf_loader", None)
    context = getattr(loader, "context", None) if loader is not None else None
    return context if isinstance(context, LoadContext) else None
