"""A prompt's offloaded layers where the slabs hold every offloaded expert (`plan.fill_slabs`), quantized.

The placement path reads each offloaded layer's routing back to the host (which experts to place, hit
or fetch), then decodes the layer's slabs into a bank of the model's dtype and runs grouped GEMM on it.
Where a slab holds every offloaded expert nothing is ever placed or evicted once they are all in, so:

    first prompt   every expert no slab holds yet is copied in (Transfers.fill), once, and each
                   offloaded layer's row map (expert -> slab) is set for good
    each layer     slots = row map[top_k_index], on the device; the expert-major kernels
                   (kernels/quantized_major.py) decode each routed expert's blocks in its slab once per
                   block of its tokens and multiply on tensor cores; the K outputs of a token combined
                   in a fixed order

No host read, no lock, no bank of the model's dtype: the host queues the whole prompt's layers while the
device computes them. Why: on the H200 a 236-token prompt on Q4_K slabs spent 55 ms decoding whole
layers into banks and 214 ms of its 306 ms idle between the per-layer reads (BENCHMARKS.md).

Pairs are counted per layer call only: counting the experts a layer touched would need its routing on
the host, the read this path exists to avoid. Where the Triton kernels do not run (the CPU) the torch
twin computes the same plan from the store's own dequantization.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels import expert_major, quantized_major, tuning
from ..residency import Residency
from ..table_experts import combine


class FilledPrefill:
    def __init__(self, res: Residency, use_kernels: bool):
        self.res, self.use_kernels = res, use_kernels

    def fill(self) -> None:
        """Every offloaded expert into a slab (those already in one stay), waited for, and the row maps set
        (lock held: the caller's)."""
        res = self.res
        res.transfers.fill(res.cold_experts())
        res.transfers.landed.clear()  # published to a decode table when decode first starts
        for layer in res.offloaded:
            res.upload_rows(layer, list(range(res.num_experts)),
                            [res.cache.where[(layer, e)] for e in range(res.num_experts)])

    def run(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            act: Any) -> torch.Tensor:
        return experts_from_slabs(self.res, self.use_kernels, layer, hidden, top_k_index, top_k_weights, act)


def experts_from_slabs(res: Residency, use_kernels: bool, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
    """A layer's routed experts computed from the quantized slabs its row map names (every pair's expert must
    have one): the expert-major kernels on the device, else the same blocks from the store's dequantization."""
    return experts_from_blocks(res, use_kernels, layer, hidden, top_k_index, top_k_weights, act, res.pool[0],
                               res.row_map[res.index[layer]], prompt=hidden.shape[0] > 1)


def experts_from_blocks(res: Residency, use_kernels: bool, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, act: Any, blocks: torch.Tensor, row_map: torch.Tensor,
                        prompt: bool) -> torch.Tensor:
    """A layer's routed experts from rows of quantized blocks (`blocks`: uint8 (rows, block bytes or more);
    `row_map`: each expert's row, on the device): the slab pool with a layer's row map, or a pinned layer's
    bank with the identity. `prompt`: a prompt's many tokens per expert take the prompt's tiles; else
    (a few rows, a batched step) the batched step's."""
    store = res.store
    if use_kernels:
        slots = row_map[top_k_index].reshape(-1)  # each pair's row
        tuned = tuning.prefill_tiles(hidden.device, top_k_index.numel() / res.num_experts) if prompt else \
            {"gate_up": None, "down": None, "block_m": expert_major.BLOCK_M}
        # every pair has a row, so no landing slab or staging row is ever taken: the slots and the blocks
        # stand in for both
        y = quantized_major.experts_quantized_major(
            hidden, top_k_index, slots, slots, blocks, blocks, store.fmt, store.down_format(layer), res.inter,
            res.num_experts, tuned["gate_up"], tuned["down"], block_m=tuned["block_m"])
    else:  # the same blocks, each expert's weights from its row by the store's dequantization
        gate_up, down = store.dequantized(blocks[row_map, :store.block_bytes_of(layer)], layer)
        block_expert, block_pairs = expert_major.expert_blocks(top_k_index.reshape(-1), res.num_experts)
        x = hidden.to(gate_up.dtype)
        y = expert_major.experts_by_block(x, top_k_index.shape[1], block_expert, block_pairs, gate_up, down, act)
    return combine(y, top_k_weights, hidden.dtype, use_kernels)
