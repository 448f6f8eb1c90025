"""One decode step of the text model, owned by us: static cache, no host logic between MoE layers.

Shapes: H hidden, V vocabulary, C the cache's capacity, K experts per token; one token per step.

The step is a list of pieces, each a function from a tuple of tensors to the next tuple:
    embed            token -> hidden, rotary cos/sin for the next position, the layers' masks
    attention l      input norm, attention over layer l's static cache, residual, post-attention norm,
                     and for an MoE layer the router (norms and router fused: decode/fused_ops.py)
                     and the shared experts, where the family has them
    experts l        the routed experts (the injected operator), residual
    head             final norm, lm_head -> logits (1, V); the cache lengths move on by one
A piece is `capturable` when it launches device work only: then consecutive capturable pieces form a
segment that is captured once (a CUDA graph on the GPU, `ReplayCapture` as its CPU twin) and replayed
at every step. Expert operators say whether their decode forward is capturable through
`decode_capturable()`: offloaded layers are, where the offload runtime serves them from its slab
table (vismmoe_kt.runtime.decode_table), so such a step is one graph and its only host read is the
sampled token. Those that are not (the hybrid CPU path, a lookahead predictor, ReaLB's controller)
run eagerly between segments. The step hooks (`hooks`) run around every step, graphed or not: the
offload runtime keeps its cache there, between steps.

The first graphed step captures, then checks the graphed logits against an eager run of the same
step (tolerance: a few units of the dtype's rounding); on a mismatch it captures once more, and after
a second mismatch or a capture error it goes back to eager pieces and says why (`stats()`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Hashable

import torch
from torch import nn

from ..core.context_parts import RoutingTable
from ..models import ModelAdapter
from .fused_ops import rms_norm, route
from .graphs import State, capture_backend
from .static_cache import CacheFullError, StaticKVCache


@dataclass
class Piece:
    name: str
    run: Callable[[State], State]
    capturable: bool
    layer: int | None = None
    kind: str = ""  # embed | attention | experts | head: the profile's columns


@dataclass
class Segment:
    pieces: list[Piece]
    capturable: bool
    inputs: State = ()          # captured segments: the tensors the capture reads
    outputs: State = ()         # ... and the ones it writes
    replay: Callable[[], None] | None = None


@dataclass
class LeanCounters:
    steps: int = 0
    graphed_steps: int = 0
    segments_captured: int = 0
    capture_failures: int = 0
    check_failures: int = 0          # graphed logits that differed from the eager step: graphs turned off
    check_retries: int = 0           # captures repeated after a differing self-check
    check_max_difference: float = 0.0  # largest graphed-vs-eager logit difference the self-checks saw
    reason_eager: str = ""
    profile: dict[str, dict[str, float]] = field(default_factory=dict)  # piece kind -> layer -> seconds
    profile_steps: int = 0


CHECK_RETRIES = 1  # captures again after a failed self-check, before decode goes eager for good


def logits_difference(graphed: torch.Tensor, eager: torch.Tensor) -> tuple[float, float]:
    """(largest difference, tolerance): a few units of the dtype's rounding at the logits' scale. The
    expert kernels are deterministic, so a correct graph differs by library-level reordering at most."""
    scale = eager.float().abs().max().clamp(min=1.0)
    tolerance = 8 * torch.finfo(eager.dtype).eps * scale
    return float((graphed.float() - eager.float()).abs().max()), float(tolerance)


def norm_fn(adapter: ModelAdapter, norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fused RMSNorm where the adapter says the module is one, else the module itself."""
    params = adapter.rms_norm_params(norm)
    if params is None:
        return norm
    weight, eps = params
    return lambda x: rms_norm(weight, eps, x)


def router_fn(adapter: ModelAdapter, gate: nn.Module, probabilities: bool = False) -> Callable[[torch.Tensor], tuple]:
    """(weights, expert ids): the fused top-k router where the adapter allows it, else the module's;
    with `probabilities`, also its probabilities over every expert (T, E): the adapter's (a softmax, or
    a sigmoid scorer's)."""
    params = adapter.fused_router(gate)
    if params is not None:
        weight, top_k = params
        return lambda x: route(weight, top_k, x, probabilities)
    if probabilities:
        def run(x: torch.Tensor) -> tuple:
            logits, weights, ids = gate(x)
            return weights, ids, adapter.router_probabilities(logits)
        return run
    return lambda x: gate(x)[1:]


