"""SlotKVCache: keys and values of the sequences being decoded, one slot each (a single request is one slot).

Shapes: L decoder layers, S slots, B sequences in a step, Hkv key/value heads, C capacity, D head dim (Dv
the values', D unless the model says otherwise: latent attention caches a key and a "value" of different
widths, models/kimi_k25.py).

transformers' DynamicCache concatenates at every step, so each decode step allocates buffers that grow
with the sequence, and CUDA graphs cannot replay it. Here each layer owns (S, Hkv, C, D) buffers made
once, and a length per (layer, slot): a slot holds one sequence (scheduler.py decides which), and after
VisDecoder prunes visual tokens a sequence's prefix layers hold every token and its later layers only
the kept ones, so "position p" means a different place per layer.

Two ways in, with the interface transformers' attention calls (`update`, `get_seq_length`):
- prefill of one sequence: `slot_view(s)` is a batch-1 cache over slot s (copies at the layer's
  host-side length, returns the filled part), exactly what the attention would get from DynamicCache;
- prefill of several fresh prompts in one forward: `rows_view(slots, lengths)` takes their (B, Hkv, T, D)
  keys, right-padded to the longest prompt T, into the B empty slots at once; each slot's length is
  its own prompt's (the padding's keys lie past it: decode masks them and writes over them);
- decode of B sequences at once: after `begin_decode(slots)`, `update` writes each row's one new key
  at its own layer length (an index_put on the device) and returns the B rows' whole buffers; the
  step masks each row's empty positions with `decode_masks()`, and `advance()` moves the B sequences'
  lengths on by one.
The decode returns gathered copies of the B rows per layer, cut at the step's span (the longest row
plus the new token, rounded up to SPAN_STEP positions, not the whole capacity C): attention over rows
of different lengths without a paged-attention kernel, at a cost that follows the rows' lengths.
When the step's rows are slots 0..B-1 in order (every slot busy, as under load), it returns views of
the buffers instead: no copy (on an H200 the copies took 0.6 ms of a 15 ms step at 8 rows).

A captured step (a CUDA graph per batch size) runs a fixed number of rows: `begin_decode(slots, rows)`
pads the step to `rows` with a pad slot of its own (one slot past the sequences' ones, emptied at each
step, never read by a real row), and the step's active slots live in one fixed buffer the graphs read.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """More positions were asked for than the cache was made with."""

SPAN_STEP = 256  # decode attends to this many positions more at a time (few distinct shapes, little waste)


class SlotKVCache:
    is_compileable = False  # transformers' mask helpers must not treat this as its StaticCache

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, value_dim: int | None = None):
        if slots < 1 or capacity < 1:
            raise ValueError(f"a slot cache needs at least one slot and one position, got {slots} x {capacity}")
        # the last slot: padding rows of a captured step (a cache of one slot never pads: none)
        pad = 1 if slots > 1 else 0
        shape = (slots + pad, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        value_shape = (*shape[:3], head_dim if value_dim is None else value_dim)
        self.values = [torch.zeros(value_shape, dtype=dtype, device=device) for _ in range(layers)]
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current device: weights say cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.capacity, self.device, self.dtype = capacity, device, dtype
        self.host_lengths = [[0] * slots for _ in range(layers)]
        self.lengths = torch.zeros(layers, slots + pad, dtype=torch.long, device=device)  # device mirror, for decode
        self.positions = torch.arange(capacity, device=device)
        self.heads = torch.arange(kv_heads, device=device)
        self.pad_slot = slots
        # the step's rows' slots: views of one buffer (a graph reads the same memory at every replay)
        self._active_rows = torch.full((1 << (slots - 1).bit_length(),), slots if pad else 0, dtype=torch.long,
                                       device=device)
        self.active: torch.Tensor | None = None  # the rows of the decode step under way
        self._last_rows: tuple[list[int], int] | None = None  # what _active_rows holds
        self._active_host: list[int] = []
        self.span = capacity  # positions the step under way attends to
        self.contiguous = False  # the step's rows are slots 0..B-1 in order: update returns views

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_slots(self) -> int:
        return len(self.host_lengths[0])

    @property
    def max_rows(self) -> int:
        """The most rows a step can run: the slots, padded up to a power of two."""
        return self._active_rows.numel()

    def release(self, slot: int) -> None:
        """Empty a slot (its sequence finished, was cancelled or preempted); the buffers stay."""
        for lengths in self.host_lengths:
            lengths[slot] = 0
        self.lengths[:, slot] = 0

    def keep(self, slot: int, tokens: list[int]) -> None:
        """Cut a slot back to `tokens[l]` positions in layer l (a chat's next turn keeps its history; a
        pruned prefill's later layers hold fewer); the slot must hold at least that many."""
        if len(tokens) != self.num_layers or any(lengths[slot] < n for lengths, n in zip(self.host_lengths, tokens)):
            raise ValueError(f"slot {slot} cannot keep {tokens} positions per layer")
        for lengths, n in zip(self.host_lengths, tokens):
            lengths[slot] = n
        self.lengths[:, slot] = torch.tensor(tokens, device=self.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def slot_view(self, slot: int) -> "SlotView":
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not one of this cache's {self.num_slots}")
        return SlotView(self, slot)

    def rows_view(self, slots: list[int], lengths: list[int]) -> "SlotRowsView":
        """A batch-B cache over empty `slots` for one prefill of B prompts of `lengths` tokens."""
        if len(set(slots)) != len(slots) or len(slots) != len(lengths) or \
                not all(0 <= s < self.num_slots for s in slots):
            raise ValueError(f"prefill slots {slots} must be distinct slots of this cache's {self.num_slots}, "
                             f"one per length ({lengths})")
        if max(lengths) > self.capacity or min(lengths) < 1:
            raise CacheFullError(f"prompts of {lengths} tokens: a slot holds 1 to {self.capacity}")
        for slot in slots:
            self.release(slot)
        return SlotRowsView(self, slots, lengths)

    # --- decode -----------------------------------------------------------------------------------
    def begin_decode(self, slots: list[int], rows: int | None = None) -> None:
        """The next `update` calls write one token for each of these slots, in this order, and for
        `rows` - len(slots) padding rows after them (the pad slot, emptied first)."""
        if len(set(slots)) != len(slots) or not all(0 <= s < self.num_slots for s in slots):
            raise ValueError(f"decode slots {slots} must be distinct slots of this cache's {self.num_slots}")
        rows = len(slots) if rows is None else rows
        if not len(slots) <= rows <= self.max_rows:
            raise ValueError(f"a step of {len(slots)} slots cannot run as {rows} rows (at most {self.max_rows})")
        full = [s for s in slots if max(lengths[s] for lengths in self.host_lengths) >= self.capacity]
        if full:
            raise CacheFullError(f"slot(s) {full} hold {self.capacity} positions already, the cache's capacity")
        self._active_host = list(slots)
        self.contiguous = rows == len(slots) and list(slots) == list(range(rows))
        if self._last_rows != (self._active_host, rows):  # the same rows as the last step: the buffer holds them
            self._active_rows[:rows].copy_(torch.tensor(slots + [self.pad_slot] * (rows - len(slots)), dtype=torch.long))
            self._last_rows = (self._active_host, rows)
        self.active = self._active_rows[:rows]
        if rows > len(slots):  # padding rows start empty at every step: their single position stays in range
            self.lengths[:, self.pad_slot] = 0
        longest = max(lengths[s] for lengths in self.host_lengths for s in slots) + 1  # with the token written now
        self.span = min(self.capacity, -(-longest // SPAN_STEP) * SPAN_STEP)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The longest active row's length (transformers asks; the masks give each row its own)."""
        return max(self.host_lengths[layer_idx or 0][s] for s in self._active_host) if self._active_host else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hkv, 1, D) new keys and values -> the B rows' buffers up to the step's span (B, Hkv, span, D)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.active is None:
            raise RuntimeError("SlotKVCache.update outside a decode step: prefill goes through slot_view(slot)")
        if self.contiguous:  # rows 0..B-1 of the buffers are the step's rows: views, no gather
            rows = self.active.shape[0]
            # one scatter per buffer at each row's own length (a view of the lengths: no gather kernel; the
            # general path's index arithmetic cost about 5 launches a layer, 0.3 ms of a 7 ms step on the H200)
            at = self.lengths[layer_idx, :rows].view(rows, 1, 1, 1)
            keys[:rows].scatter_(2, at.expand(*key_states.shape), key_states)
            values[:rows].scatter_(2, at.expand(*value_states.shape), value_states)
        else:
            at = self.lengths[layer_idx, self.active]                                   # (B,)
            rows, heads, at = self.active[:, None], self.heads[None, :key_states.shape[1]], at[:, None]  # (B, 1), (1, Hkv)
            keys[rows, heads, at] = key_states[:, :, 0]
            values[rows, heads, at] = value_states[:, :, 0]
        return self.decode_view(layer_idx)

    def decode_view(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows' keys and values in layer `layer_idx` up to the span (B, Hkv, span, D): what
        `update` returns, for a step that wrote its new keys itself (engine/fused_attention.py)."""
        if self.active is None:
            raise RuntimeError("SlotKVCache.decode_view outside a decode step")
        span, keys, values = self.span, self.keys[layer_idx], self.values[layer_idx]
        if self.contiguous:
            rows = self.active.shape[0]
            return keys[:rows, :, :span], values[:rows, :, :span]
        return keys[self.active, :, :span], values[self.active, :, :span]

    def decode_masks(self, dtype: torch.dtype) -> torch.Tensor:
        """(L, B, 1, 1, span) additive masks for the step about to run: position p of row b in layer l is
        visible when p <= that row's length there (the position the step writes is the length itself)."""
        visible = self.positions[:self.span] <= self.lengths[:, self.active, None]  # (L, B, span)
        masks = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(~visible, torch.finfo(dtype).min)
        return masks[:, :, None, None, :]

    def advance(self) -> None:
        """After the step: every active row moved on by one in every layer."""
        self.advance_on_device()
        self.advance_on_host()

    def advance_on_device(self) -> None:
        """The device half of `advance`: part of the (capturable) step. Padding rows repeat the pad
        slot; each of them writes the same value, so the repeats are harmless."""
        self.lengths[:, self.active] += 1

    def abandon_step(self) -> None:
        """The step under way failed: no decode step is under way any more (its rows' host lengths stay;
        their sequences fail with it and release their slots)."""
        self.active, self._active_host = None, []

    def retract(self, slots: list[int]) -> None:
        """Take back the last decode step of these slots (a step launched ahead that a stop made one too
        many, engine/steps_ahead.py): each layer's length one position back. The key and value it wrote
        lie past the length, and the next step there writes over them."""
        if any(lengths[s] < 1 for lengths in self.host_lengths for s in slots):
            raise ValueError(f"slots {slots} have no decoded position to take back")
        for lengths in self.host_lengths:
            for s in slots:
                lengths[s] -= 1
        self.lengths[:, torch.tensor(slots, device=self.device)] -= 1

    def advance_on_host(self) -> None:
        for lengths in self.host_lengths:
            for s in self._active_host:
                lengths[s] += 1
        self.active, self._active_host = None, []


class SlotView:
    """One slot of a SlotKVCache as a batch-1 cache: a sequence's prefill (or a chunk of it) writes here."""
    is_compileable = False

    def __init__(self, cache: SlotKVCache, slot: int):
        self.cache, self.slot = cache, slot

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.cache.host_lengths[layer_idx or 0][self.slot]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._span(layer_idx, key_states.shape[2])
        cache, slot = self.cache, self.slot
        cache.keys[layer_idx][slot, :, start:end] = key_states[0]
        cache.values[layer_idx][slot, :, start:end] = value_states[0]
        self._set_length(layer_idx, end)
        return self.filled(layer_idx)

    def _span(self, layer_idx: int, count: int) -> tuple[int, int]:
        start = self.cache.host_lengths[layer_idx][self.slot]
        end = start + count
        if end > self.cache.capacity:
            raise CacheFullError(f"slot {self.slot}, layer {layer_idx} needs {end} positions, "
                                 f"the cache holds {self.cache.capacity}")
        return start, end

    def _set_length(self, layer_idx: int, length: int) -> None:
        self.cache.host_lengths[layer_idx][self.slot] = length
        # a fill kernel: assigning the int would copy it from host memory and wait, once a layer
        self.cache.lengths[layer_idx, self.slot].fill_(length)

    def claim(self, layer_idx: int, count: int) -> tuple[int, int]:
        """The positions [start, end) the next `count` keys of the layer go to, counted as written (the
        caller writes them before anything reads the cache: engine/prompt_attention.py writes in a kernel;
        `rewind(layer_idx, start)` gives them back if the writing fails)."""
        start, end = self._span(layer_idx, count)
        self._set_length(layer_idx, end)
        return start, end

    def rewind(self, layer_idx: int, length: int) -> None:
        """The layer's length back to `length` (positions claimed and not written)."""
        self._set_length(layer_idx, length)

    def filled(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's keys and values of the layer so far, (1, Hkv, length, D) views."""
        cache, slot = self.cache, self.slot
        end = cache.host_lengths[layer_idx][slot]
        return cache.keys[layer_idx][slot:slot + 1, :, :end], cache.values[layer_idx][slot:slot + 1, :, :end]


class SlotRowsView:
    """Several empty slots as one batch-B cache: a prefill of B right-padded prompts writes here."""
    is_compileable = False

    def __init__(self, cache: SlotKVCache, slots: list[int], lengths: list[int]):
        self.cache, self.slots, self.lengths = cache, list(slots), list(lengths)
        self._rows = torch.tensor(slots, dtype=torch.long, device=cache.device)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return 0  # fresh prompts: nothing before them (a continuation prefills alone, through slot_view)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cache, width = self.cache, key_states.shape[2]
        if key_states.shape[0] != len(self.slots) or width < max(self.lengths):
            raise ValueError(f"a prefill of {len(self.slots)} prompts up to {max(self.lengths)} tokens got keys "
                             f"{tuple(key_states.shape)}")
        if cache.host_lengths[layer_idx][self.slots[0]]:
            raise RuntimeError(f"layer {layer_idx} of slots {self.slots} was written twice in one prefill")
        cache.keys[layer_idx][self._rows, :, :width] = key_states
        cache.values[layer_idx][self._rows, :, :width] = value_states
        for slot, length in zip(self.slots, self.lengths):
            cache.host_lengths[layer_idx][slot] = length
        cache.lengths[layer_idx, self._rows] = torch.tensor(self.lengths, device=cache.device)
        return key_states, value_states  # what the prompts attend to: their own keys (causal, from empty)
