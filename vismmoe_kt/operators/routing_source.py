"""Which experts each token goes to: the model's own router, or a routing source that replaces it.

Benchmarks run full-size shapes with random weights, whose routers choose near-uniformly (and greedy
decoding repeats one token, so every step routes alike): no offloading policy can be judged on that.
A routing source replaces the router's choice per token and MoE layer while every expert still
computes on the real weights, so timing stays real and only the choice of experts changes:

    model           the router's own top-k (nothing is replaced; `record=True` keeps what it chose)
    synthetic[:S]   vismmoe_kt.routing's calibrated synthetic router, request i from seed S + i
    synthetic[:S]:affinity=A   the same with the labelled visual-expert affinity what-if at strength A in
                    [0, 1] (routing/affinity.py; each request's image its own preference): never a default
    trace:PATH      replay a recorded trace (vismmoe_kt.routing.load_trace formats), request by request

Per request the source builds one table for every position of the request, prompt and decode
(ids (N, L, k), weights (N, L, k)), independent of the generated tokens. Its operators sit on the
routers (source_router.py: SourceRouter, put there by a rule or on a loaded model) and hand it every
router call; which request, KV slot and positions a call's tokens are it reads from the forward's
ModelPass (core/model_pass.py), which the engine publishes for whoever listens. A prefill's router
output gets its choice replaced by the rows of its tokens' positions (`adapter.with_routing`); rows
of a pruned prefill (fewer tokens after the prefix) are the kept positions (`context.pruning.keep`).

Each runner's KV slots get tables of their own (made on the runner's first prefill, before any of
its steps is captured): a request's first pass fills its slot's rows, and in a decode step each row
reads its own slot at its own position on the device, so a captured step replays with the tables'
next rows and no host work. Prompts prefilled together (right-padded to one length) read their own
slots' rows; padding tokens read the padding table (expert 0 at weight 0). Transformers' own loop
(`decode: hf`) reads a single table, position after position.

A synthetic source also keeps the latent state each router read (N, L, D): `latent(index)` is its
mean over the positions layer `index` routed last (the prompt's in a prefill, the step's position
in decode, read on the device). A lookahead predictor calibrated on synthetic routing
(`hidden_source: synthetic`) reads it where a trained model's predictor reads the hidden state:
the random-weight model's own hidden states say nothing about synthetic routing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..core.context import LoadContext
from ..core.model_pass import ModelPass, SlotRows
from ..engine.host_prompt import to_device
from ..errors import InputError
from ..models import ModelAdapter

MODES = ("model", "synthetic", "trace")
HISTORY = 64  # requests whose tables stay for the benchmark's Belady figures (a long run must not grow without end)


def parse_spec(spec: str) -> tuple[str, Any]:
    """`model` | `synthetic[:SEED][:affinity=A]` | `trace:PATH` -> (mode, argument: the seed, the path)."""
    mode, _, argument = spec.partition(":")
    if mode == "model" and not argument:
        return "model", None
    if mode == "synthetic":
        seed, _ = _synthetic_parts(spec)
        return "synthetic", seed
    if mode == "trace" and argument:
        return "trace", argument
    raise InputError(f"--routing {spec!r}: expected model, synthetic, synthetic:SEED or trace:PATH "
                     f"(synthetic[:SEED] may end in :affinity=A, the labelled what-if)")


def _synthetic_parts(spec: str) -> tuple[int, float]:
    """(seed, affinity strength) of `synthetic[:SEED][:affinity=A]`."""
    from ..routing import check_affinity_strength

    seed, strength = 0, 0.0
    parts = spec.split(":")[1:]
    if parts and "=" not in parts[0]:
        if not parts[0].lstrip("-").isdigit():
            raise InputError(f"--routing {spec}: synthetic:SEED needs a whole number")
        seed, parts = int(parts[0]), parts[1:]
    for part in parts:
        key, _, value = part.partition("=")
        if key != "affinity" or len(parts) > 1:
            raise InputError(f"--routing {spec}: after synthetic[:SEED] only :affinity=A is known, got {part!r}")
        try:
            strength = check_affinity_strength(value)
        except ValueError as exc:
            raise InputError(f"--routing {spec}: {exc}") from None
    return seed, strength


def affinity_of(spec: str) -> float:
    """The affinity what-if's strength a routing spec names (0: none, also for model and trace)."""
    return _synthetic_parts(spec)[1] if spec.partition(":")[0] == "synthetic" else 0.0


