"""Full-size models with random weights, built on the machine that runs them (benchmarks).

`load_synthetic("qwen3-vl-30b-a3b", rules)` assembles Qwen3-VL-30B-A3B's real shapes (48 layers x
128 experts, hidden 2048, expert intermediate 768, top-8, the 27-block vision tower) exactly as
`vismmoe_kt.load` does, but a SyntheticReader makes each tensor on demand instead of reading a
checkpoint: nothing is downloaded and nothing is written to disk. `layers=N` keeps only the first N
decoder layers for hosts with less memory. The tokenizer is the tiny byte-level one (its ids are
what the config names), so prompts cost more tokens than with Qwen's real vocabulary.

Random weights route tokens almost uniformly over the experts: any figure that depends on routing
(hit rates, prefetch value) is not what a trained model would show.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

from ..core.loader import _build_on_meta, assemble, parse_dtype, pick_default_device
from ..models import adapter_for
from .tiny import TinySpec, build_processor

# Qwen3-VL-30B-A3B-Instruct's published shapes (vision + text); token ids come from our tokenizer.
QWEN3_VL_30B_A3B = {
    "text": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                 num_experts=128, num_experts_per_tok=8, max_position_embeddings=262144, rms_norm_eps=1e-6,
                 tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                  "mrope_interleaved": True}),
    "vision": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                   patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                   deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
}
SYNTHETIC_MODELS = {"qwen3-vl-30b-a3b": QWEN3_VL_30B_A3B}


def synthetic_config(name: str, tokenizer: Any, layers: int | None = None):
    from transformers import Qwen3VLMoeConfig

    if name not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic model {name!r}; choose one of {', '.join(SYNTHETIC_MODELS)}")
    shapes = SYNTHETIC_MODELS[name]
    text = dict(shapes["text"])
    if layers is not None:
        text["num_hidden_layers"] = layers
    token = tokenizer.convert_tokens_to_ids
    text.update(eos_token_id=token("<|im_end|>"), pad_token_id=token("<|endoftext|>"))
    return Qwen3VLMoeConfig(text_config=text, vision_config=dict(shapes["vision"]), tie_word_embeddings=False,
                            image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
                            vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"))


class SyntheticReader:
    """The CheckpointReader interface, with every tensor made on demand from a seed.

    Tensors are generated on the GPU when one is present (fast) and moved where they are asked for.
    Norm weights are ones and biases zeros, other weights N(0, 0.02), so activations stay finite.
    """

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype, seed: int = 0, name: str = "synthetic"):
        self.shapes, self.dtype, self.seed = shapes, dtype, seed
        self.model_dir = f"<{name}, random weights>"
        self.layout_fix = None
        self.device_map: dict[str, dict[str, Any]] = {}
        self.on_tensor = None
        self.make_on = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
        self.staging_device = self.make_on  # operators that copy weights into their own memory read from here

    def planned_device(self, module_key: str, fallback: torch.device | str) -> torch.device:
        return torch.device(self.device_map.get(module_key, {}).get("generate_device", fallback))

    def load_tensor(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=self.dtype, device=device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=self.dtype, device=device)
        else:
            generator = torch.Generator(device=self.make_on).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            tensor = torch.empty(shape, dtype=self.dtype, device=self.make_on).normal_(0.0, 0.02, generator=generator)
            tensor = tensor.to(device)
        if self.on_tensor is not None:
            self.on_tensor(name, tensor.numel() * tensor.element_size())
        return tensor

    def close(self) -> None:
        pass


def load_synthetic(name: str = "qwen3-vl-30b-a3b", rules: Any = None, *, layers: int | None = None,
                   dtype: str | torch.dtype = "bfloat16", seed: int = 0, progress: bool = True,
                   max_image_pixels: int = 1024 * 1024, **overrides: Any):
    """Like `vismmoe_kt.load`, for a full-size random-weight model; returns `(model, processor)`."""
    processor = build_processor(TinySpec(1, 1, 1, 1, 1, max_image_pixels=max_image_pixels))
    config = synthetic_config(name, processor.tokenizer, layers)
    return assemble_synthetic(config, processor, rules, dtype=dtype, seed=seed, name=name, progress=progress,
                              **overrides)


def assemble_synthetic(config: Any, processor: Any, rules: Any = None, *, dtype: str | torch.dtype = "bfloat16",
                       seed: int = 0, name: str = "synthetic", progress: bool = True, **overrides: Any):
    """`config`'s model with SyntheticReader's weights (`seed`), assembled as `vismmoe_kt.load` does."""
    start = time.perf_counter()
    adapter = adapter_for(config.model_type)
    meta = _build_on_meta(adapter, config)
    shapes = {n: t.shape for n, t in list(meta.named_parameters()) + list(meta.named_buffers())}
    del meta
    reader = SyntheticReader(shapes, parse_dtype(dtype), seed, name)
    device = overrides.get("generate_device") or pick_default_device()
    model = assemble(config, adapter, reader, rules, device, progress, overrides)
    model.generation_config.eos_token_id = None  # random weights: decode the requested number of tokens
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.vismmoe.load_seconds = time.perf_counter() - start
    return model, processor
