"""The hybrid CPU path inside a table step: a layer's CPU pairs (slot CPU_PAIR, the cost model's share
of the misses: DecodeTable.cpu_quota) computed by the CPU backend beside the GPU's pairs.

On CUDA both halves (kt-kernel's host functions and the small copies around them) go on a stream of
their own, forked after the plan and joined before the sum, so the GPU's pairs compute meanwhile, the
compute stream never stalls on a host function, and the step stays one graph; on the CPU the backend
runs there and then.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..decode_table import CPU_PAIR
from ..residency import Residency


class TableCpuJoin:
    def __init__(self, res: Residency, cpu: Any):
        self.res, self.cpu = res, cpu
        # the device is fixed for the runtime's life: the CUDA path (a stream of the CPU calls' own) or the
        # CPU's, bound once; the table step calls `begin` only in steps whose quota sends misses to the CPU
        cuda = res.device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(res.device) if cuda else None
        self.begin: Callable[..., Callable[[], torch.Tensor]] = self._begin_on_stream if cuda else self._begin_here

    def _begin_on_stream(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                         top_k_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start the CPU on this layer's CPU pairs (ids of the others -1, which the backend skips) on a
        stream of their own, so the GPU's pairs never wait on a host function; return what joins it."""
        device, side = self.res.device, self._stream
        cpu_ids = torch.where(slots == CPU_PAIR, ids, -1).view(1, -1)
        compute = torch.cuda.current_stream(device)
        side.wait_stream(compute)
        for t in (hidden, cpu_ids, top_k_weights):
            t.record_stream(side)  # the compute stream may free them while the side stream reads
        with torch.cuda.stream(side):
            self.cpu.begin_on_stream(layer, hidden, cpu_ids, top_k_weights)
            out = self.cpu.end_on_stream(device, hidden.dtype)

        def joined() -> torch.Tensor:
            compute.wait_stream(side)
            out.record_stream(compute)
            return out
        return joined

    def _begin_here(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                    top_k_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """On the CPU: the backend computes the CPU pairs there and then."""
        cpu_ids = torch.where(slots == CPU_PAIR, ids, -1).view(1, -1)
        out = self.cpu.submit(layer, hidden, cpu_ids, top_k_weights.float()).wait().to(hidden.dtype)
        return lambda: out
