"""StaticKVCache: every layer's keys and values in buffers allocated once, with per-layer lengths.

Shapes: L decoder layers, B = 1, Hkv key/value heads, C capacity (positions), D head dim (Dv the values',
D unless the model says otherwise: latent attention caches a key and a "value" of different widths,
models/kimi_k25.py).

transformers' DynamicCache concatenates at every step, so each decode step allocates buffers that grow
with the sequence, and CUDA graphs cannot replay it. Here each layer owns (1, Hkv, C, D) buffers made
once, and a layer's length is its own: after VisDecoder prunes visual tokens the prefix layers hold
every token and the later layers only the kept ones, so "position p" means a different slot per layer.

Two ways in:
- prefill (many tokens, eager): `update` copies at the layer's host-side length and returns views of
  the filled part, exactly what the attention would get from DynamicCache;
- decode (`decoding = True`, one token, graph-capturable): `update` writes at the layer's length held
  in a device tensor (`index_copy_`, no host value involved) and returns the whole buffer; the step
  masks the empty slots with `decode_masks()`, built on the device from the same lengths. `advance()`
  then moves both the device and the host lengths on by one.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """More positions were asked for than the cache was made with."""


class StaticKVCache:
    is_compileable = False  # transformers' mask helpers must not treat this as its StaticCache

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, value_dim: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        value_shape = (*shape[:3], head_dim if value_dim is None else value_dim)
        self.values = [torch.zeros(value_shape, dtype=dtype, device=device) for _ in range(layers)]
        self.capacity, self.dtype, self.device = capacity, dtype, torch.device(device)
        self.host_lengths = [0] * layers
        self.lengths = torch.zeros(layers, dtype=torch.long, device=device)  # device mirror, for decode
        self.slots = torch.arange(capacity, device=device)
        self.decoding = False

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def fits(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device,
             value_dim: int | None = None) -> bool:
        k, v = self.keys[0], self.values[0]
        return (self.num_layers, k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device) == (
            layers, kv_heads, head_dim, head_dim if value_dim is None else value_dim, dtype,
            torch.device(device)) and self.capacity >= capacity

    def reset(self) -> None:
        """Empty every layer (the buffers stay: a new request reuses them)."""
        self.host_lengths = [0] * self.num_layers
        self.lengths.zero_()
        self.decoding = False

    def truncate(self, lengths: list[int]) -> None:
        """Keep the first lengths[l] entries of each layer (a conversation's reused prefix)."""
        if len(lengths) != self.num_layers or any(not 0 <= n <= h for n, h in zip(lengths, self.host_lengths)):
            raise ValueError(f"cannot truncate layers holding {self.host_lengths} to {lengths}")
        self.host_lengths = list(lengths)
        self.lengths.copy_(torch.tensor(lengths))
        self.decoding = False

    # --- the interface transformers' attention and our decoder call ----------------------------------
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.host_lengths[layer_idx or 0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decoding:
            at = self.lengths[layer_idx:layer_idx + 1]
            self.keys[layer_idx].index_copy_(2, at, key_states)
            self.values[layer_idx].index_copy_(2, at, value_states)
            return self.keys[layer_idx], self.values[layer_idx]
        start = self.host_lengths[layer_idx]
        end = start + key_states.shape[2]
        if end > self.capacity:
            raise CacheFullError(f"layer {layer_idx} needs {end} positions, the cache holds {self.capacity}")
        self.keys[layer_idx][:, :, start:end] = key_states
        self.values[layer_idx][:, :, start:end] = value_states
        self.host_lengths[layer_idx] = end
        self.lengths[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    # --- decode -----------------------------------------------------------------------------------
    def room(self) -> int:
        """Decode steps left before some layer is full."""
        return self.capacity - max(self.host_lengths)

    def decode_masks(self, dtype: torch.dtype) -> torch.Tensor:
        """(L, 1, 1, C) additive masks for the step about to run: slot s of layer l is visible when
        s <= length[l] (the slot the step writes is length[l] itself)."""
        visible = self.slots[None, :] <= self.lengths[:, None]
        masks = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        return masks.masked_fill_(~visible, torch.finfo(dtype).min)[:, None, None, :]

    def advance_on_device(self) -> None:
        """The device half of `advance`: part of the (capturable) step."""
        self.lengths.add_(1)

    def advance_on_host(self) -> None:
        """The host half of `advance`: after the step ran (or was replayed)."""
        self.host_lengths = [n + 1 for n in self.host_lengths]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
