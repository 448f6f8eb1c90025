"""Which experts each token goes to: the model's own router, or a routing source that replaces it.

Benchmarks run full-size shapes with random weights, whose routers choose near-uniformly (and greedy
decoding repeats one token, so every step routes alike): no offloading policy can be judged on that.
A routing source replaces the router's choice per token and MoE layer while every expert still
computes on the real weights, so timing stays real and only the choice of experts changes:

    model           the router's own top-k (nothing is replaced; `record=True` keeps what it chose)
    synthetic[:S]   vismmoe_kt.routing's calibrated synthetic router, request i from seed S + i
    trace:PATH      replay a recorded trace (vismmoe_kt.routing.load_trace formats), request by request

Per request the source builds one table for every position of the request, prompt and decode
(ids (N, L, k), weights (N, L, k)), independent of the generated tokens. The prefill takes its rows
by position through forward hooks on the routers (`adapter.with_routing` rebuilds the router's
output); the decode engine reads the row of the step's position on the device, so a captured decode
step replays with the table's next row and no host work. Rows of a pruned prefill (fewer tokens
after the prefix) are the kept positions (`context.pruning.keep`).

Batched generation (batched.py) gives each KV slot a table of its own (`reserve_slots`): a request's
`begin(..., slot=s)` fills slot s's rows, its prefill reads them, and a batched step's router reads
each row's own slot at its own position (`batch_decode_route`, on the device). Prompts prefilled
together (right-padded to one length) read their own slots' rows through `begin_rows`; padding
tokens read the padding table (expert 0 at weight 0).

A synthetic source also keeps the latent state each router read (N, L, D): `latent(index)` is its
mean over the positions layer `index` routed last (the prompt's in a prefill, the step's position
in decode, read on the device). A lookahead predictor calibrated on synthetic routing
(`hidden_source: synthetic`) reads it where a trained model's predictor reads the hidden state:
the random-weight model's own hidden states say nothing about synthetic routing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.context import LoadContext
from ..errors import InputError
from ..models import ModelAdapter

MODES = ("model", "synthetic", "trace")
HISTORY = 64  # requests whose tables stay for the benchmark's Belady figures (a long run must not grow without end)


def parse_spec(spec: str) -> tuple[str, Any]:
    """`model` | `synthetic` | `synthetic:SEED` | `trace:PATH` -> (mode, argument)."""
    mode, _, argument = spec.partition(":")
    if mode == "model" and not argument:
        return "model", None
    if mode == "synthetic":
        if argument and not argument.lstrip("-").isdigit():
            raise InputError(f"--routing {spec}: synthetic:SEED needs a whole number")
        return "synthetic", int(argument or 0)
    if mode == "trace" and argument:
        return "trace", argument
    raise InputError(f"--routing {spec!r}: expected model, synthetic, synthetic:SEED or trace:PATH")


class RoutingSource:
    def __init__(self, mode: str, adapter: ModelAdapter, config: Any, context: LoadContext, seed: int = 0,
                 trace: Any = None, record: bool = False):
        if mode not in MODES:
            raise InputError(f"routing {mode!r} is not one of: {', '.join(MODES)}")
        shape = adapter.moe_shape(config)
        self.mode, self.adapter, self.config, self.context = mode, adapter, config, context
        self.moe_layers = list(shape.moe_layers)
        self.layers, self.experts, self.top_k = len(self.moe_layers), shape.num_experts, shape.top_k
        self.seed, self.trace, self.record = seed, trace, record
        if trace is not None:
            if trace.layers != self.layers or trace.top_k != self.top_k or int(trace.ids.max()) >= self.experts:
                raise InputError(f"the routing trace has {trace.layers} layers x top-{trace.top_k} (ids up to "
                                 f"{int(trace.ids.max())}); this model has {self.layers} MoE layers x "
                                 f"{self.experts} experts, top-{self.top_k}")
            self._trace_cursor = 0
        self.ids: torch.Tensor | None = None      # (capacity, L, k) long, on the model's device
        self.weights: torch.Tensor | None = None  # (capacity, L, k)
        self.latents: torch.Tensor | None = None  # (capacity, L, D) float32, synthetic mode only
        self.probabilities: torch.Tensor | None = None  # (capacity, L, E) float32: each router's full softmax
        self._routed_at: dict[int, torch.Tensor] = {}  # MoE layer index -> the positions it routed last
        self.requests = 0
        self.history: list[dict[str, Any]] = []   # per request: ids (N, L, k) on the host, prompt length
        self._start = self._prompt = 0
        self._next: list[int] = []
        self._recorded: dict[int, list[torch.Tensor]] = {}
        # batched generation: per KV slot (and one for padding rows), (S + 1, capacity, L, k) tables
        self.slot_ids: torch.Tensor | None = None
        self.slot_weights: torch.Tensor | None = None
        self._slot: int | None = None  # the slot whose prefill runs now (None: the single-request table)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # begin_rows: (slot, position) per token
        self._primary_rows: dict[int, torch.Tensor | None] = {}  # MoE layer index -> its tokens that reach the router
        self._prepared: tuple | None = None  # (key, table) that `prepare` made for the next request

    @property
    def replaces(self) -> bool:
        return self.mode != "model"

    # --- per request ---------------------------------------------------------------------------
    def reserve(self, positions: int, device: torch.device, dtype: torch.dtype, latent_dim: int = 0) -> None:
        """Table buffers for `positions` positions (fixed addresses: captured decode steps read them)."""
        if self.ids is None or self.ids.shape[0] < positions or self.ids.device != torch.device(device):
            self.ids = torch.zeros(positions, self.layers, self.top_k, dtype=torch.long, device=device)
            self.weights = torch.zeros(positions, self.layers, self.top_k, dtype=dtype, device=device)
            self.latents = None
            self.probabilities = torch.zeros(positions, self.layers, self.experts, device=device)
        if latent_dim and (self.latents is None or self.latents.shape[2] != latent_dim):
            self.latents = torch.zeros(self.ids.shape[0], self.layers, latent_dim, device=device)

    def reserve_slots(self, slots: int, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        """Tables for batched generation: `slots` KV slots of `capacity` positions, and a padding row's
        (all zeros: expert 0 with weight 0)."""
        shape = (slots + 1, capacity, self.layers, self.top_k)
        if self.slot_ids is None or self.slot_ids.shape != shape or self.slot_ids.device != torch.device(device):
            self.slot_ids = torch.zeros(shape, dtype=torch.long, device=device)
            self.slot_weights = torch.zeros(shape, dtype=dtype, device=device)

    def begin(self, input_ids: torch.Tensor, max_new_tokens: int, start: int = 0, slot: int | None = None) -> None:
        """A request: prompt `input_ids` (1, T), of which the first `start` are in the cache already;
        `slot`: batched generation's KV slot, whose table it fills (reserve_slots) instead of the single one."""
        prompt = int(input_ids.shape[1])
        self._start, self._prompt = start, prompt
        self._next = [start] * self.layers
        self._recorded = {}
        self._slot = slot
        if not self.replaces:
            return
        total = prompt + max_new_tokens
        visual = self.adapter.image_token_mask(self.config, input_ids[0]).cpu()
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == self._table_key(total, visual):
            ids, weights, latents, probabilities = prepared[1]
        else:
            ids, weights, latents, probabilities = self._table(total, visual)
        if slot is not None:
            if self.slot_ids is None or not 0 <= slot < self.slot_ids.shape[0] - 1 or total > self.slot_ids.shape[1]:
                raise ValueError(f"slot {slot} with {total} positions: reserve_slots made "
                                 f"{None if self.slot_ids is None else tuple(self.slot_ids.shape[:2])}")
            self.slot_ids[slot, :total].copy_(ids.to(self.slot_ids.device))
            self.slot_weights[slot, :total].copy_(weights.to(device=self.slot_weights.device,
                                                             dtype=self.slot_weights.dtype))
            self._count(ids, prompt)
            return
        device = input_ids.device
        dtype = self.weights.dtype if self.weights is not None else torch.float32
        self.reserve(total, device, dtype, latents.shape[2] if latents is not None else 0)
        self.ids[:total].copy_(ids.to(device))
        self.weights[:total].copy_(weights.to(device=device, dtype=self.weights.dtype))
        if latents is not None:
            self.latents[:total].copy_(latents.to(device=device, dtype=torch.float32))
        self.probabilities[:total].copy_(probabilities.to(device))
        self._count(ids, prompt)

    def prepare(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        """Make the next request's table now (`begin` then takes it as it is): a benchmark does this before
        its clock starts, so a prefill's time is the model's, not the synthetic router's (tens of ms a prompt)."""
        if self.mode != "synthetic":  # a trace's rows are cheap to cut, and cutting them moves its cursor
            return
        total = int(input_ids.shape[1]) + max_new_tokens
        visual = self.adapter.image_token_mask(self.config, input_ids[0]).cpu()
        self._prepared = (self._table_key(total, visual), self._table(total, visual))

    def _table_key(self, total: int, visual: torch.Tensor) -> tuple:
        """What a request's table depends on: its seed (the request count), length and visual positions."""
        return self.requests, total, visual.numpy().tobytes()

    def _count(self, ids: torch.Tensor, prompt: int) -> None:
        """A request's table made: kept for the benchmark's Belady figures; the next request's seed moves on."""
        self.history.append({"ids": ids, "prompt": prompt})
        del self.history[:-HISTORY]
        self.requests += 1

    def end_slot_prefill(self) -> None:
        """After a batched request's prefill (or a chunk of it, or a group's): the routers' hooks read
        the single-request table again."""
        self._slot, self._rows = None, None

    def begin_rows(self, slots: list[int], lengths: list[int], width: int) -> None:
        """A prefill of several prompts at once, each `begin(..., slot=)`-ed, right-padded to `width`
        tokens: token t of row b reads slot `slots[b]`'s table at position t, padding the padding table."""
        if not self.replaces:
            return
        device = self.slot_ids.device
        positions = torch.arange(width, device=device).repeat(len(slots), 1)                     # (B, width)
        real = positions < torch.tensor(lengths, device=device)[:, None]
        rows = torch.tensor(slots, device=device)[:, None].expand(-1, width)
        pad = self.slot_ids.shape[0] - 1
        self._rows = (torch.where(real, rows, pad).reshape(-1), torch.where(real, positions, 0).reshape(-1))

    def resume_slot_prefill(self, slot: int) -> None:
        """The next chunk of slot `slot`'s prefill: its table again, positions where the last chunk ended."""
        self._slot = slot

    def _table(self, total: int, visual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                              torch.Tensor]:
        """ids, weights, the latent states (synthetic) and each router's full probabilities, per position."""
        if self.mode == "synthetic":
            from ..routing import SyntheticRouter

            router = SyntheticRouter(self.layers, self.experts, self.top_k, seed=self.seed + self.requests)
            prompt = router.route(len(visual), visual.to(torch.uint8), "prefill")
            rest = router.route(total - len(visual), None, "decode")
            hidden = torch.cat([prompt.hidden, rest.hidden])
            modality = torch.cat([visual.to(torch.float64), torch.zeros(total - len(visual), dtype=torch.float64)])
            logits = torch.stack([router.logits(layer, hidden[:, layer], modality) for layer in range(self.layers)], 1)
            ids, probabilities = torch.cat([prompt.ids, rest.ids]), torch.softmax(logits, dim=-1).float()
            # the router's weights are its top-k renormalised (Qwen3's); a family whose router weighs its
            # choice otherwise (DeepSeek's unnormalised top-k, GLM's scaling) gets its own from the adapter
            weights = self.adapter.routing_weights(self.config, probabilities, ids)
            return ids, torch.cat([prompt.weights, rest.weights]) if weights is None else weights, hidden, probabilities
        ids, weights = self._trace_rows(total)
        # a trace holds only the choices: each chosen expert gets its routing weight, the others none
        probabilities = torch.zeros(total, self.layers, self.experts).scatter_(2, ids, weights.float())
        return ids, weights, None, probabilities

    def _trace_rows(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace's next request (its request ids; else the next `total` rows), cycled to `total` rows."""
        trace = self.trace
        if trace.request_ids is not None:
            requests = torch.unique_consecutive(trace.request_ids)
            chosen = requests[self.requests % len(requests)]
            rows = torch.nonzero(trace.request_ids == chosen, as_tuple=True)[0]
        else:
            rows = (torch.arange(total) + self._trace_cursor) % trace.tokens
            self._trace_cursor = int(rows[-1]) + 1
        rows = rows[torch.arange(total) % len(rows)]
        ids = trace.ids[rows].long()
        weights = trace.weights[rows].float() if trace.weights is not None \
            else torch.full(ids.shape, 1.0 / self.top_k)  # no weights in the file: equal shares
        return ids, weights

    def finish(self) -> torch.Tensor | None:
        """End of a request: with `record`, the router's own choices (positions, L, k) of it."""
        if not self._recorded:
            return None
        rows = [torch.cat(self._recorded[i]) for i in range(self.layers)]
        return torch.stack(rows, dim=1)

    # --- the prefill (and transformers' decode loop): hooks on the routers ------------------------
    def install(self, model: Any) -> None:
        layers = self.adapter.decoder_layers(model)
        modality = self.adapter.modality_argument()
        for index, layer in enumerate(self.moe_layers):
            self.adapter.router(layers[layer]).register_forward_hook(self._hook(index))
            if modality is not None:  # a modality-separated family: the router sees the text tokens only
                layers[layer].register_forward_pre_hook(self._modality_hook(index, modality), with_kwargs=True)

    def _modality_hook(self, index: int, name: str):
        """Keeps which of a decoder layer's tokens reach its primary (text) router: those of modality 0
        in the layer's `name` argument (None: every token, as in decode, where the model passes none)."""
        def hook(module, args, kwargs):
            modality = kwargs.get(name)
            self._primary_rows[index] = modality.reshape(-1) == 0 if modality is not None else None
        return hook

    def _hook(self, index: int):
        def hook(module, args, output):
            chosen = self.adapter.routed_experts(output)
            rows = chosen.shape[0]
            primary = self._primary_rows.pop(index, None)
            positions = self._positions(index, rows, chosen.device, primary)
            self._routed_at[index] = positions
            if self.record:
                self._recorded.setdefault(index, []).append(chosen.detach().cpu())
            if not self.replaces:
                return None
            if self._rows is not None:  # prompts prefilled together: each token its own slot's row
                slots, at = self._rows
                if primary is not None and primary.numel() == slots.numel():
                    mask = primary.to(slots.device)
                    slots, at = slots[mask], at[mask]
                if slots.numel() != rows:
                    raise RuntimeError(f"a grouped prefill of {slots.numel()} tokens routed {rows} at layer {index}")
                return self.adapter.with_routing(output, self.slot_weights[slots, at, index],
                                                 self.slot_ids[slots, at, index])
            if self._slot is not None:  # a batched request's prefill: its slot's table
                return self.adapter.with_routing(output, self.slot_weights[self._slot, positions, index],
                                                 self.slot_ids[self._slot, positions, index])
            return self.adapter.with_routing(output, self.weights[positions, index], self.ids[positions, index])
        return hook

    def _positions(self, index: int, rows: int, device: torch.device, primary: torch.Tensor | None = None) -> torch.Tensor:
        """The sequence positions of the `rows` tokens MoE layer `index`'s router saw, and the layer's next
        start moved past this call's tokens. `primary`: which of the layer's tokens reached the router
        (a modality-separated family's text router sees only the text tokens; None: all of them)."""
        start = self._next[index]
        expected = self._prompt - start if start < self._prompt else 1
        tokens = primary.numel() if primary is not None else rows  # the tokens the layer ran
        keep = self.context.pruning.keep
        if tokens < expected and keep is not None and keep.numel() == tokens:  # a pruned prefill's later layers
            positions = keep.to(device) + start
        else:
            positions = torch.arange(start, start + tokens, device=device)
            expected = tokens
        self._next[index] = start + expected
        if primary is not None:
            positions = positions[primary.to(device)]
            if positions.numel() != rows:
                raise RuntimeError(f"MoE layer {index}'s router saw {rows} tokens, but {positions.numel()} of the "
                                   f"layer's {tokens} are of its modality")
        return positions

    # --- the decode engine: the step's row, on the device ----------------------------------------
    def decode_route(self, index: int, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (1, k), ids (1, k)) of MoE layer `index` at `position` ((1,) long on the device)."""
        self._routed_at[index] = position
        return self.weights[position, index], self.ids[position, index]

    def batch_decode_route(self, index: int, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """(weights (R, k), ids (R, k)) of MoE layer `index` for a batched step's R rows: row r at
        `positions[r]` of slot `slots[r]`'s table (device tensors, read on the device)."""
        return self.slot_weights[slots, positions, index], self.slot_ids[slots, positions, index]

    def decode_probabilities(self, index: int, position: torch.Tensor) -> torch.Tensor:
        """(1, E): MoE layer `index`'s router probabilities over every expert at `position` (device)."""
        return self.probabilities[position, index]

    # --- the synthetic router's latent state, for a predictor calibrated on it ---------------------
    def latent(self, index: int) -> torch.Tensor:
        """(1, D): the latent state MoE layer `index`'s router read, averaged over the positions it
        routed last (device ops only)."""
        if self.latents is None or index not in self._routed_at:
            raise InputError("this predictor was calibrated on synthetic routing (hidden_source: synthetic): it "
                             "needs --routing synthetic, whose latent state it reads instead of the model's")
        return self.latents[self._routed_at[index], index].mean(dim=0, keepdim=True)


def install_routing(model: Any, spec: str, record: bool = False) -> RoutingSource:
    """Put a routing source (`model`, `synthetic[:SEED]`, `trace:PATH`) on a loaded model."""
    mode, argument = parse_spec(spec)
    trace = None
    if mode == "trace":
        from ..routing import TraceFormatError, load_trace

        try:
            trace = load_trace(argument)
        except (TraceFormatError, OSError) as exc:
            raise InputError(f"--routing {spec}: {exc}") from None
    info = model.vismmoe
    source = RoutingSource(mode, info.adapter, model.config, info.context, seed=argument if mode == "synthetic" else 0,
                           trace=trace, record=record)
    source.install(model)
    info.context.routing = source
    return source
