"""Tiny Qwen3-VL-MoE models, built offline: random ones for tests, and the trained `--demo` model
(and tiny GLM-4.5V ones for tests, tiny_glm.py, through the same `SPECS` and builders).

Everything a model directory needs is made in code: the config, random weights (deterministic from
a seed), a byte-level BPE tokenizer with Qwen's special tokens, Qwen2-VL's PIL image processor (no
torchvision) and a chat template. `save_tiny_model` writes a normal Hugging Face directory that
`vismmoe_kt.load` (and transformers) reload. The demo model is the same directory with the weights that
scripts/train_demo_model.py trained, shipped in vismmoe_kt/demo/weights/. Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .byte_tokenizer import byte_level_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int  # keep 2*moe_intermediate != hidden so layout bugs cannot hide
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    max_image_pixels: int = 448 * 448
    tie_embeddings: bool = False
    family: str = "qwen3_vl_moe"  # the transformers model type: glm4v_moe builds in tiny_glm.py, deepseek_ocr2 in tiny_dsocr2.py,
    # kimi_k25 in tiny_kimi.py, ernie4_5_vl_moe in tiny_ernie.py, llama4 in tiny_llama4.py


SPECS: dict[str, TinySpec] = {
    "tiny-4x16": TinySpec(layers=4, experts=16, top_k=4, hidden=64, moe_intermediate=48),
    # sizes that are multiples of 32, so kt-kernel's CPU kernels can serve it too
    "tiny-6x64": TinySpec(layers=6, experts=64, top_k=8, hidden=96, moe_intermediate=64, vision_depth=3,
                          vision_hidden=48),
    # sizes that are multiples of 256, the k-quants' super-block (a Q4_K store, Q4_K GGUF files)
    "tiny-2x8": TinySpec(layers=2, experts=8, top_k=2, hidden=256, moe_intermediate=512, vision_depth=1),
    # the same at more experts than one layer's slabs hold at the smallest budget: decode misses read a
    # quantized store (scripts/gpu_check.py --stores)
    "tiny-3x32": TinySpec(layers=3, experts=32, top_k=4, hidden=256, moe_intermediate=256, vision_depth=1),
    # the trained --demo model (scripts/train_demo_model.py): small enough to train on a CPU in half an hour
    "demo-4x32": TinySpec(layers=4, experts=32, top_k=4, hidden=96, moe_intermediate=64, vision_depth=2,
                          vision_hidden=64, max_image_pixels=224 * 224),
    # Qwen3-VL-30B-A3B's expert layout (48 layers x 128 experts, top-8) at toy widths: cache policies
    # compared on the CPU under synthetic routing, at budgets scaled from the real model's
    "proxy-48x128": TinySpec(layers=48, experts=128, top_k=8, hidden=32, moe_intermediate=16, heads=2, kv_heads=1,
                             vision_depth=1, vision_hidden=32),
    # GLM-4.5V at toy widths (layer 0 dense, then MoE layers with a shared expert; sigmoid routing with a
    # correction bias; partial rotary): the second family's adapter is tested on it
    "tiny-glm-4x16": TinySpec(layers=4, experts=16, top_k=4, hidden=64, moe_intermediate=48, family="glm4v_moe"),
    # DeepSeek-OCR-2 at toy widths (layer 0 dense, then MoE layers with shared experts; softmax top-k
    # without renormalisation, scaled; 1-D RoPE; SAM + encoder vision at a quarter of its pixel sizes)
    "tiny-dsocr2-4x16": TinySpec(layers=4, experts=16, top_k=4, hidden=64, moe_intermediate=48,
                                 family="deepseek_ocr2"),
    # Kimi K2.5 at toy widths (DeepSeek-V3's text model: MLA attention, layer 0 dense, then MoE layers with a
    # shared expert; sigmoid routing with a correction bias over 4 expert groups; 1-D RoPE; MoonViT vision)
    "tiny-kimi-4x16": TinySpec(layers=4, experts=16, top_k=4, hidden=64, moe_intermediate=48, family="kimi_k25"),
    # ERNIE-4.5-VL at toy widths (layer 0 dense, then MoE layers with text experts, narrower vision experts that
    # image tokens route to, and a shared expert; softmax routing with a correction bias; M-RoPE)
    "tiny-ernie-4x16": TinySpec(layers=4, experts=16, top_k=4, hidden=64, moe_intermediate=48,
                                family="ernie4_5_vl_moe"),
    # Llama 4 at toy widths (dense and MoE layers interleaved: 1, 3 and 5 MoE; one expert per token, the sigmoid of
    # its logit scaling the expert's input; a shared expert; complex rotary, layer 3 without it; tiled vision)
    "tiny-llama4-6x16": TinySpec(layers=6, experts=16, top_k=1, hidden=64, moe_intermediate=48, family="llama4"),
}
DEMO_SPEC, DEMO_SEED = "demo-4x32", 0
FORMAT_VERSION = 4  # bump when the builder changes, so cached demo models are rebuilt


def build_tokenizer():
    return byte_level_tokenizer(SPECIAL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>")


def build_processor(spec: TinySpec):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..models.qwen3_vl_moe import Qwen3VLImageTextProcessor

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 32 * 32, "longest_edge": spec.max_image_pixels},
    )
    return Qwen3VLImageTextProcessor(image_processor, build_tokenizer(), chat_template=CHAT_TEMPLATE)


def build_config(spec: TinySpec, tokenizer):
    from transformers import Qwen3VLMoeConfig

    token = tokenizer.convert_tokens_to_ids
    quarter = spec.head_dim // 2
    mrope = [quarter - 2 * (quarter // 3), quarter // 3, quarter // 3]  # sums to head_dim/2, as M-RoPE needs
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, moe_intermediate_size=spec.moe_intermediate, num_experts=spec.experts,
        num_experts_per_tok=spec.top_k, max_position_embeddings=4096, tie_word_embeddings=spec.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope, "mrope_interleaved": True},
        eos_token_id=token("<|im_end|>"), pad_token_id=token("<|endoftext|>"),
    )
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
        num_heads=spec.vision_heads, out_hidden_size=spec.hidden, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
    )
    return Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_embeddings,
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
    )


def build_tiny_model(spec: TinySpec | str, seed: int = 0):
    """Return `(model, processor)`: a random fp32 model of the spec's family (Qwen3-VL-MoE unless it says
    otherwise) in eval mode and its processor."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    spec = SPECS[spec] if isinstance(spec, str) else spec
    if spec.family == "glm4v_moe":
        from .tiny_glm import build_tiny_glm

        return build_tiny_glm(spec, seed)
    if spec.family == "deepseek_ocr2":
        from .tiny_dsocr2 import build_tiny_dsocr2

        return build_tiny_dsocr2(spec, seed)
    if spec.family == "kimi_k25":
        from .tiny_kimi import build_tiny_kimi

        return build_tiny_kimi(spec, seed)
    if spec.family == "ernie4_5_vl_moe":
        from .tiny_ernie import build_tiny_ernie

        return build_tiny_ernie(spec, seed)
    if spec.family == "llama4":
        from .tiny_llama4 import build_tiny_llama4

        return build_tiny_llama4(spec, seed)
    processor = build_processor(spec)
    config = build_config(spec, processor.tokenizer)
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    eos = [config.text_config.eos_token_id, processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    return model, processor


def save_tiny_model(out_dir: str | Path, spec: TinySpec | str, seed: int = 0, max_shard_size: str | None = None) -> Path:
    out_dir = Path(out_dir)
    model, processor = build_tiny_model(spec, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), **kwargs)
    processor.save_pretrained(str(out_dir))
    return out_dir


