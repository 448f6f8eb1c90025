"""Llama 4 in llama.cpp's files: the text model under `llama4`'s tensor names, the vision tower under the
mmproj's (`llama4` projector), and the config and processor rebuilt from the pair's metadata (the inverse
of `Llama4Adapter.gguf_metadata` / `mmproj_metadata`).

Names: the gguf package's maps (`gguf.get_tensor_name_map`), plus the fused experts as llama.cpp's
stacked `ffn_gate_exps` + `ffn_up_exps` / `ffn_down_exps` (in our layout, (E, 2I, H) and (E, H, I), so
concatenated along dim 1 as stored), the vision adapter's second linear (`mm.model.mlp.2`, which the
map leaves out) and the projector's one linear (`multi_modal_projector.linear_1`, which the map names `mm.1`)
as llama.cpp's converter writes it and its loader looks for it, `mm.model.fc`. The patch embedding stays the model's 2-D linear.

What llama.cpp fixes for every Llama 4 and so does not write: rotary skipped every 4th layer
(`no_rope_layer_interval`), the query/key norm on every 16-expert model (`use_qk_norm`: on unless 128
experts, as llama.cpp decides). The projector's widths come from its tensors' shapes.
"""

from __future__ import annotations

from typing import Any

from ..errors import LoadError
from .base import MmprojSource
from .gguf_tensor_names import name_map, text_tensor_names
from .llama_cpp_keys import stored_float

_TEXT = "language_model.model."
_EXPERTS = {"feed_forward.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
            "feed_forward.experts.down_proj": ("ffn_down_exps.weight",)}
_VISION = ("vision_model.", "multi_modal_projector.")
ARCH, FAMILY = "llama4", "llama4 (llama.cpp's llama4)"
CLIP = "clip.vision."
NO_ROPE_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for Llama 4


def gguf_names(name: str, layers: int = 256) -> tuple[str, ...] | None:
    """llama.cpp's names of a text tensor (None for the vision tower, which goes to the mmproj file)."""
    return text_tensor_names(name, prefix=_TEXT, experts=_EXPERTS, layers=layers,
                             lm_head="language_model.lm_head.weight", arch="LLAMA4")


def mmproj_source(name: str, depth: int) -> MmprojSource | None:
    if not name.startswith(_VISION):
        return None
    if name == "vision_model.vision_adapter.mlp.fc2.weight":
        return MmprojSource(("mm.model.mlp.2.weight",))
    if name == "multi_modal_projector.linear_1.weight":  # one linear despite its number: llama.cpp's `mm.model.fc`
        return MmprojSource(("mm.model.fc.weight",))
    if "." not in name.removeprefix("vision_model."):  # class_embedding, positional_embedding_vlm: no suffix
        mapped = name_map("MMPROJ", depth).get_name(name)
        if mapped and name.endswith("positional_embedding_vlm"):  # llama.cpp's converter adds the suffix there,
            mapped += ".weight"                                    # and its loader looks for `v.position_embd.weight`
        return MmprojSource((mapped,)) if mapped else None
    stem, _, suffix = name.rpartition(".")
    mapped = name_map("MMPROJ", depth).get_name(stem)
    return MmprojSource((f"{mapped}.{suffix}",)) if mapped else None


