"""The hybrid mode's choice for a missing expert: fetch it to the GPU and wait, or run its tokens on
the CPU backend, overlapped with the GPU's hits (VisMMOE 3.5).

`miss_policy`: wait (always fetch), cpu (always the CPU), auto (per expert, by the cost model: one
block copy against the CPU's fixed cost plus its cost per token, measured once on this machine at the
first miss, or pinned by the rule's `cost_model`). The CPU backend is made here: kt-kernel's AMX/AVX
kernels where they fit (its own BF16 copy of every expert it serves), else torch on the host store.
"""

from __future__ import annotations

import torch

from .budget import BudgetError, human_bytes
from .cost_model import CostModel, calibrate
from .offload_settings import OffloadSettings


class MissPolicy:
    def __init__(self, settings: OffloadSettings, num_experts: int, hidden: int, inter: int, top_k: int,
                 offloaded_layers: int, layer_bytes: int):
        self.mode = settings.miss_policy
        self.top_k = top_k
        self.cost = CostModel(*settings.cost_model) if settings.cost_model else None
        self.cpu = None if self.mode == "wait" else self._make_cpu_backend(settings.cpu_backend, num_experts, hidden,
                                                                           inter, top_k, offloaded_layers, layer_bytes)

    @staticmethod
    def _make_cpu_backend(requested: str, num_experts: int, hidden: int, inter: int, top_k: int,
                          offloaded_layers: int, layer_bytes: int):
        """kt-kernel keeps its own copy of every expert it serves, which on top of the page-locked
        store doubles host memory: refuse it where that cannot fit."""
        import psutil

        from .cpu.isa import choose_backend
        from .cpu.kt_backend import kt_kernel_supports

        name = choose_backend(requested, shape_ok=kt_kernel_supports(hidden, inter))
        if name == "torch":
            from .cpu.torch_backend import TorchCpuBackend

            return TorchCpuBackend()
        needed = offloaded_layers * (layer_bytes + num_experts * 3 * inter * hidden * 2)
        total = psutil.virtual_memory().total
        if needed > 0.9 * total:
            raise BudgetError(
                f"cpu_backend kt-kernel keeps its own copy of the experts beside the store: "
                f"{human_bytes(needed)} of host memory for {offloaded_layers} offloaded layers, this host has "
                f"{human_bytes(total)}; use cpu_backend: torch (reads the store in place)")
        from .cpu.kt_backend import KtKernelBackend

        return KtKernelBackend(num_experts, top_k, hidden, inter)

    def on_cpu(self, store, layer: int, missing: list[int], pairs: dict[int, int], device: torch.device) -> set[int]:
        """Which missing experts run on the CPU backend (the rest are fetched)."""
        if self.mode == "wait" or not missing:
            return set()
        if self.mode == "cpu":
            return set(missing)
        if self.cost is None:
            self.cost = calibrate(store, layer, self.cpu, device, self.top_k)
        return {e for e in missing if self.cost.prefers_cpu(pairs[e])}
