"""CpuExperts: every routed expert of a layer computed on the CPU (KTransformers' placement).

The baseline users run today: attention, router and vision tower stay on the GPU, each MoE layer
ships its activations to the host, the CPU backend (kt-kernel's AMX/AVX kernels where installed,
else torch) computes the routed experts, and the result comes back. Weights are read through the
loader straight into the backend: kt-kernel repacks them into its own memory (its copy is the only
one kept); the torch backend keeps the loader's tensors (mmap-backed pages of the checkpoint).

In decode on a CUDA device with kt-kernel, a token's call runs inside the stream (the backend's
`forward_on_stream`: host functions start and await the CPU task), so the lean decode step captures
these layers in its CUDA graph too; elsewhere (prefill, the torch backend) the call waits on the
host. With kt-kernel serving a CUDA model, torch keeps only the reserved cores' threads: its
host work is light, and its threads would otherwise compete with the pinned workers.

A prompt of at least `gpu_prefill_tokens` tokens takes KTransformers' other prefill: each layer's experts
cross PCIe from a host copy (Q4_K by default), a layer ahead, and run on the GPU, all of them or a share
while the CPU computes the rest (runtime/layerwise_prefill.py). Decode stays on the CPU.

Rule kwargs: CpuExpertSettings (vismmoe_kt/runtime/cpu_expert_settings.py). Workers: `--cpu_infer`
(cpu_kernels/threads.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from cpu_kernels import make_backend
from cpu_kernels.threads import leave_cores_to_workers
from torch import nn

from ..runtime.cpu_expert_settings import CpuExpertSettings
from ..runtime.layerwise_prefill import LayerwisePrefill
from ..runtime.store import raw_down_format
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule, settings_from, stored_gguf_experts


@dataclass
class CpuCallStats:
    calls: int = 0
    tokens: int = 0
    cpu_seconds: float = 0.0  # submit to result, host clock (includes the copies to and from the host)
    prefill_cpu_seconds: float = 0.0  # the same, of calls with more than one token (a prefill's)


class CpuExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("act_fn",)

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module,
                 prefill_device: str = "cuda", generate_device: str = "cuda", **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device)
        settings = settings_from(CpuExpertSettings, kwargs, "CpuExperts")
        self.layer = self.adapter.layer_of(key)
        if self.context.cpu_backend is None:  # one backend (one kt-kernel worker pool) for every layer
            model_dir = getattr(gguf_loader, "model_dir", None)  # a checkpoint directory: the quantized cache
            sources = getattr(gguf_loader, "weight_files", list)()  # weights from elsewhere (GGUF files)
            dtype = "bf16" if settings.cpu_dtype == "auto" else settings.cpu_dtype
            # the model's device (the rule places only the experts here); unknown under upstream's loop:
            # a GPU machine serves a CUDA model
            device = self.context.model_device
            serves_cuda = torch.device(device).type == "cuda" if device else torch.cuda.is_available()
            self.context.cpu_backend = make_backend(settings.cpu_backend, self.adapter.moe_shape(config),
                                                    self.context.cpu_threads, dtype, model_dir, sources,
                                                    model_on_cpu=not serves_cuda)
            if getattr(self.context.cpu_backend, "streams", False) and serves_cuda:
                leave_cores_to_workers()
        self.backend = self.context.cpu_backend
        self.settings = settings
        self.counters = CpuCallStats()
        self.act = self.adapter.expert_activation(orig_module)
        self.gpu_prefill = self._shared_gpu_prefill(config) if settings.gpu_prefill_tokens else None

    def _shared_gpu_prefill(self, config: Any) -> LayerwisePrefill:
        """The model's one LayerwisePrefill (the first CpuExperts with `gpu_prefill_tokens` makes it; every
        other must ask for the same)."""
        s = self.settings
        wanted = (s.gpu_prefill_tokens, s.gpu_prefill_format, s.gpu_prefill_share)
        made = self.context.gpu_prefill
        if made is None:
            shape = self.adapter.moe_shape(config)
            device = self.context.model_device or ("cuda" if torch.cuda.is_available() else "cpu")
            made = LayerwisePrefill(shape.num_experts, shape.hidden, shape.inter, self.model_dtype, device,
                                    s.gpu_prefill_format, s.gpu_prefill_tokens, s.gpu_prefill_share)
            made.wanted = wanted
            self.context.gpu_prefill = made
        elif made.wanted != wanted:
            raise ValueError(f"{self.key}: gpu_prefill_tokens, gpu_prefill_format, gpu_prefill_share {wanted} differ "
                             f"from another CpuExperts rule's {made.wanted}; the model's layers share one")
        return made

    def load(self) -> None:
        from ..core.weights import read_tensor

        experts, names = self.orig_module, self.adapter.expert_tensors

        def read() -> list[torch.Tensor]:
            return [read_tensor(self.gguf_loader, f"{self.key}.{name}", torch.device("cpu"),
                                getattr(experts, name).shape, self.adapter.gguf_names) for name in names]

        stored = self._stored_experts(names)
        tensors = None
        if stored is not None:  # a GGUF's quantized experts, computed as stored
            self.backend.add_layer_stored(self.layer, *stored)
        else:
            tensors = read()
            self.backend.add_layer(self.layer, *tensors)
        if self.gpu_prefill is not None:  # its host copy: a GGUF's bytes as stored where the format is theirs
            raw = stored or stored_gguf_experts(self.gguf_loader, self.key, names)
            store = self.gpu_prefill.store
            down = raw_down_format(store.fmt, store.inter, *(kind for _, kind in raw)) if raw else None
            if down is not None:
                self.gpu_prefill.fill_layer_raw(self.layer, *(data for data, _ in raw), down_format=down)
            else:
                self.gpu_prefill.fill_layer(self.layer, *(tensors if tensors is not None else read()))
        for name in names:  # the backend holds the weights now
            del experts._parameters[name]

    def _stored_experts(self, names: tuple[str, str]):
        """The GGUF's quantized experts as stored, where `cpu_dtype: auto` and the backend take them."""
        if self.settings.cpu_dtype != "auto" or not getattr(self.backend, "takes_stored", lambda: False)():
            return None
        return stored_gguf_experts(self.gguf_loader, self.key, names)

    def decode_capturable(self) -> bool:
        """A decode step may capture this layer: through kt-kernel's in-stream calls on a CUDA device
        (on the CPU its calls wait on the host, which the graphs' CPU twin replays as well), or with the
        torch backend where there is no GPU to capture for (a CUDA step would need a host sync)."""
        return getattr(self.backend, "streams", False) or not torch.cuda.is_available()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.gpu_prefill is not None and self.gpu_prefill.takes(hidden_states.shape[0], hidden_states.device):
            cpu = self.backend if self.gpu_prefill.share < 1 or self.gpu_prefill.auto_share else None
            return self.gpu_prefill.run(self.layer, hidden_states, top_k_index, top_k_weights, self.act, cpu)
        if hidden_states.device.type == "cuda" and hidden_states.shape[0] == 1 and getattr(self.backend, "streams", False):
            self.counters.calls += 1  # host time is not measurable here: the call runs inside the stream
            self.counters.tokens += 1
            return self.backend.forward_on_stream(self.layer, hidden_states, top_k_index, top_k_weights)
        start = time.perf_counter()
        task = self.backend.submit(self.layer, hidden_states.cpu(), top_k_index.cpu(), top_k_weights.float().cpu())
        out = task.wait().to(hidden_states.device)
        self.counters.calls += 1
        self.counters.tokens += hidden_states.shape[0]
        seconds = time.perf_counter() - start
        self.counters.cpu_seconds += seconds
        if hidden_states.shape[0] > 1:
            self.counters.prefill_cpu_seconds += seconds
        return out

    def stats(self) -> dict[str, Any]:
        first = self.layer == min(self.backend.layers)
        backend = {"cpu_backend": self.backend.describe(), "bytes_cpu_backend": self.backend.host_bytes} if first else {}
        if first and self.gpu_prefill is not None:
            backend.update(self.gpu_prefill.stats())
        return {**backend, **asdict(self.counters)}
