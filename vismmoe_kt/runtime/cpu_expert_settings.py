"""CpuExpertSettings: the CpuExperts rule's kwargs (vismmoe_kt/operators/cpu_experts.py).

Which CPU backend computes the experts, at which precision (cpu_kernels/), and when a long prompt's
layers run on the GPU instead (layerwise_prefill.py): the settings span both, so they live here,
above the backends they name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpu_kernels import BACKENDS, CPU_DTYPES

from .layerwise_prefill import FORMATS


@dataclass
class CpuExpertSettings:
    """The CpuExperts rule's kwargs."""

    cpu_backend: str = "auto"  # auto: kt-kernel where the ISA and expert shapes allow, else torch | kt-kernel | torch
    # auto: a GGUF's quantized experts as stored (kt-kernel's llamafile kernels), else bf16 | bf16 | int8 | int4:
    # kt-kernel quantizes at load, cached beside the model
    cpu_dtype: str = "auto"
    # KTransformers' dual prefill: a call of at least this many tokens runs its layer's experts on the GPU
    # from a host copy in `gpu_prefill_format`, copied a layer ahead (runtime/layerwise_prefill.py); 0: off
    gpu_prefill_tokens: int = 0
    gpu_prefill_format: str = "auto"  # auto: q4_k where the widths allow, else q8_0 | model | q8_0 | q4_0 | q4_k | q5_k
    gpu_prefill_share: Any = 1.0  # the GPU's share of a layer's experts there (the CPU computes the rest) | auto

    def __post_init__(self):
        if self.cpu_backend not in BACKENDS:
            raise ValueError(f"cpu_backend {self.cpu_backend!r} is not one of: {', '.join(BACKENDS)}")
        if self.cpu_dtype not in ("auto",) + CPU_DTYPES:
            raise ValueError(f"cpu_dtype {self.cpu_dtype!r} is not one of: auto, {', '.join(CPU_DTYPES)}")
        if self.cpu_dtype not in ("auto", "bf16") and self.cpu_backend == "torch":
            raise ValueError(f"cpu_dtype {self.cpu_dtype} needs cpu_backend kt-kernel (or auto): the torch backend "
                             "computes the checkpoint's dtype")
        if isinstance(self.gpu_prefill_tokens, bool) or not isinstance(self.gpu_prefill_tokens, int) \
                or self.gpu_prefill_tokens < 0:
            raise ValueError(f"gpu_prefill_tokens must be 0 (off) or a token count, got {self.gpu_prefill_tokens!r}")
        if self.gpu_prefill_format not in FORMATS:
            raise ValueError(f"gpu_prefill_format {self.gpu_prefill_format!r} is not one of: {', '.join(FORMATS)}")
        share = self.gpu_prefill_share
        if share != "auto" and (isinstance(share, (bool, str)) or not 0 < float(share) <= 1):
            raise ValueError(f"gpu_prefill_share must be in (0, 1] or auto, got {share!r}")
