"""One decode step of the text model for B sequences, owned by us: slot cache, no host logic between MoE layers.

Shapes: B sequences in the step (R rows: B, or padded to a power of two), H hidden, V vocabulary, span the
positions the step attends to, K experts per token. A single request is a step of one row.

The step is a list of pieces, each a function from a tuple of tensors to the next tuple:
    embed            tokens -> hidden, rotary cos/sin of each row's next position, the layers' masks
    attention l      the residual of the layer before and the input norm, attention over layer l's static
                     cache, residual, post-attention norm, and for an MoE layer the router and the shared
                     experts, where the family has them (attention, adds with their norms, router fused:
                     fused_attention.py, fused_ops.py)
    experts l        the routed experts (the injected operator): their output is the next norm's residual
    head             the last residual and final norm, lm_head -> logits (R, V); the rows' cache lengths
                     move on by one
A piece is capturable for R rows when it launches device work only: then consecutive capturable pieces
form a segment that is captured once per (R, span) and what the step depends on beyond its tensors
(`variants`), on the GPU a CUDA graph (`ReplayCapture` as its CPU twin), and replayed at every step of
that shape. Expert operators say whether their decode forward is capturable through
`decode_capturable()` (one row) and `batch_capturable()` (several): offloaded layers are, where the
offload runtime serves them from its slab table (vismmoe_kt.runtime.decode_table), so such a step is one
graph and its only host read is the sampled tokens. Those that are not (the hybrid CPU path, a lookahead
predictor, ReaLB's controller, the placement path of several rows) run eagerly between segments, on the
real rows only. The expert runtime's step hooks run around every step, graphed or not: the offload
runtime binds the executor for the step's rows there and keeps its cache between steps
(core/expert_runtime.py).

With graphs, a step of B rows runs as R = the next power of two of B (padding rows read and write the
cache's pad slot), or R = B where offloaded layers look experts up row by row in the decode table (a
padding row would fetch experts for nobody).

The first graphed step captures, then checks the graphed logits against an eager run of the same
step (tolerance: a few units of the dtype's rounding); on a mismatch it captures once more, and after
a second mismatch or a capture error it goes back to eager pieces and says why (`stats()`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..core.context import LoadContext
from ..core.model_pass import ModelPass
from ..models import ModelAdapter
from .fused_attention import FusedDecodeAttention, fusable
from .fused_ops import add_rms_norm, rms_norm, route
from .graphs import State, capture_backend
from .slot_cache import SlotKVCache


@dataclass
class Piece:
    name: str
    run: Callable[[State], State]
    capturable: bool             # in a step of one row
    batch_capturable: bool       # ... of several rows
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


def add_norm_fn(adapter: ModelAdapter, norm: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """(x + residual, the norm of it): one fused kernel where the adapter says the norm is an RMSNorm."""
    params = adapter.rms_norm_params(norm)
    if params is None:
        def run(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            total = x + residual
            return total, norm(total)
        return run
    weight, eps = params
    return lambda x, residual: add_rms_norm(weight, eps, x, residual)


def attention_fn(adapter: ModelAdapter, attention: nn.Module, cache: SlotKVCache) -> Callable[..., torch.Tensor]:
    """(hidden, cos, sin, mask) -> the attention's output: four kernels where the adapter describes the
    attention (fused_attention.py), else the module itself over the slot cache."""
    parts = adapter.decode_attention_parts(attention)
    if fusable(parts):
        return FusedDecodeAttention(parts, cache)
    return lambda hidden, cos, sin, mask: attention(hidden_states=hidden, position_embeddings=(cos, sin),
                                                    attention_mask=mask, past_key_values=cache)[0]


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
            if logits is None:  # a routing source with no probabilities to hand (none are averaged any more)
                return weights, ids
            return weights, ids, adapter.router_probabilities(logits)
        return run
    return lambda x: gate(x)[1:]


def experts_capturable(experts: nn.Module, probe_name: str) -> bool:
    probe = getattr(experts, probe_name, None)
    return bool(probe()) if callable(probe) else False  # unknown modules may sync or branch on the host


class DecodeStep:
    """One decode token for each of B sequences in a SlotKVCache (`step(slots, tokens, rope_deltas)`)."""

    def __init__(self, text_model: nn.Module, adapter: ModelAdapter, lm_head: nn.Module, cache: SlotKVCache,
                 context: LoadContext, graphs: str = "auto", graph_pool: Any = None):
        self.text, self.adapter, self.lm_head, self.cache, self.context = text_model, adapter, lm_head, cache, context
        self.rows = self.real_rows = 1
        runtime = context.offload_runtime
        # (before, after) around every step: the expert runtime binds the executor for the step's rows and
        # keeps its cache; expert parallelism announces the step (padding rows too) to the group
        self.hooks: list[tuple[Callable[[], None], Callable[[], None]]] = []
        # each row looks its experts up in the runtime's table: a padding row would fetch experts nobody asked for
        self.exact_rows = runtime is not None and runtime.batch_needs_exact_rows()
        # (MoE index, (R, E) probabilities): each router's full softmax, for an offload cache that ranks
        # experts by it (device ops only: part of the captured step)
        self.router_sink = runtime.router_sink() if runtime is not None else None
        if runtime is not None:
            runtime.prepare_steps(cache.max_rows)
            self.hooks.append((lambda: runtime.begin_step(self.rows), runtime.end_step))
        self.hooks.append(context.ep_step_hook(lambda: self.rows))
        self.model_pass = ModelPass(decode=cache, cache=cache)  # what the step computes, for operators keyed by position
        # what the step's launches depend on beyond its tensors (read after the hooks' `before`): one capture
        # per distinct answer, e.g. with and without the hybrid mode's CPU calls (the context's list: variants
        # added later apply too). The captures share the graph pool, so one may reuse memory another freed:
        # safe while no two replay at once and no caller keeps a step's outputs (the logits) past the next step
        self.variants = context.graph_variants
        self._captured: dict[tuple, list[Segment]] = {}
        rows, device = cache.max_rows, cache.device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)       # the captures' inputs
        self.deltas = torch.zeros(rows, dtype=torch.long, device=device)          # M-RoPE: position = length + delta
        self.not_visual = torch.zeros(rows, dtype=torch.bool, device=device)
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
        pieces = [Piece("embed", self._embed, True, True, kind="embed")]
        moe_index = 0
        for index, layer in enumerate(layers):
            experts = adapter.experts(layer)
            moe = moe_index if experts is not None else None
            pieces.append(Piece(f"attention {index}", self._attention(index, layer, moe), True, True, index,
                                "attention"))
            if experts is not None:
                one, several = experts_capturable(experts, "decode_capturable"), \
                    experts_capturable(experts, "batch_capturable")
                pieces.append(Piece(f"experts {index}", self._experts(experts, several), one, several, index,
                                    "experts"))
                moe_index += 1
        pieces.append(Piece("head", self._head(add_norm_fn(adapter, adapter.final_norm(text))), True, True, kind="head"))
        if len(layers) != cache.num_layers:
            raise ValueError(f"the cache has {cache.num_layers} layers, the model {len(layers)}")
        return pieces

    def _embed(self, state: State) -> State:
        rows = self.rows
        hidden = self.embed(self.tokens[:rows])                                   # (R, 1, H)
        position = self.cache.lengths[0, self.cache.active] + self.deltas[:rows]  # the prefix layer holds every position
        cos, sin = self.adapter.rotary(self.text, hidden, position.view(1, -1, 1).expand(self.adapter.position_rows(), -1, 1))
        return hidden, cos, sin, self.cache.decode_masks(hidden.dtype)            # masks (L, R, 1, 1, span)

    def _attention(self, index: int, layer: nn.Module, moe_index: int | None) -> Callable[[State], State]:
        """A layer's state in: (hidden, cos, sin, masks) from the embedding for the first layer, else
        (hidden, residual, cos, sin, masks) from the layer before, whose MLP output (`residual`) is added
        in this layer's input norm kernel (add_norm_fn: one launch for the add and the norm)."""
        cache, adapter = self.cache, self.adapter
        if index == 0:
            norm = norm_fn(adapter, adapter.input_norm(layer))
            norm_in = lambda state: (state[0], norm(state[0]))  # noqa: E731
        else:
            add_norm = add_norm_fn(adapter, adapter.input_norm(layer))
            norm_in = lambda state: add_norm(state[0], state[1])  # noqa: E731
        add_norm_post = add_norm_fn(adapter, adapter.post_attention_norm(layer))
        attention, mlp = attention_fn(adapter, adapter.attention(layer), cache), adapter.feed_forward(layer)
        moe = moe_index is not None
        router = router_fn(adapter, adapter.router(layer), self.router_sink is not None) if moe else None
        sink = self.router_sink
        shared = adapter.shared_experts(layer) if moe else None  # dense experts every token runs (GLM)

        def run(state: State) -> State:
            cos, sin, masks = state[-3:]
            hidden, normed = norm_in(state)
            hidden, normed = add_norm_post(hidden, attention(normed, cos, sin, masks[index]))
            if not moe:
                return hidden, mlp(normed), cos, sin, masks
            flat = normed.view(-1, normed.shape[-1])
            weights, chosen, *probabilities = router(flat)
            if probabilities:
                sink(moe_index, probabilities[0])
            if shared is not None:  # the experts piece adds the routed experts' output on top
                hidden = hidden + shared(normed)
            return hidden, flat, chosen, weights, cos, sin, masks
        return run

    def _experts(self, experts: nn.Module, batch_capturable: bool) -> Callable[[State], State]:
        def run(state: State) -> State:
            hidden, flat, chosen, weights, cos, sin, masks = state
            rows = self.real_rows
            if batch_capturable or rows == flat.shape[0]:
                out = experts(flat, chosen, weights)
            else:  # eager, between graphs: padding rows would add their experts to the step's fetches
                out = torch.zeros_like(flat)
                out[:rows] = experts(flat[:rows], chosen[:rows], weights[:rows])
            return hidden, out.view_as(hidden), cos, sin, masks  # the next norm adds `out`
        return run

    def _head(self, add_norm: Callable[[torch.Tensor, torch.Tensor], tuple]) -> Callable[[State], State]:
        def run(state: State) -> State:
            logits = self.lm_head(add_norm(state[0], state[1])[1])[:, -1]
            self.cache.advance_on_device()
            return (logits,)
        return run

    # --- segments -----------------------------------------------------------------------------------
    def _capturable(self, piece: Piece) -> bool:
        return piece.capturable if self.rows == 1 else piece.batch_capturable

    def _group(self) -> list[Segment]:
        segments: list[Segment] = []
        for piece in self.pieces:
            capturable = self._capturable(piece)
            if segments and segments[-1].capturable == capturable:
                segments[-1].pieces.append(piece)
            else:
                segments.append(Segment([piece], capturable))
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
        key = self._variant()
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
                if self._variant() != key:  # the variant moved under the check:
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
    def _variant(self) -> tuple:
        return (self.rows, self.cache.span, self.cache.contiguous, *(variant() for variant in self.variants))

    def __call__(self, slots: list[int], tokens: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        """(B,) last tokens and M-RoPE deltas of the sequences in `slots` -> (B, V) logits; the rows move on."""
        b = self.real_rows = len(slots)
        self.rows = b if self.backend is None or self.exact_rows else 1 << (b - 1).bit_length()
        self.cache.begin_decode(slots, self.rows)
        self.tokens[:b, 0].copy_(tokens.view(-1))
        self.deltas[:b].copy_(rope_deltas.view(-1))
        if self.rows > b:  # padding rows
            self.tokens[b:self.rows].zero_()
            self.deltas[b:self.rows].zero_()
        # decode tokens are text: what the operators that treat visual tokens apart read from the context
        self.context.token_is_visual = self.not_visual[:self.rows]
        self.context.model_pass = self.model_pass
        try:
            eager = self.backend is None or self.profiling
            logits = self._announced(self._eager_step if eager else self._graphed_step)
        except BaseException:
            self.cache.abandon_step()
            raise
        finally:
            self.context.model_pass = None
        self.cache.advance_on_host()
        self.counters.steps += 1
        self.counters.graphed_steps += self.segments is not None
        return logits[:b]

    def chainable(self, sequences: int) -> bool:
        """Whether a step of these many rows may be queued before the host reads the one before it
        (steps_ahead.py): every piece device work only, no expert-parallel group to tell of steps."""
        runtime = self.context.offload_runtime
        if self.context.ep_step_hooks or (runtime is not None and not runtime.steps_chainable()):
            return False
        return all(p.capturable if sequences == 1 else p.batch_capturable for p in self.pieces)

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
        out["captured_shapes"] = sorted({key[:2] for key in self._captured})  # (rows, span), once each
        out["capturable_pieces"] = sum(self._capturable(p) for p in self.pieces)
        out["pieces"] = len(self.pieces)
        return out
