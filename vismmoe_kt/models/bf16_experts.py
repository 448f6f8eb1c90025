"""Training's MoE experts with their products in bfloat16: transformers' grouped-GEMM experts forward, fed
bfloat16 casts of the float32 expert weights (it reads transformers' experts attributes, hence models/; the
training scripts use it).

Why: transformers' grouped_mm experts cast the activations to the weights' dtype, so under bfloat16 autocast
with float32 weights (mixed-precision training) the products stay float32, and torch's grouped GEMM has a
fast kernel only for bfloat16; for any other dtype it copies the group offsets to the host (a device
synchronisation) and runs one matrix product per expert (64 launches a projection, forward and backward).
Here both operands are bfloat16, so each projection is one grouped GEMM on the GPU's fast path. The casts
are differentiable: the gradients reach the float32 weights, which the optimizer keeps.

`use_bf16_experts(model)` switches a model built from transformers' experts classes (decorated with
`use_experts_implementation`) to this forward; the model's other products follow autocast as before.
"""

from __future__ import annotations

import torch

BF16_EXPERTS = "vismmoe_bf16_grouped_mm"


class _WeightsInBf16:
    """An experts module seen with its projection weights cast to bfloat16; every other attribute (the number of
    experts, the gate, the layout flags) is the module's own."""

    def __init__(self, experts: torch.nn.Module):
        self._experts = experts
        self.gate_up_proj = experts.gate_up_proj.to(torch.bfloat16)
        self.down_proj = experts.down_proj.to(torch.bfloat16)

    def __getattr__(self, name: str):
        return getattr(self._experts, name)


def bf16_grouped_mm_experts(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm experts forward with bfloat16 operands; the output in the input's dtype."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True):
        raise ValueError(f"{type(experts).__name__}: the bfloat16 experts forward takes gated experts without biases "
                         "(gate_up_proj and down_proj)")
    out = grouped_mm_experts_forward(_WeightsInBf16(experts), hidden_states.to(torch.bfloat16), top_k_index,
                                     top_k_weights)
    return out.to(hidden_states.dtype)


def use_bf16_experts(model) -> None:
    """Route the model's experts through `bf16_grouped_mm_experts` (registered with transformers' experts
    interface under BF16_EXPERTS)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if BF16_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(BF16_EXPERTS, bf16_grouped_mm_experts)
    model.set_experts_implementation(BF16_EXPERTS)