def cache_root() -> Path:
    return Path(os.environ.get("VISMMOE_KT_CACHE") or Path.home() / ".cache" / "vismmoe-kt")


DEMO_WEIGHTS = Path(__file__).resolve().parent / "weights" / "model.safetensors"


def demo_weights_digest() -> str:
    """Short hash of the shipped weights: a retrained model gets a new cache directory."""
    import hashlib

    from ..errors import LoadError

    if not DEMO_WEIGHTS.is_file():
        raise LoadError(f"the demo weights {DEMO_WEIGHTS} are missing (reinstall vismmoe-kt, or retrain them "
                        f"with scripts/train_demo_model.py --out {DEMO_WEIGHTS.parent})")
    return hashlib.sha256(DEMO_WEIGHTS.read_bytes()).hexdigest()[:12]


def save_demo_model(out_dir: str | Path) -> Path:
    """The demo model directory: this module's config, tokenizer and processor + the shipped trained weights."""
    out_dir = Path(out_dir)
    model, processor = build_tiny_model(DEMO_SPEC, DEMO_SEED)  # random weights, only for config and generation config
    # what model.save_pretrained records: converters (llama.cpp's convert_hf_to_gguf.py) pick the model by it
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    # the weights as the family's published checkpoints store them (the fused experts transposed), so the directory
    # stands for a downloaded one: loaders take either layout, llama.cpp's converter only the published one
    from safetensors.torch import load_file, save_file

    from ..models import adapter_for

    adapter = adapter_for(model.config.model_type)
    tensors = {name: adapter.hub_layout(name, tensor) for name, tensor in load_file(str(DEMO_WEIGHTS)).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def staging_prefix(target: Path) -> str:
    """A build's staging directory name up to mkdtemp's random part: the host and pid of its builder, which
    tell a later run on this host whether the builder still lives (a cache may be shared by several hosts)."""
    return f"{target.name}.staging-{socket.gethostname()}-{os.getpid()}-"


def remove_stale_staging(models_dir: Path) -> None:
    """Remove staging directories of builds on this host that were killed (their process is gone); never a live
    build's, and never another host's (whose processes this host cannot see)."""
    host = socket.gethostname()
    for path in models_dir.glob("*.staging-*-*"):
        builder, _, _ = path.name.rpartition(".staging-")[2].rpartition("-")  # HOST-PID (mkdtemp's part has no "-")
        builder_host, _, pid = builder.rpartition("-")
        if builder_host not in (host, "") or not pid.isdigit():  # "": a name from before hosts were recorded
            continue
        if not _process_alive(int(pid)):  # a reused pid keeps it: erring on the safe side
            shutil.rmtree(path, ignore_errors=True)


# the demo's rules for `serve --demo --max_batch N` without a rule file (batching needs our text model's forward)
BATCHING_RULES = Path(__file__).resolve().parent / "batching.yaml"


def demo_model_dir() -> Path:
    """The embedded default model (trained on the synthetic VQA task): assembled on first use into the cache."""
    spec = SPECS[DEMO_SPEC]
    target = cache_root() / "models" / f"{DEMO_SPEC}-{demo_weights_digest()}-v{FORMAT_VERSION}"
    if (target / ".complete").exists():
        return target
    print(f"Assembling the demo model {DEMO_SPEC} ({spec.layers} layers x {spec.experts} experts, top-{spec.top_k}, "
          f"trained on synthetic shapes VQA) into {target} ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time (expert-parallel ranks start together): the others wait here, then find it complete
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").exists():
            return target
        remove_stale_staging(target.parent)
        # The host and pid in the name let a later run tell a staging directory whose builder was killed from one in use.
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(target), dir=target.parent))
        try:
            save_demo_model(staging)
            (staging / ".complete").write_text("ok\n")
            if target.exists():  # an interrupted earlier build: replace it
                shutil.rmtree(target)
            os.replace(staging, target)  # atomic: readers never see a half-written model
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
