"""ExpertStore: one contiguous host block per logical expert of the offloaded layers.

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

from .host_memory import HostBuffer


def block_views(blocks: torch.Tensor, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block) -> gate_up (rows, 2I, H) and down (rows, H, I) views of the same memory."""
    rows = blocks.shape[0]
    split = 2 * inter * hidden
    return blocks[:, :split].view(rows, 2 * inter, hidden), blocks[:, split:].view(rows, hidden, inter)


class ExpertStore:
    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, pin_memory: bool):
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.dtype, self.pin_memory = dtype, pin_memory
        self.block_elems = 3 * inter * hidden
        self.block_bytes = self.block_elems * torch.tensor([], dtype=dtype).element_size()
        self.layers: dict[int, torch.Tensor] = {}
        self._buffers: dict[int, HostBuffer] = {}

    def fill_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        if layer in self._buffers:
            self._buffers.pop(layer).release()
        buffer = HostBuffer(self.num_experts * self.block_elems, self.dtype, self.pin_memory)
        blocks = buffer.tensor.view(self.num_experts, self.block_elems)
        gu, dn = block_views(blocks, self.inter, self.hidden)
        gu.copy_(gate_up)
        dn.copy_(down)
        self._buffers[layer] = buffer
        self.layers[layer] = blocks

    def release(self) -> None:
        """Unregister and free every layer's blocks (the store is empty afterwards)."""
        self.layers.clear()
        for buffer in self._buffers.values():
            buffer.release()
        self._buffers.clear()

    def block(self, layer: int, expert: int) -> torch.Tensor:
        return self.layers[layer][expert]

    def block_parts(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's gate_up (2I, H) and down (H, I) as views, to copy into the two slab pools."""
        gate_up, down = block_views(self.layers[layer][expert:expert + 1], self.inter, self.hidden)
        return gate_up[0], down[0]

    @property
    def nbytes(self) -> int:
        return len(self.layers) * self.num_experts * self.block_bytes
