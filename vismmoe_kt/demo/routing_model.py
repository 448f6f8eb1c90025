"""The routing-study model: Qwen3-VL-MoE's architecture (vision tower + MoE text model) at a size where the
routing question is real (12 text layers x 64 experts, top-8, hidden 512), trained from scratch by
scripts/train_routing_model.py on the scenes task (`vismmoe_kt.demo.scenes`).

The config, tokenizer (the byte-level one) and processor are `vismmoe_kt.demo.tiny`'s builders with the specs
below; a training directory holds `spec.json` (which spec), the checkpoint (`checkpoint.pt`: weights,
optimizer state, step) and, once training ends, a normal Hugging Face model directory (config.json,
model.safetensors, the processor's files) that `vismmoe_kt.load` reads with any rule file.
`load_routing_model(directory)` rebuilds the model from either.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import LoadError
from .tiny import TinySpec, build_tiny_model

ROUTING_SPECS: dict[str, TinySpec] = {
    # the study's model: Qwen3-VL-30B-A3B's routing shape at a quarter of its depth and half its experts
    # (expert width / hidden 0.25 against its 0.375, to keep the GPU run at minutes); about 170 M parameters
    "routing-12x64": TinySpec(layers=12, experts=64, top_k=8, hidden=512, moe_intermediate=128, heads=8, kv_heads=4,
                              head_dim=64, vision_depth=4, vision_hidden=256, vision_heads=4,
                              max_image_pixels=320 * 320),
    # the architecture at widths two CPU cores train at about 0.85 steps of 16 a second: a recipe is tried here
    # before GPU time is spent on it (benchmarks/results/2026-12-04, the CPU recipe checks)
    "routing-small": TinySpec(layers=4, experts=16, top_k=4, hidden=128, moe_intermediate=64, heads=4, kv_heads=2,
                              head_dim=32, vision_depth=2, vision_hidden=128, vision_heads=4,
                              max_image_pixels=320 * 320),
    # routing-small's per-token expert work spread over 64 experts, top-8 (the study's routing shape at 4 layers):
    # enough experts that a working set can shrink, trainable on a CPU (resumable across sessions)
    "routing-small-64": TinySpec(layers=4, experts=64, top_k=8, hidden=128, moe_intermediate=32, heads=4, kv_heads=2,
                                 head_dim=32, vision_depth=2, vision_hidden=128, vision_heads=4,
                                 max_image_pixels=320 * 320),
    # the same architecture at toy widths, for tests on a CPU (seconds a step)
    "routing-tiny": TinySpec(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=48, vision_depth=1,
                             vision_hidden=32, max_image_pixels=128 * 128),
}
DEFAULT_SPEC = "routing-12x64"
SPEC_FILE, CHECKPOINT_FILE, WEIGHTS_FILE = "spec.json", "checkpoint.pt", "model.safetensors"


def routing_spec(name: str) -> TinySpec:
    if name not in ROUTING_SPECS:
        raise LoadError(f"unknown routing-model spec {name!r}; choose one of {', '.join(ROUTING_SPECS)}")
    return ROUTING_SPECS[name]


def image_size(spec: TinySpec) -> int:
    """The side of the scenes the spec is trained on: its processor's largest square."""
    return int(spec.max_image_pixels ** 0.5)


def build_routing_model(name: str = DEFAULT_SPEC, seed: int = 0):
    """A freshly initialised (random, deterministic from `seed`) model of the spec and its processor."""
    return build_tiny_model(routing_spec(name), seed)


def write_spec(directory: Path, name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SPEC_FILE).write_text(json.dumps({"spec": name}) + "\n")


def read_spec(directory: str | Path) -> str:
    path = Path(directory) / SPEC_FILE
    if not path.is_file():
        raise LoadError(f"{directory}: no {SPEC_FILE} (not a directory of scripts/train_routing_model.py)")
    try:
        return json.loads(path.read_text())["spec"]
    except (ValueError, KeyError, TypeError):
        raise LoadError(f"{path}: not a spec record ({{\"spec\": NAME}})") from None


def save_model_directory(directory: Path, model, processor) -> None:
    """The trained model as a Hugging Face directory (weights on the CPU, in fp32)."""
    model.to("cpu").save_pretrained(str(directory))
    processor.save_pretrained(str(directory))


def load_routing_model(directory: str | Path, checkpoint: bool = False):
    """`(model, processor, spec name)` from a training directory: its final weights, or with `checkpoint` (or when
    there are none yet) its last checkpoint's. The model is on the CPU in eval mode."""
    directory = Path(directory)
    name = read_spec(directory)
    model, processor = build_routing_model(name)
    weights, saved = directory / WEIGHTS_FILE, directory / CHECKPOINT_FILE
    if weights.is_file() and not checkpoint:
        from safetensors.torch import load_file

        state = load_file(str(weights))
    elif saved.is_file():
        state = torch.load(saved, map_location="cpu", weights_only=False)["model"]
    else:
        raise LoadError(f"{directory}: neither {WEIGHTS_FILE} nor {CHECKPOINT_FILE} (has training started?)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise LoadError(f"{directory}: the weights do not fit spec {name} (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    return model.eval(), processor, name