def experts_capturable(experts: nn.Module, probe_name: str = "decode_capturable") -> bool:
    probe = getattr(experts, probe_name, None)
    return bool(probe()) if callable(probe) else False  # unknown modules may sync or branch on the host


class LeanDecodeStep:
    def __init__(self, text_model: nn.Module, adapter: ModelAdapter, lm_head: nn.Module, cache: StaticKVCache,
                 graphs: str = "auto", visual_flag: Callable[[torch.Tensor], None] | None = None,
                 hooks: list[tuple[Callable[[], None], Callable[[], None]]] | None = None,
                 routing: RoutingTable | None = None, graph_pool: Any = None,
                 router_sink: Callable[[int, torch.Tensor], None] | None = None,
                 variants: list[Callable[[], Hashable]] | None = None):
        self.text, self.adapter, self.lm_head, self.cache = text_model, adapter, lm_head, cache
        # (MoE index, (1, E) probabilities): the router's full softmax at each MoE layer, for an offload
        # cache that ranks experts by it (device ops only: part of the captured step)
        self.router_sink = router_sink
        self.routing = routing if routing is not None and routing.replaces else None  # a routing source's table
        # (before, after) callables around every step, e.g. expert parallelism announcing it to the
        # other ranks; a list shared with the decoder, so hooks added later apply too
        self.hooks = hooks if hooks is not None else []
        # what the step's launches depend on beyond its tensors (read after the hooks' `before`): one
        # capture per distinct answer, e.g. with and without the hybrid mode's CPU calls. The captures
        # share the engine's graph pool, so one may reuse memory another freed: safe while no two
        # replay at once and no caller keeps a step's outputs (the logits) past the next step
        self.variants = variants if variants is not None else []
        self._captured: dict[tuple, list[Segment]] = {}
        device = cache.device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)    # the step's input
        self.rope_delta = torch.zeros(1, dtype=torch.long, device=device)  # M-RoPE: position = length + delta
        self.not_visual = torch.zeros(1, dtype=torch.bool, device=device)
        self.visual_flag = visual_flag
        self.embed = adapter.token_embedding(text_model)
        self.pieces = self._build_pieces()
        self.backend = capture_backend(graphs, device, graph_pool)
        self.segments: list[Segment] | None = None
        self.counters = LeanCounters()
        self.profiling = False

    # --- pieces -----------------------------------------------------------------------------------
    def _build_pieces(self) -> list[Piece]:
        text, cache, adapter = self.text, self.cache, self.adapter
        layers = adapter.layers_of(text)
        pieces = [Piece("embed", self._embed, True, kind="embed")]
        for index, layer in enumerate(layers):
            experts = adapter.experts(layer)
            pieces.append(Piece(f"attention {index}", self._attention(index, layer, experts is not None), True, index,
                                "attention"))
            if experts is not None:
                pieces.append(Piece(f"experts {index}", self._experts(experts), self._experts_capturable(experts),
                                    index, "experts"))
        pieces.append(Piece("head", self._head(norm_fn(adapter, adapter.final_norm(text))), True, kind="head"))
        if len(layers) != cache.num_layers:
            raise ValueError(f"the cache has {cache.num_layers} layers, the model {len(layers)}")
        return pieces

    @staticmethod
    def _experts_capturable(experts: nn.Module) -> bool:
        return experts_capturable(experts)

    @staticmethod
    def _layer_mask(masks: torch.Tensor, index: int) -> torch.Tensor:
        return masks[index:index + 1]  # (1, 1, 1, C): the one row's

    def _embed(self, state: State) -> State:
        hidden = self.embed(self.token)
        position = (self.cache.lengths[0] + self.rope_delta).view(1, 1, 1).expand(self.adapter.position_rows(), 1, 1)
        cos, sin = self.adapter.rotary(self.text, hidden, position)
        return hidden, cos, sin, self.cache.decode_masks(hidden.dtype)

    def _attention(self, index: int, layer: nn.Module, moe: bool) -> Callable[[State], State]:
        cache, adapter = self.cache, self.adapter
        norm_in = norm_fn(adapter, adapter.input_norm(layer))
        norm_post = norm_fn(adapter, adapter.post_attention_norm(layer))
        attention, mlp = adapter.attention(layer), adapter.feed_forward(layer)
        moe_index = self._moe_index(index) if moe else None
        router = self._router(moe_index, layer) if moe else None
        shared = adapter.shared_experts(layer) if moe else None  # dense experts every token runs (GLM)

        def run(state: State) -> State:
            hidden, cos, sin, masks = state[0], *state[-3:]
            attended, _ = attention(hidden_states=norm_in(hidden), position_embeddings=(cos, sin),
                                    attention_mask=self._layer_mask(masks, index), past_key_values=cache)
            hidden = hidden + attended
            normed = norm_post(hidden)
            if not moe:
                return hidden + mlp(normed), cos, sin, masks
            flat = normed.view(-1, normed.shape[-1])
            weights, chosen, *probabilities = router(flat)
            if probabilities:
                self.router_sink(moe_index, probabilities[0])
            if shared is not None:  # the experts piece adds the routed experts' output on top
                hidden = hidden + shared(normed)
            return hidden, flat, chosen, weights, cos, sin, masks
        return run

    def _router(self, moe_index: int, layer: nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The layer's router, or the routing source's row for the step's position (read on the device:
        the step stays capturable)."""
        probabilities = self.router_sink is not None
        if self.routing is None:
            return router_fn(self.adapter, self.adapter.router(layer), probabilities)
        position = self.cache.lengths[:1]  # a view: moves with the cache
        if probabilities:
            return lambda x: (*self.routing.decode_route(moe_index, position),
                              self.routing.decode_probabilities(moe_index, position))
        return lambda x: self.routing.decode_route(moe_index, position)

    def _moe_index(self, index: int) -> int:
        """The MoE layer's index among the MoE layers (the offload runtime's row)."""
        layers = self.adapter.layers_of(self.text)
        return sum(1 for i in range(index) if self.adapter.experts(layers[i]) is not None)

    @staticmethod
    def _experts(experts: nn.Module) -> Callable[[State], State]:
        def run(state: State) -> State:
            hidden, flat, chosen, weights, cos, sin, masks = state
            return hidden + experts(flat, chosen, weights).view_as(hidden), cos, sin, masks
        return run

    def _head(self, norm: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[State], State]:
        def run(state: State) -> State:
            logits = self.lm_head(norm(state[0]))[:, -1]
            self.cache.advance_on_device()
            return (logits,)
        return run

    # --- segments -----------------------------------------------------------------------------------
    def _group(self) -> list[Segment]:
        segments: list[Segment] = []
        for piece in self.pieces:
            if segments and segments[-1].capturable == piece.capturable:
                segments[-1].pieces.append(piece)
            else:
                segments.append(Segment([piece], piece.capturable))
        return segments

    @staticmethod
    def _run_pieces(pieces: list[Piece], state: State) -> State:
        for piece in pieces:
            state = piece.run(state)
        return state

    def _eager_step(self) -> torch.Tensor:
        if self.profiling:
            return self._profiled_step()
        return self._run_pieces(self.pieces, ())[0]

    def _capture(self) -> torch.Tensor:
        """Capture every capturable segment while running the step for real (segment by segment:
        each capture needs the real inputs its predecessor produced)."""
        segments = self._group()
        state: State = ()
        for segment in segments:
            if not segment.capturable:
                state = self._run_pieces(segment.pieces, state)
                continue
            segment.inputs = state
            lengths = self.cache.lengths.clone()  # warm-up and capture may run the head's `advance`
            segment.replay, segment.outputs = self.backend.capture(
                lambda s=segment: self._run_pieces(s.pieces, s.inputs))
            self.cache.lengths.copy_(lengths)
            segment.replay()
            state = segment.outputs
            self.counters.segments_captured += 1
        self.segments = segments
        return state[0]

    def _replay(self) -> torch.Tensor:
        state: State = ()
        for segment in self.segments:
            if not segment.capturable:
                state = self._run_pieces(segment.pieces, state)
                continue
            for fixed, fresh in zip(segment.inputs, state):
                if fixed is not fresh:
                    fixed.copy_(fresh)
            segment.replay()
            state = segment.outputs
        return state[0]

    def _graphed_step(self) -> torch.Tensor:
        key = tuple(variant() for variant in self.variants)
        self.segments = self._captured.get(key)
        if self.segments is not None:
            return self._replay()
        lengths = self.cache.lengths.clone()
        for attempt in range(1 + CHECK_RETRIES):
            self.cache.lengths.copy_(lengths)
            try:
                logits = self._capture().clone()
            except Exception as exc:  # a piece that cannot be captured: eager from now on, and say why
                self._give_up_graphs(f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                self.counters.capture_failures += 1
                self.cache.lengths.copy_(lengths)
                return self._eager_step()
            after = self.cache.lengths.clone()
            self.cache.lengths.copy_(lengths)  # the same step again, eagerly: the graphs must agree with it
            reference = self._announced(self._eager_step)  # a second run is a second step to the hooks
            self.cache.lengths.copy_(after)
            difference, tolerance = logits_difference(logits, reference)
            self.counters.check_max_difference = max(self.counters.check_max_difference, difference)
            if difference <= tolerance:
                if tuple(variant() for variant in self.variants) != key:  # the variant moved under the check:
                    self.segments = None  # do not file this capture under either key
                    return reference
                self._captured[key] = self.segments
                return logits
            self.segments = None  # capture again once: a transient difference should not cost the graphs
            self._captured.clear()  # the backend drops every graph it holds, the other variants' too
            self.backend.reset()
            if attempt < CHECK_RETRIES:
                self.counters.check_retries += 1
        self.counters.check_failures += 1
        self._give_up_graphs(f"graphed logits differ from the eager step by {difference:.3g} "
                             f"(tolerance {tolerance:.3g}), after {1 + CHECK_RETRIES} captures")
        return reference

    def _announced(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`run()` between the hooks' before and after calls (after ones also when it raises)."""
        entered = []
        try:
            for before, after in list(self.hooks):
                before()
                entered.append(after)
            return run()
        finally:
            for after in reversed(entered):
                after()

    def _give_up_graphs(self, reason: str) -> None:
        warnings.warn(f"decode runs without graphs: {reason}", RuntimeWarning, stacklevel=3)
        self.backend, self.segments = None, None
        self._captured.clear()
        self.counters.reason_eager = reason

    # --- the step -----------------------------------------------------------------------------------
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Logits (1, V) for the next position, given the last token (1, 1) or (1,)."""
        if self.cache.room() < 1:
            raise CacheFullError(f"the decode cache is full ({self.cache.capacity} positions)")
        self.token.copy_(token.view(1, 1))
        if self.visual_flag is not None:
            self.visual_flag(self.not_visual)
        self.cache.decoding = True
        try:
            if self.backend is None or self.profiling:
                logits = self._announced(self._eager_step)
            else:
                logits = self._announced(self._graphed_step)
        finally:
            self.cache.decoding = False
        self.cache.advance_on_host()
        self.counters.steps += 1
        self.counters.graphed_steps += self.segments is not None
        return logits

    # --- profile ------------------------------------------------------------------------------------
    def _profiled_step(self) -> torch.Tensor:
        """Eager, each piece timed to its end (a device sync after each: slower, for the breakdown)."""
        sync = torch.cuda.synchronize if self.cache.device.type == "cuda" else (lambda: None)
        state: State = ()
        for piece in self.pieces:
            sync()
            start = time.perf_counter()
            state = piece.run(state)
            sync()
            column = self.counters.profile.setdefault(piece.kind, {})
            key = "-" if piece.layer is None else str(piece.layer)
            column[key] = column.get(key, 0.0) + time.perf_counter() - start
        self.counters.profile_steps += 1
        return state[0]

    def stats(self) -> dict[str, Any]:
        out = asdict(self.counters)
        out.pop("profile")
        out.pop("profile_steps")
        if not out["reason_eager"]:
            out.pop("reason_eager")
        out["graphs"] = self.backend.name if self.backend is not None else "off"
        # pieces that run between segments (or all of them, without graphs)
        out["eager_pieces_per_step"] = len(self.pieces) if self.segments is None else \
            sum(len(s.pieces) for s in self.segments if not s.capturable)
        out["capturable_pieces"] = sum(p.capturable for p in self.pieces)
        out["pieces"] = len(self.pieces)
        return out
