"""The paper's "AC" baseline: stock Hugging Face modules dispatched by accelerate's `device_map`.

The model is loaded whole into host memory, then `infer_auto_device_map` fills the GPU up to
`max_memory` in module order (whole decoder layers and vision blocks, never split) and
`dispatch_model` leaves the rest on the host, where accelerate's hooks copy each block's weights to
the GPU every time it runs: what `from_pretrained(device_map="auto", max_memory=...)` gives users.
The GPU cap is the expert budget plus the model's non-expert weights, so AC holds as many bytes of
weights on the GPU as the offload runtime does.
"""

from __future__ import annotations

import psutil
from torch import nn

EXPERT_PARAMETER = ".mlp.experts."


def non_expert_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if EXPERT_PARAMETER not in name)


def expert_bytes(model: nn.Module) -> int:
    """The routed experts' bytes (what a budget given as a share, "30%", is a share of)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if EXPERT_PARAMETER in name)


def plan_device_map(model: nn.Module, gpu_bytes: int, device_index: int = 0) -> dict[str, int | str]:
    """accelerate's placement of whole blocks with the GPU capped at `gpu_bytes` (pure: reads the model)."""
    from accelerate import infer_auto_device_map

    max_memory = {device_index: gpu_bytes, "cpu": psutil.virtual_memory().total}
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=list(model._no_split_modules or []))


def dispatch_with_accelerate(model: nn.Module, gpu_bytes: int, device_index: int = 0) -> dict:
    """Dispatch `model` (all on the host) with the GPU capped at `gpu_bytes`; returns what went where."""
    from accelerate import dispatch_model

    device_map = plan_device_map(model, gpu_bytes, device_index)
    dispatch_model(model, device_map=device_map, main_device=device_index)
    on_gpu = sum(1 for where in device_map.values() if where not in ("cpu", "disk"))
    return {"blocks_on_gpu": on_gpu, "blocks": len(device_map), "gpu_cap_bytes": gpu_bytes}
