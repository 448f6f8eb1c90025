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

from ..residency import Residency
from ..table_experts import block_experts


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
    return block_experts(hidden, top_k_index, top_k_weights, act, res.pool[0], res.row_map[res.index[layer]],
                         res.store, layer, res.num_experts, use_kernels, prompt=hidden.shape[0] > 1)
