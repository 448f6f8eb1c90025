"""llama.cpp's tensor names for a family's text model: the gguf package's own maps (the ones llama.cpp's
converter applies), plus the fused experts, which the maps do not cover (each of the model's stacked
expert tensors is one or more of llama.cpp's `blk.N.ffn_*_exps` tensors)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=16)
def name_map(arch: str, depth: int):
    """gguf's TensorNameMap of the architecture `arch` (a gguf.MODEL_ARCH member's name, e.g. "GLM4_MOE",
    "MMPROJ") for `depth` blocks."""
    import gguf

    return gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), depth)


def text_tensor_names(name: str, *, prefix: str, lm_head: str, experts: dict[str, tuple[str, ...]], arch: str,
                      layers: int) -> tuple[str, ...] | None:
    """llama.cpp's names of the model's text tensor `name` (under `prefix`; `lm_head` is the output head,
    `experts` maps a layer's fused expert tensors to llama.cpp's suffixes), or None outside the text model."""
    if name == lm_head:
        return ("output.weight",)
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    parts = rest.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in experts:
        return tuple(f"blk.{parts[1]}.{suffix}" for suffix in experts[parts[2]])
    stem, _, suffix = rest.rpartition(".")
    mapped = name_map(arch, layers).get_name("model." + stem)
    return (f"{mapped}.{suffix}",) if mapped else None
