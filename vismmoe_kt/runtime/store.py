"""ExpertStore: one contiguous host block per logical expert of the offloaded layers.

(With `fmt="q8_0"`, `"q4_0"`, `"q4_k"` or `"q5_k"` a block holds the same two parts in llama.cpp's block
bytes: q8.py, q4.py, q4k.py, q5k.py. A layer filled from a GGUF file as stored may keep its down part in another of those
formats, or in Q6_K (q6k.py), as Q4_K_M files do in about half of the layers: `down_format(layer)`,
`block_bytes_of(layer)`.)

A block is `[gate_up (2I x H) | down (H x I)]` in the model's dtype: its two parts are exactly a
slab's rows in the GPU's two pools (gate_up and down kept apart there, so each pool is a contiguous
`(slabs, out, in)` tensor that grouped GEMM reads without a copy), so a fetch is two copies. A layer's blocks are one tensor `(E, block_elems)` of exactly that size, page-locked and
mapped when CUDA is present (host_memory.py: copies from pageable memory run at about a fifth of the
speed and cannot overlap compute; the decode kernels read misses in place).
Layers are filled one at a time from tensors the loader reads through mmap, so the checkpoint is
never held twice.
"""

from __future__ import annotations

import torch
from cpu_kernels.ggml_types import PART_FORMATS, STORE_FORMATS

from . import q4, q4k, q5k, q6k, q8
from .host_memory import HostBuffer


def block_views(blocks: torch.Tensor, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block) -> gate_up (rows, 2I, H) and down (rows, H, I) views of the same memory."""
    rows = blocks.shape[0]
    split = 2 * inter * hidden
    return blocks[:, :split].view(rows, 2 * inter, hidden), blocks[:, split:].view(rows, hidden, inter)


CODECS = {"q8_0": q8, "q4_0": q4, "q4_k": q4k, "q5_k": q5k}  # llama.cpp block formats: row_bytes, quantize, dequantize
PART_CODECS = {**CODECS, "q6_k": q6k}  # what a block's down part may hold as a GGUF file stores it (read only)


def quant_views(blocks: torch.Tensor, inter: int, hidden: int, codec=q8,
                down_codec=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block bytes) of a quantized store -> gate_up (rows, 2I, bytes of a row of H) and down
    (rows, H, bytes of a row of I, in `down_codec`'s format: default `codec`'s) views of the same memory."""
    down_codec = down_codec or codec
    rows, split = blocks.shape[0], 2 * inter * codec.row_bytes(hidden)
    return (blocks[:, :split].view(rows, 2 * inter, codec.row_bytes(hidden)),
            blocks[:, split:].view(rows, hidden, down_codec.row_bytes(inter)))


FORMATS = ("model", "q8_0", "q4_0", "q4_k", "q5_k")


def raw_down_format(fmt: str, inter: int, gate_type: int, up_type: int, down_type: int) -> str | None:
    """The down part's format if a store in `fmt` can take a GGUF layer's experts as the file stores them
    (gate and up in `fmt`, down in it or in another block format whose rows fit, e.g. a Q4_K_M file's
    Q6_K); None: they must be dequantized and requantized."""
    if gate_type != STORE_FORMATS.get(fmt) or up_type != gate_type:
        return None
    down = next((name for name, kind in PART_FORMATS.items() if kind == down_type), None)
    try:
        PART_CODECS[down].row_bytes(inter)  # rows of whole blocks
    except (KeyError, ValueError):
        return None
    return down


