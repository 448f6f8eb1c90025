"""A model's decode engine across requests: the runner single requests go through, and what every runner
of the model shares.

It is made on first use for a model whose text model's forward is ours (a VisDecoder rule registered it
in the load context) and kept in that context (`decode_state`). `decode_engine(model)` returns it, or
None where transformers' loop decodes (no such rule, or `decode: hf`). The engine reads everything
model-specific through the family's adapter.

Single requests (chat, eval, the benchmarks) run on a runner of one slot, made again, larger, when a
request does not fit (capacities grow in CAPACITY_STEP positions, so most requests reuse the buffers and
the graphs); a conversation's next turn finds its history in that slot. Every runner's captured steps
share one CUDA graph memory pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.context import LoadContext, context_of_model
from ..models import ModelAdapter, adapter_for
from .decode_attention import use_grouped_decode_attention
from .decode_step import DecodeStep
from .fused_ops import fuse_norms, fuse_routers
from .prompt_attention import install as fuse_prompt_attention
from .vision_attention import install as fuse_vision_attention
from .vision_patches import install as project_patches
from .vision_graph import install as replay_vision_tower
from .slot_cache import SlotKVCache

if TYPE_CHECKING:
    from .runner import ModelRunner

CAPACITY_STEP = 256  # single-request slots grow in these steps
COUNTERS = ("steps", "graphed_steps", "segments_captured", "capture_failures", "check_failures", "check_retries")


def text_norms(adapter: ModelAdapter, text: nn.Module):
    """The text model's norms a forward runs as modules: each layer's input and post-attention norms, its
    attention's query and key norms (where it has them), and the final norm."""
    for layer in adapter.layers_of(text):
        yield adapter.input_norm(layer)
        yield adapter.post_attention_norm(layer)
        yield from adapter.attention_norms(adapter.attention(layer))
    yield adapter.final_norm(text)


def fewer_prompt_launches(model: Any, text: nn.Module, adapter: ModelAdapter) -> None:
    """A prompt runs the model's layers as transformers' modules, and with every expert on the GPU it is bound
    by the host launching kernels: give the modules forwards of fewer launches and device waits, the same values
    (each falls back to the module's own where it does not serve)."""
    # every RMSNorm in one kernel on the GPU: the attention's query/key ones (7 launches fewer per norm: ~670 per
    # decode step) and the layers' two and the final one, which the decode step fuses itself (~480 a prompt)
    fuse_norms(list(text_norms(adapter, text)), adapter.rms_norm_params)
    # the attention in four kernels a layer, not about nineteen (prompt_attention.py), the routers in two, not seven
    fuse_prompt_attention(adapter, text)
    fuse_routers([adapter.router(layer) for layer in adapter.layers_of(text)], adapter)
    # the vision encoder's attention: the images' lengths read once a prompt, not once a block (a device wait
    # each), the rotary embedding in one kernel on a GPU (vision_attention.py, vision_rotary.py)
    fuse_vision_attention(adapter, model)
    # the picture's patch embedding as a GEMM, not cuDNN's implicit-GEMM convolution (vision_patches.py)
    project_patches(adapter, model)


class Decoding:
    def __init__(self, model: Any, text: nn.Module, adapter: ModelAdapter, output_head: nn.Module, context: LoadContext):
        self.model, self.text, self.adapter, self.output_head, self.context = model, text, adapter, output_head, context
        self.graphs = context.decode.graphs
        self.graph_pool = torch.cuda.graph_pool_handle() if adapter.token_embedding(text).weight.is_cuda else None
        self.single: ModelRunner | None = None  # the runner single requests go through
        self.retired: list[dict] = []            # the counters of single-request runners replaced by larger ones
        self.profiling = False  # time every piece (eager, a device sync after each): `profile()`
        use_grouped_decode_attention(text.config)  # decode steps' masked attention without repeating K/V heads
        fewer_prompt_launches(model, text, adapter)
        # a picture's vision tower as one graph per picture size, where decode steps are graphed (vision_graph.py)
        self.vision = replay_vision_tower(adapter, model, self.graphs)

    def make_step(self, cache: SlotKVCache) -> DecodeStep:
        step = DecodeStep(self.text, self.adapter, self.output_head, cache, self.context, self.graphs, self.graph_pool)
        step.profiling = self.profiling
        return step

    def runner_for(self, positions: int) -> "ModelRunner":
        """The single-request runner, with a slot of at least `positions` (a new, larger one when it has less)."""
        from .runner import ModelRunner

        if self.single is None or self.single.capacity < positions:
            if self.single is not None:
                self.discard(self.single)  # its counters kept, its buffers freed before larger ones are made
            capacity = -(-positions // CAPACITY_STEP) * CAPACITY_STEP
            self.single = ModelRunner(self.model, 1, capacity, max_queue=1, engine=self)
        self.single.step_fn.profiling = self.profiling
        return self.single

    def discard(self, runner: "ModelRunner") -> None:
        """Single requests get a new runner (this one too small, or left unusable by a failed step); its
        counters stay in the totals."""
        if runner is self.single:
            self.retired.append(runner.step_fn.stats())
            self.single = None

    @property
    def cache(self) -> SlotKVCache | None:
        return self.single.cache if self.single is not None else None

    @property
    def step(self) -> DecodeStep | None:
        return self.single.step_fn if self.single is not None else None

    def forget(self) -> None:
        """The next single request prefills whole (benchmarks of cold prefill)."""
        if self.single is not None:
            self.single.forget_histories()

    def reset_profile(self) -> None:
        if self.step is not None:
            self.step.counters.profile.clear()
            self.step.counters.profile_steps = 0

    def profile(self) -> dict[str, Any]:
        """Seconds per decode step by piece kind and layer, from the profiled steps so far."""
        if self.step is None or not self.step.counters.profile_steps:
            return {}
        steps = self.step.counters.profile_steps
        return {"steps": steps, "seconds_per_step": {kind: {layer: round(t / steps, 6) for layer, t in column.items()}
                                                     for kind, column in self.step.counters.profile.items()}}

    def stats(self) -> dict[str, Any]:
        """The single-request runner's counters, totalled over every runner it replaced (with no live runner,
        after a failed step discarded it: the replaced runners' totals alone; none ever: nothing)."""
        if self.single is None and not self.retired:
            return {}
        out = self.single.stats() if self.single is not None else \
            {**dict.fromkeys(COUNTERS, 0), "check_max_difference": 0.0}
        for old in self.retired:
            for key in COUNTERS:
                out[key] += old[key]
            out["check_max_difference"] = max(out["check_max_difference"], old["check_max_difference"])
        if self.single is not None:
            out["cache_capacity"] = self.single.capacity
            out["cache_bytes"] = self.single.cache.nbytes()
        if self.vision is not None:  # the vision tower's replays (vision_graph.py)
            out.update({f"vision_graph_{key}": value for key, value in self.vision.stats().items()})
        return out


def decode_engine(model: Any) -> Decoding | None:
    """The model's decode engine (made on first use), or None where transformers' loop decodes."""
    context = context_of_model(model)
    if context is None or context.text_model is None or context.decode.decode != "lean":
        return None
    if context.decode_state is None:
        info = getattr(model, "vismmoe", None)
        adapter = info.adapter if info is not None else adapter_for(model.config.model_type)
        context.decode_state = Decoding(model, context.text_model, adapter, adapter.output_head(model), context)
    return context.decode_state
