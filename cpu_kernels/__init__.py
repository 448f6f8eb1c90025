"""CPU expert backends for routed experts that run on the host, and the ISA detection that picks one.

A floor below vismmoe_kt: nothing here imports it (tests/test_architecture.py holds that); the
offload runtime and the operators build on these backends.

Backends (one interface, `cpu_kernels.base.CpuExpertBackend`):
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

from typing import Any

BACKENDS = ("auto", "kt-kernel", "torch")
CPU_DTYPES = ("bf16", "int8", "int4")


def make_backend(requested: str, shape: Any, threads: int | None = None, dtype: str = "bf16",
                 model_dir: Any = None, sources: Any = (), model_on_cpu: bool = False):
    """One CPU backend for a model's experts (`shape`: the adapter's MoEShape; `threads`: kt-kernel's
    workers, `--cpu_infer`, default physical cores - 2: cpu_kernels/threads.py; `dtype`: the experts'
    precision there, quantized copies cached under `model_dir`, fingerprinting it and `sources`; `model_on_cpu`:
    the model runs on the CPU too, so the torch backend computes in the caller's thread: torch_backend.py)."""
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

    return TorchCpuBackend(in_caller=model_on_cpu)
