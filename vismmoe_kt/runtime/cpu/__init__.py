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
