"""CpuExperts: every routed expert of a layer computed on the CPU (KTransformers' placement).

The baseline users run today: attention, router and vision tower stay on the GPU, each MoE layer
ships its activations to the host, the CPU backend (kt-kernel's AMX/AVX kernels where installed,
else torch) computes the routed experts, and the result comes back. Weights are read through the
loader straight into the backend: kt-kernel repacks them into its own memory (its copy is the only
one kept); the torch backend keeps the loader's tensors (mmap-backed pages of the checkpoint).

Rule kwargs: `cpu_backend` auto (default) | kt-kernel | torch. Threads: `--cpu_infer`.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .base import HF_READ_ATTRIBUTES, BaseInjectedModule

CONTEXT_KEY = "cpu_expert_backend"
_WEIGHTS = ("gate_up_proj", "down_proj")


def shared_backend(loader: Any, config: Any, requested: str):
    """One CPU backend per load (one kt-kernel worker pool for all layers)."""
    from vismmoe_kt.runtime.cpu.isa import choose_backend
    from vismmoe_kt.runtime.cpu.kt_backend import kt_kernel_supports

    context = getattr(loader, "context", None)
    if context is None:
        raise ValueError("CpuExperts needs vismmoe_kt's loader (load the model with vismmoe_kt.load)")
    if CONTEXT_KEY not in context:
        text = config.get_text_config()
        name = choose_backend(requested, shape_ok=kt_kernel_supports(text.hidden_size, text.moe_intermediate_size))
        if name == "kt-kernel":
            from vismmoe_kt.runtime.cpu.kt_backend import KtKernelBackend

            context[CONTEXT_KEY] = KtKernelBackend(text.num_experts, text.num_experts_per_tok, text.hidden_size,
                                                   text.moe_intermediate_size)
        else:
            from vismmoe_kt.runtime.cpu.torch_backend import TorchCpuBackend

            context[CONTEXT_KEY] = TorchCpuBackend()
    return context[CONTEXT_KEY]


@dataclass
class CpuCallStats:
    calls: int = 0
    tokens: int = 0
    cpu_seconds: float = 0.0  # submit to result, host clock (includes the copies to and from the host)


class CpuExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("act_fn",)

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module,
                 prefill_device: str = "cuda", generate_device: str = "cuda", cpu_backend: str = "auto", **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        match = re.search(r"layers\.(\d+)\.", key)
        if not match:
            raise ValueError(f"cannot tell the layer index from module name {key!r}")
        self.layer = int(match.group(1))
        self.backend = shared_backend(gguf_loader, config, cpu_backend)
        self.counters = CpuCallStats()

    def load(self) -> None:
        from ..core.weights import read_tensor

        experts = self.orig_module
        tensors = [read_tensor(self.gguf_loader, f"{self.key}.{name}", torch.device("cpu"), getattr(experts, name).shape)
                   for name in _WEIGHTS]
        self.backend.add_layer(self.layer, *tensors)
        for name in _WEIGHTS:  # the backend holds the weights now
            del experts._parameters[name]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        task = self.backend.submit(self.layer, hidden_states.cpu(), top_k_index.cpu(), top_k_weights.float().cpu())
        out = task.wait().to(hidden_states.device)
        self.counters.calls += 1
        self.counters.tokens += hidden_states.shape[0]
        self.counters.cpu_seconds += time.perf_counter() - start
        return out

    def stats(self) -> dict[str, Any]:
        first = self.layer == min(self.backend.layers)
        backend = {"cpu_backend": self.backend.describe(), "bytes_cpu_backend": self.backend.host_bytes} if first else {}
        return {**backend, **asdict(self.counters)}