class RoutingSource:
    def __init__(self, mode: str, adapter: ModelAdapter, config: Any, context: LoadContext, seed: int = 0,
                 trace: Any = None, record: bool = False, affinity: float = 0.0):
        if mode not in MODES:
            raise InputError(f"routing {mode!r} is not one of: {', '.join(MODES)}")
        shape = adapter.moe_shape(config)
        self.mode, self.adapter, self.config, self.context = mode, adapter, config, context
        self.moe_layers = list(shape.moe_layers)
        self.layers, self.experts, self.top_k = len(self.moe_layers), shape.num_experts, shape.top_k
        self.seed, self.trace, self.record = seed, trace, record
        self.affinity = affinity  # the synthetic router's labelled what-if (0: off)
        # with it, per slot (None: the single table) the request's pruned-prefill survivors (routing/affinity.py)
        self._survivors: dict[Any, Any] = {}
        self._made: Any = None  # the last table's Survivors, for the begin that takes it
        self._pruned = False  # the last router call's positions were a pruned prefill's kept ones
        self.spec = mode if mode != "synthetic" else f"synthetic:{seed}" + (f":affinity={affinity:g}" if affinity else "")
        # (as a rule names it; make_source: as given)
        if trace is not None:
            if trace.layers != self.layers or trace.top_k != self.top_k or int(trace.ids.max()) >= self.experts:
                raise InputError(f"the routing trace has {trace.layers} layers x top-{trace.top_k} (ids up to "
                                 f"{int(trace.ids.max())}); this model has {self.layers} MoE layers x "
                                 f"{self.experts} experts, top-{self.top_k}")
            self._trace_cursor = 0
        self._trace_rows_cut = 0  # the rows the last request took of a trace without request ids (`skip`)
        self.ids: torch.Tensor | None = None      # (capacity, L, k) long, on the model's device
        self.weights: torch.Tensor | None = None  # (capacity, L, k)
        self.latents: torch.Tensor | None = None  # (capacity, L, D) float32, synthetic mode only
        self.probabilities: torch.Tensor | None = None  # (capacity, L, E) float32: each router's full softmax
        # MoE layer index -> (the slot(s) or None for the single table, the positions) it routed last
        self._routed_at: dict[int, tuple[Any, torch.Tensor]] = {}
        self.requests = 0
        self.history: list[dict[str, Any]] = []   # per request: ids (N, L, k) on the host, prompt length
        self._start = self._prompt = 0
        self._next: list[int] = []
        self._recorded: dict[int, list[torch.Tensor]] = {}
        # the model runner's: per KV slot (and one for padding rows), (S + 1, capacity, L, k) tables, one set per
        # runner's cache (two runners may live at once: each one's captured steps read its own tables)
        self._slot_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tables_of: SlotRows | None = None
        self._pass: ModelPass | None = None
        self._begun: dict[int, None] = {}  # the requests whose tables were made (runner sequence ids, newest last)
        self.slot_ids: torch.Tensor | None = None
        self.slot_weights: torch.Tensor | None = None
        self.slot_latents: torch.Tensor | None = None        # (S + 1, capacity, L, D), synthetic mode only
        self.slot_probabilities: torch.Tensor | None = None  # (S + 1, capacity, L, E), where the step sinks them
        self._slot: int | None = None  # the slot whose prefill runs now (None: the single-request table)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # begin_rows: (slot, position) per token
        self._primary_rows: dict[int, torch.Tensor | None] = {}  # MoE layer index -> its tokens that reach the router
        self._prepared: tuple | None = None  # (key, table) that `prepare` made for the next request
        self._watching = False  # the modality pre-hooks are on the decoder layers
        self._step_rows: tuple | None = None  # the decode step's rows of every layer (_decode_route)
        # a prefill forward's positions per (start, tokens) and its table's rows of every layer (_prompt_columns)
        self._arange: tuple | None = None
        self._columns: tuple | None = None

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

    def _use_tables(self, cache: SlotRows) -> None:
        """The tables of a runner's KV slots (made on its first prefill, before any of its steps is captured):
        one per slot of `capacity` positions and a padding row's (all zeros: expert 0 with weight 0), each
        router's full probabilities too (an offload cache may rank eviction by them: decode hands them on)."""
        if cache is self._tables_of:
            return
        tables = self._slot_tables.get(cache)
        if tables is None:
            shape = (cache.num_slots + 1, cache.capacity, self.layers, self.top_k)
            tables = {"ids": torch.zeros(shape, dtype=torch.long, device=cache.device),
                      "weights": torch.zeros(shape, dtype=cache.dtype, device=cache.device), "latents": None,
                      "probabilities": None}
            runtime = self.context.offload_runtime
            if runtime is not None and runtime.router_sink() is not None:
                tables["probabilities"] = torch.zeros(*shape[:3], self.experts, device=cache.device)
            self._slot_tables[cache] = tables
        self._tables_of = cache
        self.slot_ids, self.slot_weights = tables["ids"], tables["weights"]
        self.slot_latents, self.slot_probabilities = tables["latents"], tables["probabilities"]

    def enter(self, model_pass: ModelPass | None) -> None:
        """A new forward (the runner's ModelPass): the requests it starts get their tables, and the routers
        read the tables of its slots (or the single table, under transformers' loop)."""
        self._pass = model_pass
        self._slot, self._rows = None, None
        self._arange, self._columns = None, None  # the tables may change between forwards
        if model_pass is None:
            return
        if model_pass.cache is not None and self.replaces:
            self._use_tables(model_pass.cache)
        rows = model_pass.prefill
        for row in rows:
            if row.request not in self._begun:
                # a prompt's ids on the host where the runner read them (no read back before the first layer)
                ids = row.host.input_ids if row.host is not None and row.slot is not None else row.input_ids
                self.begin(ids, row.max_new_tokens, start=row.start, slot=row.slot)
                self._begun[row.request] = None
                while len(self._begun) > HISTORY:
                    del self._begun[next(iter(self._begun))]
        if len(rows) > 1:
            self.begin_rows([row.slot for row in rows], [row.length for row in rows], model_pass.width)
        elif rows:
            self._slot = rows[0].slot  # a prompt, a chunk of one, or what follows a held history

    def begin(self, input_ids: torch.Tensor, max_new_tokens: int, start: int = 0, slot: int | None = None) -> None:
        """A request: prompt `input_ids` (1, T), of which the first `start` are in the cache already;
        `slot`: the runner's KV slot, whose table it fills instead of the single one."""
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
        if self.affinity:
            self._survivors[slot] = self._made
        if slot is not None:
            if self.slot_ids is None or not 0 <= slot < self.slot_ids.shape[0] - 1 or total > self.slot_ids.shape[1]:
                raise ValueError(f"slot {slot} with {total} positions: the runner's tables are "
                                 f"{None if self.slot_ids is None else tuple(self.slot_ids.shape[:2])}")
            device = self.slot_ids.device
            self.slot_ids[slot, :total].copy_(to_device(ids, device))
            self.slot_weights[slot, :total].copy_(to_device(weights.to(self.slot_weights.dtype), device))
            if latents is not None:
                if self.slot_latents is None:  # made once, before any decode step is captured
                    self.slot_latents = torch.zeros(*self.slot_ids.shape[:3], latents.shape[2], device=device)
                    self._slot_tables[self._tables_of]["latents"] = self.slot_latents
                self.slot_latents[slot, :total].copy_(to_device(latents.to(torch.float32), device))
            if self.slot_probabilities is not None:
                self.slot_probabilities[slot, :total].copy_(to_device(probabilities, device))
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

    def skip(self, count: int) -> None:
        """The next `count` requests are not made: the next one routes as the one after them would have (a
        benchmark whose configurations ran different numbers of warm-up requests replays the same measured
        requests in each): the synthetic seed and a trace's request number move on by `count`, a trace without
        request ids by `count` requests as long as the last one."""
        if count < 0:
            raise ValueError(f"skip: a count of requests, 0 or more, not {count}")
        self.requests += count
        if self.trace is not None and self.trace.request_ids is None:
            self._trace_cursor = (self._trace_cursor + count * self._trace_rows_cut) % self.trace.tokens

    def _table_key(self, total: int, visual: torch.Tensor) -> tuple:
        """What a request's table depends on: its seed (the request count), length and visual positions."""
        return self.requests, total, visual.numpy().tobytes()

    def _count(self, ids: torch.Tensor, prompt: int) -> None:
        """A request's table made: kept for the benchmark's Belady figures; the next request's seed moves on."""
        self.history.append({"ids": ids, "prompt": prompt})
        del self.history[:-HISTORY]
        self.requests += 1

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

    def _table(self, total: int, visual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                              torch.Tensor]:
        """ids, weights, the latent states (synthetic) and each router's full probabilities, per position."""
        if self.mode == "synthetic":
            from ..routing import SyntheticRouter

            router = SyntheticRouter(self.layers, self.experts, self.top_k, seed=self.seed + self.requests,
                                     affinity=self.affinity)
            prompt = router.route(len(visual), visual.to(torch.uint8), "prefill")
            rest = router.route(total - len(visual), None, "decode")
            hidden = torch.cat([prompt.hidden, rest.hidden])
            modality = torch.cat([visual.to(torch.float64), torch.zeros(total - len(visual), dtype=torch.float64)])
            mixing = router.mixing_history() if self.affinity else None
            logits = torch.stack([router.logits(layer, hidden[:, layer], modality, mixing)
                                  for layer in range(self.layers)], 1)
            ids, probabilities = torch.cat([prompt.ids, rest.ids]), torch.softmax(logits, dim=-1).float()
            # the router's weights are its top-k renormalised (Qwen3's); a family whose router weighs its
            # choice otherwise (DeepSeek's unnormalised top-k, GLM's scaling) gets its own from the adapter
            weights = self.adapter.routing_weights(self.config, probabilities, ids)
            if self.affinity:
                from ..routing.affinity import Survivors

                self._made = Survivors(router, hidden, modality)
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
            self._trace_rows_cut = total
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

    # --- the routers' operators call these ---------------------------------------------------------
    def moe_index(self, layer: int) -> int:
        """The MoE index (the tables' column) of decoder layer `layer`."""
        if layer not in self.moe_layers:
            raise ValueError(f"layer {layer} has no router this routing source replaces (MoE layers: {self.moe_layers})")
        return self.moe_layers.index(layer)

    def watch_modality(self, layers: nn.ModuleList) -> None:
        """A modality-separated family: the decoder layers' pre-hooks that tell which of their tokens reach
        the primary (text) router (once)."""
        name = self.adapter.modality_argument()
        if name is None or self._watching:
            return
        self._watching = True
        for index, layer in enumerate(self.moe_layers):
            layers[layer].register_forward_pre_hook(self._modality_hook(index, name), with_kwargs=True)

    def route(self, index: int, router: nn.Module, hidden: torch.Tensor) -> Any:
        """MoE layer `index`'s routing of `hidden`: in a decode step the tables' rows of the step's slots at
        their positions, (logits or None, weights, ids) as the decode step reads a router (device work
        only: the step stays capturable); otherwise the router's own output with its choice replaced."""
        model_pass = self.context.model_pass
        if model_pass is not self._pass:
            self.enter(model_pass)
        if model_pass is not None and model_pass.decode is not None:
            return self._decode_route(index, model_pass.decode) if self.replaces else router(hidden)
        if self.adapter.modality_argument() is not None and not self._watching:
            text = self.context.text_model
            if text is None:
                raise InputError("a routing source on a modality-separated family needs our text model's forward "
                                 "(a VisDecoder rule) to see which tokens reach the text router")
            self.watch_modality(self.adapter.layers_of(text))
        return self._prefill_route(index, router(hidden))

    def _decode_route(self, index: int, rows: SlotRows) -> tuple:
        """The step's rows of MoE layer `index`: the first MoE layer gathers every layer's rows of the step's
        slots at their positions at once (a few launches a step, not a few a layer: inside a captured step
        each launch costs microseconds), the others take their column of it."""
        if index == 0 or self._step_rows is None:
            slots = rows.active
            positions = rows.lengths[0, slots]
            weights, ids = self.slot_weights[slots, positions], self.slot_ids[slots, positions]    # (R, L, k)
            logits = None
            if self.slot_probabilities is not None and self._averaged():
                # the router's probabilities as logits the family's scorer maps back onto them (a softmax
                # exactly; a sigmoid scorer monotonically: what ranks eviction keeps its order)
                logits = torch.log(self.slot_probabilities[slots, positions].clamp_min(1e-30))    # (R, L, E)
            self._step_rows = (slots, positions, weights, ids, logits)
        slots, positions, weights, ids, logits = self._step_rows
        self._routed_at[index] = (slots, positions)
        # a column is contiguous for one row (no copy); the expert kernels read several rows' ids as contiguous
        return None if logits is None else logits[:, index], weights[:, index].contiguous(), ids[:, index].contiguous()

    def _averaged(self) -> bool:
        """Whether the step's router probabilities are still averaged (read once a step): once `eviction: auto` has
        kept lru they are not, and a step gets no logits, so it computes no softmax a layer that nobody reads."""
        runtime = self.context.offload_runtime
        return runtime is None or runtime.averages_router()

    def _modality_hook(self, index: int, name: str):
        """Keeps which of a decoder layer's tokens reach its primary (text) router: those of modality 0
        in the layer's `name` argument (None: every token, as in decode, where the model passes none)."""
        def hook(module, args, kwargs):
            modality = kwargs.get(name)
            self._primary_rows[index] = modality.reshape(-1) == 0 if modality is not None else None
        return hook

    def _prefill_route(self, index: int, output: Any) -> Any:
        """A prefill's (or transformers' decode loop's) router output, its choice replaced by the tables'
        rows of its tokens' positions."""
        chosen = self.adapter.routed_experts(output)
        rows = chosen.shape[0]
        primary = self._primary_rows.pop(index, None)
        positions = self._positions(index, rows, chosen.device, primary)
        self._routed_at[index] = (self._slot, positions)
        if self.record:
            self._recorded.setdefault(index, []).append(chosen.detach().cpu())
        if not self.replaces:
            return output
        if self._pruned and self._rows is None and self._survivors.get(self._slot) is not None:  # the what-if
            ids, probabilities, renormalised = self._survivors[self._slot].rows(index, positions)
            weights = self.adapter.routing_weights(self.config, probabilities, ids)
            dtype = (self.slot_weights if self._slot is not None else self.weights).dtype
            weights = (renormalised if weights is None else weights).to(chosen.device, dtype)
            return self.adapter.with_routing(output, weights, ids.to(chosen.device))
        if self._rows is not None:  # prompts prefilled together: each token its own slot's row
            slots, at = self._rows
            if primary is not None and primary.numel() == slots.numel():
                mask = primary.to(slots.device)
                slots, at = slots[mask], at[mask]
            if slots.numel() != rows:
                raise RuntimeError(f"a grouped prefill of {slots.numel()} tokens routed {rows} at layer {index}")
            self._routed_at[index] = (slots, at)
            return self.adapter.with_routing(output, self.slot_weights[slots, at, index],
                                             self.slot_ids[slots, at, index])
        # a runner's prefill reads its slot's table, transformers' loop the single table
        weights, ids = (self.slot_weights[self._slot], self.slot_ids[self._slot]) if self._slot is not None \
            else (self.weights, self.ids)
        if self._pruned or primary is not None:  # positions of this layer's own
            return self.adapter.with_routing(output, weights[positions, index], ids[positions, index])
        weights, ids = self._prompt_columns(weights, ids, positions)
        return self.adapter.with_routing(output, weights[index], ids[index])

    def _prompt_columns(self, weights: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Every MoE layer's rows of the table at `positions`, (L, T, k) each, gathered once for the layers that
        route those positions (every layer of an unpruned prefill): each layer's rows are then a contiguous slice,
        where gathering them a layer at a time took two launches, each felt in a prompt paced by the host."""
        if self._columns is None or self._columns[0] is not positions:
            self._columns = (positions, weights[positions].transpose(0, 1).contiguous(),
                             ids[positions].transpose(0, 1).contiguous())
        return self._columns[1:]

    def _positions(self, index: int, rows: int, device: torch.device, primary: torch.Tensor | None = None) -> torch.Tensor:
        """The sequence positions of the `rows` tokens MoE layer `index`'s router saw, and the layer's next
        start moved past this call's tokens. `primary`: which of the layer's tokens reached the router
        (a modality-separated family's text router sees only the text tokens; None: all of them)."""
        start = self._next[index]
        expected = self._prompt - start if start < self._prompt else 1
        tokens = primary.numel() if primary is not None else rows  # the tokens the layer ran
        keep = self.context.pruning.keep
        self._pruned = tokens < expected and keep is not None and keep.numel() == tokens
        if self._pruned:  # a pruned prefill's later layers
            positions = keep.to(device) + start
        else:  # the same tensor for every layer of the forward (_prompt_columns knows its rows by it)
            key = (start, tokens, device)
            if self._arange is None or self._arange[0] != key:
                self._arange = (key, torch.arange(start, start + tokens, device=device))
            positions = self._arange[1]
            expected = tokens
        self._next[index] = start + expected
        if primary is not None:
            positions = positions[primary.to(device)]
            if positions.numel() != rows:
                raise RuntimeError(f"MoE layer {index}'s router saw {rows} tokens, but {positions.numel()} of the "
                                   f"layer's {tokens} are of its modality")
        return positions

    # --- the synthetic router's latent state, for a predictor calibrated on it ---------------------
    def latent(self, index: int) -> torch.Tensor:
        """(1, D): the latent state MoE layer `index`'s router read, averaged over the positions it
        routed last (device ops only)."""
        slots, positions = self._routed_at.get(index, (None, None))
        table = self.latents if slots is None else self.slot_latents
        if table is None or positions is None:
            raise InputError("this predictor was calibrated on synthetic routing (hidden_source: synthetic): it "
                             "needs --routing synthetic, whose latent state it reads instead of the model's")
        rows = table[positions, index] if slots is None else table[slots, positions, index]
        return rows.mean(dim=0, keepdim=True)
