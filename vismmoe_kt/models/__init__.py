"""Model adapters, one module per family, looked up by `config.model_type`.

Adapters are imported only when a model of their family is loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import LoadError
from .base import ModelAdapter, MoEShape

# model_type -> "module:Class" (imported on first use)
REGISTRY: dict[str, str] = {
    "qwen3_vl_moe": "vismmoe_kt.models.qwen3_vl_moe:Qwen3VLMoeAdapter",
    "glm4v_moe": "vismmoe_kt.models.glm4v_moe:Glm4vMoeAdapter",
    "deepseek_ocr2": "vismmoe_kt.models.deepseek_ocr2:DeepseekOcr2Adapter",
    "kimi_k25": "vismmoe_kt.models.kimi_k25:KimiK25Adapter",
    "ernie4_5_vl_moe": "vismmoe_kt.models.ernie4_5_vl_moe:Ernie45VLMoeAdapter",
    "llama4": "vismmoe_kt.models.llama4:Llama4Adapter",
}


_INSTANCES: dict[str, ModelAdapter] = {}


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def adapter_for(model_type: str | None, where: Any = "config") -> ModelAdapter:
    if model_type not in REGISTRY:
        raise LoadError(
            f"{where}: unsupported architecture model_type={model_type!r}; "
            f"supported: {', '.join(supported_model_types())}"
        )
    if model_type not in _INSTANCES:  # adapters hold no state: one per family
        module_name, _, class_name = REGISTRY[model_type].partition(":")
        _INSTANCES[model_type] = getattr(importlib.import_module(module_name), class_name)()
    return _INSTANCES[model_type]


__all__ = ["ModelAdapter", "MoEShape", "adapter_for", "supported_model_types", "REGISTRY"]
