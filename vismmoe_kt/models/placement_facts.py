"""What the rule generator (vismmoe_kt/core/placements.py) needs to know about each family: the module names
and Hugging Face classes its rules match, its default budget and which placements it ships.

Plain data, so `vismmoe-kt rules list` imports no adapter. Module names and class paths live here because
only models/ may name a Hugging Face structure; the generator knows the operators and their kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlacementFacts:
    family: str                 # the rule files' prefix: optimize_rules/<family>[-<placement>].yaml
    model_type: str             # config.json's model_type (vismmoe_kt.models.REGISTRY)
    title: str                  # the header comments' name, e.g. "GLM-4.5V (transformers glm4v_moe)"
    text_model: str             # the VisDecoder rule's module name (a regex)
    experts: str                # the (primary) routed experts' module name (a regex) ...
    experts_class: str          # ... and their class
    expert_budget: str          # VisExperts' default budget in this family's rule files
    budget_note: str            # why that budget (header comments of the offloading placements)
    stays_on_gpu: str = ""      # what an offloading placement keeps with the attention (header comments)
    model_note: str = ""        # the architecture as the lean default runs it (its header comment)
    # the default placement (`<family>.yaml`): "lean" = every weight on the GPU on our decode path, or
    # "hybrid-pruned" = the hybrid placement plus affinity-aware visual-token pruning (Qwen3-VL)
    default: str = "lean"
    vision_tower: str | None = None  # "hybrid-pruned": the VisionSaliency rule's module name (a regex)
    # a second expert set that only a prefill's image tokens reach (ERNIE-4.5-VL): its module name; offloading
    # placements give it a small runtime of its own (VisionExperts), ReaLB switches only its experts
    vision_experts: str | None = None
    vision_experts_budget: str = "2GiB"
    missing: dict[str, str] = field(default_factory=dict)  # placement -> why this family has no such rule file
    # the MoE routers' module name (a regex): where a routing source's operator goes (`--routing`, benchmarks)
    router: str = "^model\\.language_model\\.layers\\.\\d+\\.mlp\\.gate$"


FAMILIES: dict[str, PlacementFacts] = {facts.family: facts for facts in (
    PlacementFacts(
        "qwen3vl", "qwen3_vl_moe", "Qwen3-VL-MoE", "^model\\.language_model$",
        "^model\\.language_model\\.layers\\.\\d+\\.mlp\\.experts$",
        "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextExperts", "16GiB",
        "16GiB stands for a 24 GB card (about 4 GB of attention/vision/embeddings and room for activations "
        "besides), 32GiB for a 40 GB one",
        default="hybrid-pruned", vision_tower="^model\\.visual$"),
    PlacementFacts(
        "glm4v", "glm4v_moe", "GLM-4.5V (transformers glm4v_moe)", "^model\\.language_model$",
        "^model\\.language_model\\.layers\\.\\d+\\.mlp\\.experts$",
        "transformers.models.glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextExperts", "64GiB",
        "GLM-4.5V's 45 MoE layers of 128 experts hold about 200 GB in BF16: a 80 GB card leaves room for "
        "roughly 64GiB of them",
        stays_on_gpu="the shared experts and the dense first layer",
        model_note="The shared experts run in the decode step's attention piece, the routed experts in its experts "
                   "piece; the adapter hands the text model its image-token mask, so `--set compression=affinity` "
                   "works and is tested on the CPU."),
    PlacementFacts(
        "deepseek-ocr2", "deepseek_ocr2", "DeepSeek-OCR-2 (transformers deepseek_ocr2)", "^model\\.language_model$",
        "^model\\.language_model\\.layers\\.\\d+\\.mlp\\.experts$",
        "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextExperts", "2GiB",
        "DeepSeek-OCR-2's 3B MoE text model holds about 6 GB in BF16, nearly all of it the 4.5 GiB of routed "
        "experts: 2GiB keeps about 40% of them on the GPU",
        stays_on_gpu="the shared experts and the dense first layer",
        model_note="1-D RoPE (not M-RoPE); the first layer has a dense MLP; the shared experts run in the decode "
                   "step's attention piece, the routed experts in its experts piece (the router, softmax top-k without "
                   "renormalisation, runs as the module)."),
    PlacementFacts(
        "kimi-k25", "kimi_k25", "Kimi K2.5 (transformers kimi_k25)", "^model\\.language_model$",
        "^model\\.language_model\\.layers\\.\\d+\\.mlp\\.experts$",
        "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts", "96GiB",
        "Kimi K2.5's are about 2 TB in BF16 (60 MoE layers x 384 experts of 3 x 7168 x 2048); the smallest "
        "budget is one pinned layer plus one layer of slabs (about 63 GiB), and 96GiB keeps about 5% of them "
        "on an H200",
        stays_on_gpu="the shared experts and the dense first layer (MLA's cache holds one latent per position)",
        model_note="MLA attention (the cache holds one compressed latent per position; the decode step runs "
                   "transformers' attention module over it) with 1-D RoPE; the first layer has a dense MLP; the "
                   "shared experts run in the decode step's attention piece, the routed experts in its experts "
                   "piece (the router, sigmoid with a correction bias and grouped top-k, runs as the module).",
        missing={"gpu": "its routed experts are about 2 TB in BF16: no GPU holds them, so there is no reference "
                        "placement with the stock modules",
                 "lru": "none was ever made for it: offload and hybrid are its offloading placements"}),
    PlacementFacts(
        "ernie45vl", "ernie4_5_vl_moe", "ERNIE-4.5-VL (transformers ernie4_5_vl_moe)", "^model\\.language_model$",
        "^model\\.language_model\\.layers\\.\\d+\\.mlp\\.text_moe\\.experts$",
        "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeExperts", "24GiB",
        "the 28B model's text experts hold about 41 GB in BF16, its vision experts 14 GB",
        stays_on_gpu="the shared experts and the dense first layer",
        model_note="Each MoE layer has text experts, which text tokens (and so every decode step) route to, and "
                   "vision experts, which only image tokens of a prefill reach; both stay the model's own modules "
                   "here.",
        vision_experts="^model\\.language_model\\.layers\\.\\d+\\.mlp\\.vision_moe\\.experts$",
        router="^model\\.language_model\\.layers\\.\\d+\\.mlp\\.text_moe\\.gate$"),
    PlacementFacts(
        "llama4", "llama4", "Llama 4 (transformers llama4)", "^language_model\\.model$",
        "^language_model\\.model\\.layers\\.\\d+\\.feed_forward\\.experts$",
        "vismmoe_kt.models.llama4.Llama4FusedExperts", "64GiB",
        "Llama 4 Maverick's 24 MoE layers of 128 experts hold about 750 GB in BF16; Scout's 48 layers of 16, "
        "about 200 GB",
        stays_on_gpu="the shared expert and the dense layers between the MoE layers",
        model_note="The adapter gives the model its MoE blocks (one expert per token, the router's sigmoid scaling the "
                   "expert's input) and an attention that takes the complex rotary packed as (cos, sin); the shared "
                   "expert runs in the decode step's attention piece, the routed experts in its experts piece. The "
                   "context is capped at attention_chunk_size (within one chunk Llama 4's chunked attention is causal "
                   "attention).",
        router="^language_model\\.model\\.layers\\.\\d+\\.feed_forward\\.router$"),
)}


def facts_for_model_type(model_type: str | None) -> PlacementFacts | None:
    return next((facts for facts in FAMILIES.values() if facts.model_type == model_type), None)
