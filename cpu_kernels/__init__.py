"""CPU expert backends for routed experts that run on the host, and the ISA detection that picks one.

Backends (one interface, `vismmoe_kt.runtime.cpu.base.CpuExpertBackend`):
- `kt-kernel`: the KTransformers team's AMX / AVX-512-BF16 / AVX2 MoE kernels, through their
  low-level `CPUInfer` + `moe.*BF16_MOE` API (no CUDA needed). They repack the weights they are given
  into their own layout, i.e. they hold a second host copy of every expert they serve.
- `torch`: oneDNN matmuls (which use AMX / AVX-512 themselves) reading the ExpertStore's own blocks
  in place: no extra host memory.

Memory design (a 62 GB model on a 128 GB host): the KTransformers-style baseline (every routed
expert on the CPU, nothing fetched to the GPU) gives kt-kernel the only copy, so it fits. The hybrid
mode already keeps every offloaded expert in the page-locked ExpertStore for GPU fetches; a second
kt-kernel copy would need about 116 GB, so hybrid mode computes CPU misses with the torch backend on
the store's blocks (1x memory) unless the rule asks for kt-kernel explicitly and the host has room.
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "kt-kernel", "torch")
CPU_DTYPES = ("bf16", "int8", "int4")


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
        from ..layerwise_prefill import FORMATS

        if isinstance(self.gpu_prefill_tokens, bool) or not isinstance(self.gpu_prefill_tokens, int) \
                or self.gpu_prefill_tokens < 0:
            raise ValueError(f"gpu_prefill_tokens must be 0 (off) or a token count, got {self.gpu_prefill_tokens!r}")
        if self.gpu_prefill_format not in FORMATS:
            raise ValueError(f"gpu_prefill_format {self.gpu_prefill_format!r} is not one of: {', '.join(FORMATS)}")
        share = self.gpu_prefill_share
        if share != "auto" and (isinstance(share, (bool, str)) or not 0 < float(share) <= 1):
            raise ValueError(f"gpu_prefill_share must be in (0, 1] or auto, got {share!r}")


def make_backend(requested: str, shape: Any, threads: int | None = None, dtype: str = "bf16",
                 model_dir: Any = None, sources: Any = ()):
    """One CPU backend for a model's experts (`shape`: the adapter's MoEShape; `threads`: kt-kernel's
    workers, `--cpu_infer`, default physical cores - 2: runtime/cpu/threads.py; `dtype`: the experts'
    precision there, quantized copies cached under `model_dir`, fingerprinting it and `sources`)."""
    from .isa import choose_backend
    from .kt_backend import kt_kernel_supports

    name = choose_backend("kt-kernel" if dtype != "bf16" else requested,
                          shape_ok=kt_kernel_supports(shape.hidden, shape.inter))
    if name == "kt-kernel":
        from .kt_backend import KtKernelBackend

        return KtKernelBackend(shape.num_experts, shape.top_k, shape.hidden, shape.inter, threads=threads,
                               dtype=dtype, model_dir=model_dir, sources=sources)
    if dtype != "bf16":
        raise ValueError(f"cpu_dtype {dtype} needs kt-kernel, which cannot run on this CPU")
    from .torch_backend import TorchCpuBackend

    return TorchCpuBackend()