class ExpertStore:
    """`fmt`: `model` keeps the model's dtype; `q8_0` / `q4_0` / `q4_k` / `q5_k` keep llama.cpp's 8-, 4-
    or 5-bit blocks (q8.py, q4.py, q4k.py, q5k.py), a half to a quarter of BF16's bytes per expert in
    host memory and over PCIe; slabs stay in `dtype` either way.
    `block_bytes` is what a fetch moves, `slab_bytes` what a slab holds on the GPU."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, pin_memory: bool,
                 fmt: str = "model"):
        if fmt not in FORMATS:
            raise ValueError(f"store format {fmt!r} is not one of: {', '.join(FORMATS)}")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.dtype, self.pin_memory, self.fmt = dtype, pin_memory, fmt
        self.block_elems = 3 * inter * hidden
        self.slab_bytes = self.block_elems * torch.tensor([], dtype=dtype).element_size()
        self.codec = CODECS.get(fmt)
        self.block_bytes = self.slab_bytes if fmt == "model" else \
            2 * inter * self.codec.row_bytes(hidden) + hidden * self.codec.row_bytes(inter)
        self.layers: dict[int, torch.Tensor] = {}
        self._buffers: dict[int, HostBuffer] = {}
        self._down_formats: dict[int, str] = {}  # layers whose down part is not in `fmt` (as a GGUF stores it)

    @property
    def quantized(self) -> bool:
        return self.fmt != "model"

    def down_format(self, layer: int) -> str:
        return self._down_formats.get(layer, self.fmt)

    def block_bytes_of(self, layer: int) -> int:
        """What a fetch of one of `layer`'s experts moves (`block_bytes` unless its down part differs)."""
        return self.block_bytes_with(self._down_formats.get(layer, self.fmt))

    def block_bytes_with(self, down: str) -> int:
        """A quantized block's bytes with its down part in `down` (a PART_CODECS format)."""
        if down == self.fmt:
            return self.block_bytes
        return 2 * self.inter * self.codec.row_bytes(self.hidden) + self.hidden * PART_CODECS[down].row_bytes(self.inter)


    def fill_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        if layer in self._buffers:
            self._buffers.pop(layer).release()
        self._down_formats.pop(layer, None)
        if self.quantized:
            buffer = HostBuffer(self.num_experts * self.block_bytes, torch.uint8, self.pin_memory)
            blocks = buffer.tensor.view(self.num_experts, self.block_bytes)
            gu, dn = quant_views(blocks, self.inter, self.hidden, self.codec)
            for expert in range(self.num_experts):  # one expert at a time: no second copy of the layer
                gu[expert].copy_(self.codec.quantize(gate_up[expert]))
                dn[expert].copy_(self.codec.quantize(down[expert]))
        else:
            buffer = HostBuffer(self.num_experts * self.block_elems, self.dtype, self.pin_memory)
            blocks = buffer.tensor.view(self.num_experts, self.block_elems)
            gu, dn = block_views(blocks, self.inter, self.hidden)
            gu.copy_(gate_up)
            dn.copy_(down)
        self._buffers[layer] = buffer
        self.layers[layer] = blocks

    def fill_layer_raw(self, layer: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       down_format: str | None = None) -> None:
        """A quantized store's layer from bytes of its format as stored elsewhere (a GGUF's gate, up and
        down experts: (E, I, row bytes of H), the same, (E, H, row bytes of I)); `down_format`: the down
        experts' own format where it differs (PART_CODECS, e.g. a Q4_K_M file's Q6_K)."""
        if not self.quantized:
            raise RuntimeError("fill_layer_raw needs a quantized store")
        down_format = down_format or self.fmt
        if down_format not in PART_CODECS:
            raise ValueError(f"a block's down part cannot be {down_format!r}: one of {', '.join(PART_CODECS)}")
        e, i, h, codec, down_codec = self.num_experts, self.inter, self.hidden, self.codec, PART_CODECS[down_format]
        shapes = ((e, i, codec.row_bytes(h)), (e, i, codec.row_bytes(h)), (e, h, down_codec.row_bytes(i)))
        for name, part, shape, fmt in zip(("gate", "up", "down"), (gate, up, down), shapes,
                                          (self.fmt, self.fmt, down_format)):
            if part.numel() != shape[0] * shape[1] * shape[2]:
                raise ValueError(f"{fmt} {name} experts hold {part.numel()} bytes, expected {shape}")
        if layer in self._buffers:
            self._buffers.pop(layer).release()
        self._down_formats.pop(layer, None)
        if down_format != self.fmt:
            self._down_formats[layer] = down_format
        block_bytes = self.block_bytes_of(layer)
        buffer = HostBuffer(self.num_experts * block_bytes, torch.uint8, self.pin_memory)
        blocks = buffer.tensor.view(self.num_experts, block_bytes)
        gu, dn = quant_views(blocks, i, h, codec, down_codec)
        gu[:, :i].copy_(gate.reshape(shapes[0]))
        gu[:, i:].copy_(up.reshape(shapes[1]))
        dn.copy_(down.reshape(shapes[2]))
        self._buffers[layer] = buffer
        self.layers[layer] = blocks

    def take_layer(self, layer: int) -> torch.Tensor:
        """`layer`'s blocks out of the store (a pinned layer's, to be copied to the GPU whole): the host
        buffer is unregistered and nothing of the layer stays listed but its down part's format, which the
        pinned layer's kernels still read. The caller holds the returned tensor as long as it needs it."""
        blocks = self.layers.pop(layer)
        self._buffers.pop(layer).release()
        return blocks

    def dequantized(self, blocks: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, block) of `layer` in this store's format -> gate_up (rows, 2I, H) and down (rows, H, I)
        in the slab dtype (views for the model format; new tensors, on the blocks' device, when quantized)."""
        if not self.quantized:
            return block_views(blocks, self.inter, self.hidden)
        down_codec = PART_CODECS[self.down_format(layer)]
        gu, dn = quant_views(blocks, self.inter, self.hidden, self.codec, down_codec)
        return self.codec.dequantize(gu, self.hidden, self.dtype), down_codec.dequantize(dn, self.inter, self.dtype)

    def release(self) -> None:
        """Unregister and free every layer's blocks (the store is empty afterwards)."""
        self.layers.clear()
        self._down_formats.clear()
        for buffer in self._buffers.values():
            buffer.release()
        self._buffers.clear()

    def block(self, layer: int, expert: int) -> torch.Tensor:
        return self.layers[layer][expert]

    def block_parts(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's gate_up (2I, H) and down (H, I) as views, to copy into the two slab pools (the
        model format; a quantized block is fetched whole and dequantized: `dequantized`)."""
        if self.quantized:
            raise RuntimeError("a quantized store's blocks are fetched whole and dequantized, not copied in parts")
        gate_up, down = block_views(self.layers[layer][expert:expert + 1], self.inter, self.hidden)
        return gate_up[0], down[0]

    @property
    def nbytes(self) -> int:
        return sum(self.num_experts * self.block_bytes_of(layer) for layer in self.layers)