def config_from_gguf(text: Any, mmproj: Any, tokenizer: Any) -> Any:
    from transformers import Llama4Config

    need = lambda meta, key: meta.need(key, FAMILY)  # noqa: E731
    key = lambda name: f"{ARCH}.{name}"  # noqa: E731
    token = lambda name: text.get(f"tokenizer.ggml.{name}_token_id")  # noqa: E731
    experts, chunk = int(need(text, key("expert_count"))), int(text.get(key("attention.sliding_window"), 0))
    tie = "output.weight" not in text.shapes
    temperature = text.get(key("attention.temperature_length"))
    text_config = dict(
        vocab_size=int(text.get(key("vocab_size")) or text.shape("token_embd.weight", FAMILY)[0]),
        hidden_size=need(text, key("embedding_length")), intermediate_size=need(text, key("expert_feed_forward_length")),
        intermediate_size_mlp=need(text, key("feed_forward_length")), num_hidden_layers=need(text, key("block_count")),
        num_attention_heads=need(text, key("attention.head_count")),
        num_key_value_heads=need(text, key("attention.head_count_kv")), head_dim=need(text, key("attention.key_length")),
        num_local_experts=experts, num_experts_per_tok=need(text, key("expert_used_count")),
        interleave_moe_layer_step=need(text, key("interleave_moe_layer_step")), no_rope_layer_interval=NO_ROPE_INTERVAL,
        attention_chunk_size=chunk or None, attn_temperature_tuning=temperature is not None,
        floor_scale=int(temperature) if temperature is not None else 8192,
        attn_scale=stored_float(text.get(key("attention.temperature_scale"), 0.1)), use_qk_norm=experts != 128,
        max_position_embeddings=need(text, key("context_length")),
        rms_norm_eps=stored_float(need(text, key("attention.layer_norm_rms_epsilon"))), tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": stored_float(need(text, key("rope.freq_base")))},
        **{f"{name}_token_id": int(token(name)) for name in ("bos", "eos") if token(name) is not None},
        pad_token_id=None if token("padding") is None else int(token("padding")))
    adapter_in = mmproj.shape("mm.model.mlp.1.weight", FAMILY)  # (projector_input_dim, hidden * shuffle^-2)
    adapter_out = mmproj.shape("mm.model.mlp.2.weight", FAMILY)
    vision = dict(
        hidden_size=need(mmproj, CLIP + "embedding_length"), num_hidden_layers=need(mmproj, CLIP + "block_count"),
        num_attention_heads=need(mmproj, CLIP + "attention.head_count"),
        intermediate_size=need(mmproj, CLIP + "feed_forward_length"), image_size=need(mmproj, CLIP + "image_size"),
        patch_size=need(mmproj, CLIP + "patch_size"),
        pixel_shuffle_ratio=1.0 / int(need(mmproj, CLIP + "projector.scale_factor")),
        projector_input_dim=adapter_in[0], projector_output_dim=adapter_out[0], vision_output_dim=adapter_out[0],
        norm_eps=stored_float(need(mmproj, CLIP + "attention.layer_norm_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_index", "<|patch|>"), ("boi_token_index", "<|image_start|>"), ("eoi_token_index", "<|image_end|>"))}
    missing = [name for name, index in ids.items() if index is None or index == tokenizer.unk_token_id]
    if missing:
        raise LoadError(f"{text.path}: {FAMILY}: the vocabulary lacks the vision tokens of {', '.join(missing)}")
    return Llama4Config(text_config=text_config, vision_config=vision, tie_word_embeddings=tie, **ids)


def processor_from_gguf(mmproj: Any, tokenizer: Any, chat_template: str) -> Any:
    """Llama 4's tiling processor: square tiles of the tower's image size, at most `preproc_max_tiles`
    of them (16, the published model's, where the file has none)."""
    from .llama4_images import Llama4ImageProcessorPil, Llama4ImageTextProcessor

    tile = int(mmproj.need(CLIP + "image_size", FAMILY))
    image_processor = Llama4ImageProcessorPil(
        size={"height": tile, "width": tile}, max_patches=int(mmproj.get(CLIP + "preproc_max_tiles", 16)),
        image_mean=[stored_float(v) for v in mmproj.need(CLIP + "image_mean", FAMILY)],
        image_std=[stored_float(v) for v in mmproj.need(CLIP + "image_std", FAMILY)])
    return Llama4ImageTextProcessor(image_processor, tokenizer, patch_size=int(mmproj.need(CLIP + "patch_size", FAMILY)),
                                    pixel_shuffle_ratio=1.0 / int(mmproj.need(CLIP + "projector.scale_factor", FAMILY)),
                                    chat_template=chat_template)
