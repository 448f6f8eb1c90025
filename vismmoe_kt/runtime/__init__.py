"""The offload runtime: expert weights live in host memory, a working set lives on the GPU.

Vocabulary (used with these meanings everywhere in the project):
- logical expert: one expert of one MoE layer, the key `(layer, expert)`; the same index in two
  layers names two different weights.
- block: one logical expert's weights as one contiguous run of host memory, `[gate_up (2I x H) |
  down (H x I)]`. The ExpertStore keeps a block per non-pinned logical expert in page-locked memory.
- pinned prefix: the first `L_pinned` MoE layers, whose whole expert pool stays on the GPU (VisMMOE
  Eq. 10 picks L_pinned from the budget). Their routing is seen without any transfer.
- slab: one block-sized piece of the GPU expert cache, allocated once at start-up (row s of the
  gate_up pool and row s of the down pool); it holds one logical expert or nothing.
- resident: a slab holds the expert and its copy has completed. in flight: the copy is issued and
  not yet complete.
- Required / Speculative / Expired (VisMMOE 3.4.2): a resident expert is Required while the layer
  executing uses it (or its copy is in flight), Speculative while it waits for a layer that has not
  run in this step, Expired once its layer has run in this step. Eviction takes Expired first, then
  the lowest-priority Speculative, never Required.
- step: one pass through all layers (a prefill, or one decoded token).
- prefetch: a copy issued ahead of need from a priority list of logical experts. fetch: an urgent
  copy of a needed expert that is not resident. stall: the compute stream waits on a copy.
- expert budget: all GPU memory for routed experts, pinned prefix plus slabs.

Modules: `budget` (Eq. 10, byte sizes), `store` (host blocks), `slab_cache` (residency state and
eviction policy, pure host data), `transfers` (copy streams, events, prefetch worker),
`offload` (the runtime the VisExperts operators share), `expert_compute` (grouped GEMM over a bank
of blocks), `table_experts` (a decode step's routed experts, Triton kernel or torch twin), `kernels/`
(the Triton kernels, one concept per module, and their tuned tiles per device: kernels/__init__.py).
"""
