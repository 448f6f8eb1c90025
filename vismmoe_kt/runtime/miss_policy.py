"""The hybrid mode's choice for a missing expert: fetch it to the GPU and wait, or run its tokens on
the CPU backend, overlapped with the GPU's hits (VisMMOE 3.5).

`miss_policy`: wait (always fetch), cpu (always the CPU), auto (per layer, the split of its misses
that the cost model says finishes first, copies and CPU work overlapping: cost_model.py; rates
measured on this machine at the first miss and followed online, or pinned by the rule's `cost_model`). The CPU backend is made here: kt-kernel's AMX/AVX
kernels where they fit (its own BF16 copy of every expert it serves), else torch on the host store.
"""

from __future__ import annotations

import torch

from .budget import BudgetError, human_bytes
from .cost_model import CostModel, CostTracker, calibrate
from .offload_settings import OffloadSettings
from .quota_trial import QuotaTrial


class MissPolicy:
    def __init__(self, settings: OffloadSettings, num_experts: int, hidden: int, inter: int, top_k: int,
                 offloaded_layers: int, layer_bytes: int, cpu_threads: int | None = None, model_dir=None,
                 sources=(), model_on_cpu: bool = False):
        """`model_on_cpu`: the model computes on the CPU too (the torch backend then runs in the caller's thread)."""
        self.mode = settings.miss_policy
        self.top_k = top_k
        self.cost = CostTracker(CostModel(*settings.cost_model), pinned=True) if settings.cost_model else None
        self._seen: tuple[int, float] | None = None  # the copy counters at the last look (observed_copies)
        self._quota: tuple | None = None             # (cost model, decode quota) last computed
        # table decode: the cost model's quota is kept only while steps measure faster with it
        self.trial = QuotaTrial() if self.mode == "auto" else None
        self.cpu = None if self.mode == "wait" else self._make_cpu_backend(
            settings.cpu_backend, num_experts, hidden, inter, top_k, offloaded_layers, layer_bytes, cpu_threads,
            "bf16" if settings.cpu_dtype == "auto" else settings.cpu_dtype, model_dir, sources, model_on_cpu)

    @staticmethod
    def _make_cpu_backend(requested: str, num_experts: int, hidden: int, inter: int, top_k: int,
                          offloaded_layers: int, layer_bytes: int, cpu_threads: int | None = None,
                          dtype: str = "bf16", model_dir=None, sources=(), model_on_cpu: bool = False):
        """kt-kernel keeps its own copy of every expert it serves, which on top of the page-locked
        store doubles host memory: refuse it where that cannot fit."""
        import psutil

        from cpu_kernels.isa import choose_backend
        from cpu_kernels.kt_backend import kt_kernel_supports

        name = choose_backend("kt-kernel" if dtype != "bf16" else requested, shape_ok=kt_kernel_supports(hidden, inter))
        if name == "torch":
            from cpu_kernels.torch_backend import TorchCpuBackend

            return TorchCpuBackend(in_caller=model_on_cpu)
        from cpu_kernels.kt_backend import BYTES_PER_WEIGHT, KtKernelBackend

        needed = offloaded_layers * (layer_bytes + num_experts * 3 * inter * hidden * BYTES_PER_WEIGHT[dtype])
        total = psutil.virtual_memory().total
        if needed > 0.9 * total:
            raise BudgetError(
                f"cpu_backend kt-kernel keeps its own {dtype} copy of the experts beside the store: "
                f"{human_bytes(needed)} of host memory for {offloaded_layers} offloaded layers, this host has "
                f"{human_bytes(total)}; use cpu_dtype: int8 or int4 (half or a quarter of the copy), or cpu_backend: "
                "torch (reads the store in place)")
        return KtKernelBackend(num_experts, top_k, hidden, inter, threads=cpu_threads, dtype=dtype, model_dir=model_dir,
                               sources=sources)

    def on_cpu(self, store, layer: int, missing: list[int], pairs: dict[int, int], device: torch.device) -> set[int]:
        """Which missing experts run on the CPU backend (the rest are fetched)."""
        if self.mode == "wait" or not missing:
            return set()
        if self.mode == "cpu":
            return set(missing)
        if self.cost is None:
            self.cost = CostTracker(calibrate(store, layer, self.cpu, device, self.top_k))
        return self.cost.model.split({e: pairs[e] for e in missing})

    def decode_quota(self, store, layer: int, device: torch.device) -> list[int]:
        """For table decode (one token: one token per missing expert): entry m is how many of a layer's
        m misses the CPU computes (`cpu`: all of them; `auto`: the cost model's split, while decode
        steps measure faster with it than without: QuotaTrial). Called once per decode step."""
        k = self.top_k
        if self.mode == "cpu":
            return list(range(k + 1))
        if self.mode != "auto":
            return [0] * (k + 1)
        if self.cost is None:
            self.cost = CostTracker(calibrate(store, layer, self.cpu, device, self.top_k))
        if self._quota is None or self._quota[0] != self.cost.model:  # recomputed only when the rates move
            self._quota = (self.cost.model, [len(self.cost.model.split({e: 1 for e in range(m)})) for m in range(k + 1)])
        if self.cost.pinned:  # the rule's numbers decide
            return self._quota[1]
        return self.trial.choose(self._quota[1])

    def decode_interrupted(self) -> None:
        """Decode steps stopped (prefill, reset): the next one's start times no step (QuotaTrial)."""
        if self.trial is not None:
            self.trial.interrupt()

    def observed_copies(self, counters) -> None:
        """Follow the link's copy rate: the seconds of the copies timed since the last look, per copy
        (the transfers' counters; a copy is timed once its CUDA events have passed)."""
        counters.resolve()
        seen = self._seen
        if seen is None or self.cost is None:  # before calibration: start counting from here
            self._seen = (counters.copies_timed, counters.copy_seconds)
            return
        copies, seconds = counters.copies_timed - seen[0], counters.copy_seconds - seen[1]
        if copies > 0 and seconds > 0:
            self.cost.observe_copy(seconds / copies)
            self._seen = (counters.copies_timed, counters.copy_seconds)

    def observed_cpu(self, experts: int, tokens: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.observe_cpu(experts, tokens, seconds)
