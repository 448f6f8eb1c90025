"""Write a model's text weights as a GGUF file with the `gguf` package's writer (tests and demos), and its
vision tower as llama.cpp's separate mmproj file (`export_mmproj`).

Each tensor the family's adapter maps to GGUF (`ModelAdapter.gguf_names`) is written under
llama.cpp's name, split along dim 1 where the model fuses several GGUF tensors (gate and up experts),
or as the family writes it where llama.cpp's converter does more (`ModelAdapter.gguf_parts`: MLA's
`kv_b_proj` split into `attn_k_b` transposed and `attn_v_b`, a fused and permuted `attn_qkv`).
2-D and 3-D weights whose rows divide into the type's blocks are written in `qtype`; the rest (norms,
rows of other lengths, the routers and position embeddings: `ALWAYS_F32`) as F32, as llama.cpp keeps them.
The vision tower is not written there (llama.cpp puts it in an mmproj file: `export_mmproj`).

Given the model's config, the files carry what llama.cpp reads before it loads one: the text file its
architecture's hyperparameters (`ModelAdapter.gguf_metadata`, with the vocabulary's size) and, given the
processor too, its vocabulary and chat template (demo/gguf_vocab.py; without one,
`tokenizer.ggml.model = no_vocab`), the mmproj file its `clip.*` keys (`ModelAdapter.mmproj_metadata`,
which needs the processor too). Such a pair is a whole model: core/gguf_model.py loads it with no
Hugging Face directory. A family llama.cpp has no architecture or projector for gets a
warning that names it, and a file without those keys.

The `gguf` package quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; it reads the K-quants but
cannot write them. Q4_K and Q5_K are written with the host store's own quantizers (runtime/q4k.py,
q5k.py: min-max scales, valid bytes that the `gguf` package and llama.cpp read), Q8_0 and Q4_0 too
(the same bytes as the `gguf` package's, made by torch on whatever device holds the values).
`write_planned` streams: a file is written one tensor at a time (benchmarks/models/synthetic_gguf.py writes a
full-size model's so).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.llama_cpp_keys import ALWAYS_F32

WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K")


def export_gguf(state: dict[str, torch.Tensor], adapter: Any, path: str | Path, qtype: str = "Q8_0",
                arch: str | None = None, config: Any = None, processor: Any = None,
                progress: bool = False, end_ids: list[int] | None = None) -> dict[str, str]:
    """Write `state`'s GGUF-mapped tensors to `path`, with the family's llama.cpp hyperparameters where
    `config` is given (`llama_metadata`: the architecture is then the family's; without a config, `arch`,
    qwen3vlmoe by default) and the processor's vocabulary and chat template where `processor` is given
    too; returns GGUF name -> the type it was written in."""
    def parts():
        seen = set()
        for name, tensor in state.items():
            names = adapter.gguf_names(name)
            if names and tensor.data_ptr() in seen:  # tied (the output head is the embedding): once, as llama.cpp
                continue
            seen.add(tensor.data_ptr())
            custom = adapter.gguf_parts(name, state, config) if names else None
            if custom is not None:  # split otherwise, transposed, permuted, or fused with its neighbours
                yield from zip(names, custom)
            elif names:  # fused in the model (gate and up): split along dim 1
                yield from zip(names, tensor.float().chunk(len(names), dim=1) if len(names) > 1 else (tensor.float(),))
    family_arch, metadata = llama_metadata(adapter, config, processor, end_ids)
    if arch is not None and family_arch is not None and arch != family_arch:
        raise ValueError(f"arch={arch!r}, but llama.cpp calls {_family(adapter)} {family_arch!r}")
    written = _write(parts(), path, qtype, family_arch or arch or "qwen3vlmoe", metadata, progress)
    if not written:
        warnings.warn(f"{_family(adapter)}: no tensor has a GGUF name (ModelAdapter.gguf_names); {path} holds "
                      "no tensors", stacklevel=2)
    return written


def llama_metadata(adapter: Any, config: Any, processor: Any = None,
                   end_ids: list[int] | None = None) -> tuple[str | None, dict[str, Any]]:
    """(llama.cpp's architecture, the keys it needs to load a family's GGUF: `ModelAdapter.gguf_metadata`,
    with the vocabulary's size) for `config`; (None, {}) without one, or with a warning naming the family
    where llama.cpp has no architecture for it. The vocabulary and chat template come from `processor`
    (its tokenizer: demo/gguf_vocab.py; `end_ids`, the generation config's end tokens, default the text
    config's eos ids); without one none is written (`tokenizer.ggml.model = no_vocab`,
    with `<arch>.vocab_size`): llama-bench runs on such a file; a server needs the tokenizer's keys too."""
    if config is None:
        return None, {}
    from gguf import Keys

    found = adapter.gguf_metadata(config)
    if found is None:
        warnings.warn(f"{_family(adapter)}: llama.cpp has no text architecture for this family; the GGUF file "
                      "carries tensors only, which llama.cpp cannot load", stacklevel=3)
        return None, {}
    arch, keys = found
    vocab_size = int(adapter.text_config(config).vocab_size)
    if processor is None:
        vocabulary = {Keys.Tokenizer.MODEL: "no_vocab"}
    else:
        from .gguf_vocab import vocabulary_keys

        tokenizer = getattr(processor, "tokenizer", processor)
        template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        ends = end_ids if end_ids is not None else getattr(adapter.text_config(config), "eos_token_id", None)
        vocabulary = vocabulary_keys(tokenizer, vocab_size, template, [ends] if isinstance(ends, int) else ends)
    return arch, {Keys.LLM.VOCAB_SIZE.format(arch=arch): vocab_size, **keys, **vocabulary}


def mmproj_llama_metadata(adapter: Any, config: Any, processor: Any) -> dict[str, Any]:
    """The `clip.*` keys llama.cpp's mmproj loader needs (`ModelAdapter.mmproj_metadata`, with
    `general.type = mmproj` as its converter writes); {} with a warning naming the family where llama.cpp
    has no projector for it, or where no processor is given (the keys include its pixel normalisation)."""
    from gguf import GGUFType, Keys

    if processor is None:
        warnings.warn(f"{_family(adapter)}: no processor given, so the mmproj file carries no clip.* metadata "
                      "(llama.cpp needs the image mean and std)", stacklevel=3)
        return {}
    keys = adapter.mmproj_metadata(config, processor)
    if keys is None:
        warnings.warn(f"{_family(adapter)}: llama.cpp has no mmproj projector for this family; the mmproj file "
                      "carries no clip.* metadata", stacklevel=3)
        return {}
    return {Keys.General.TYPE: GGUFType.MMPROJ, **{key: value for key, value in keys.items() if value is not None}}


def _family(adapter: Any) -> str:
    return "/".join(adapter.model_types) or type(adapter).__name__


def export_mmproj(state: dict[str, torch.Tensor], adapter: Any, config: Any, path: str | Path,
                  qtype: str = "F16", processor: Any = None, progress: bool = False) -> dict[str, str]:
    """Write `state`'s vision tower as an mmproj GGUF under llama.cpp's names (`ModelAdapter.mmproj_source`,
    a 3-D convolution split into its 2-D slices as llama.cpp's converter does), with llama.cpp's `clip.*`
    keys from the config and `processor` (`mmproj_llama_metadata`). Matrices whose rows divide into
    `qtype`'s blocks are written in it, the rest in F32. Returns GGUF name -> type."""
    def parts():
        for name, tensor in state.items():
            source = adapter.mmproj_source(name, config)
            custom = adapter.gguf_parts(name, state, config) if source is not None else None
            if custom is not None:  # permuted, or fused with its neighbours (written once, with the first)
                yield from zip(source.names, custom)
            elif source is not None:
                values = tensor.float()
                yield from zip(source.names, values.unbind(source.stack_dim) if source.stack_dim is not None else (values,))
    written = _write(parts(), path, qtype, "clip", mmproj_llama_metadata(adapter, config, processor), progress)
    if not written:
        warnings.warn(f"{_family(adapter)}: no vision tensor has an mmproj name (ModelAdapter.mmproj_source); "
                      f"{path} holds no tensors", stacklevel=2)
    return written


def _write(parts, path: str | Path, qtype: str, arch: str, metadata: dict[str, Any] | None = None,
           progress: bool = False) -> dict[str, str]:
    """(GGUF name, float tensor) pairs to a GGUF file: 2-D and larger whose rows divide into `qtype`'s
    blocks in `qtype`, the rest in F32."""
    planned = [PlannedTensor(name, tuple(part.shape), tensor_type(name, tuple(part.shape), qtype), lambda part=part: part)
               for name, part in parts]
    return write_planned(planned, path, arch, progress=progress, metadata=metadata)


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a GGUF file before it is made: its name, float shape (numpy order), the ggml type
    it is written in, and how to make its float values (called once, when its turn comes)."""
    name: str
    shape: tuple[int, ...]
    kind: str
    make: Callable[[], torch.Tensor]


def tensor_type(name: str, shape: tuple[int, ...], qtype: str) -> str:
    """`qtype` for 2-D and larger tensors whose rows divide into its blocks, else F32, and F32 for the tensors
    llama.cpp always keeps so (`ALWAYS_F32`: routers, position embeddings), as llama.cpp keeps norms, odd rows
    and those."""
    import gguf

    if qtype not in WRITABLE:
        raise ValueError(f"the gguf package writes {', '.join(WRITABLE)}, not {qtype}")
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return qtype if len(shape) >= 2 and shape[-1] % block == 0 and not name.endswith(ALWAYS_F32) else "F32"


def encode(values: torch.Tensor, kind: str) -> np.ndarray:
    """Float values (on any device) -> what a GGUF file stores for `kind`: float32 for F32, else the
    type's bytes. Q8_0, Q4_0, Q4_K and Q5_K go through the host store's quantizers (runtime/q8.py,
    q4.py, q4k.py, q5k.py: torch, so they run on the GPU where the values are; Q8_0 and Q4_0 give the
    `gguf` package's bytes exactly, the K-quants min-max scales it reads); the rest through the
    `gguf` package."""
    from gguf import GGMLQuantizationType, quants

    from ..runtime import q4, q4k, q5k, q8

    ours = {"Q8_0": q8, "Q4_0": q4, "Q4_K": q4k, "Q5_K": q5k}
    if kind == "F32":
        return values.float().cpu().numpy()
    if kind in ours:
        return ours[kind].quantize(values.float()).cpu().numpy()
    return quants.quantize(values.float().cpu().numpy(), GGMLQuantizationType[kind])


def write_planned(planned: list[PlannedTensor], path: str | Path, arch: str, progress: bool = False,
                  metadata: dict[str, Any] | None = None) -> dict[str, str]:
    """Write `planned` to one GGUF file, one tensor made and encoded at a time (the header lists every
    tensor's type and size first, so a file far larger than memory can be written), with `metadata`'s
    keys (`_add_value`: llama.cpp's types for its hyperparameters). Returns GGUF name -> the type it was
    written in."""
    import gguf
    from gguf import GGMLQuantizationType
    from tqdm import tqdm

    writer = _writer_class()(str(path), arch=arch)
    for key, value in (metadata or {}).items():
        _add_value(writer, key, value)
    for t in planned:
        if t.kind == "F32":
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), 4 * math.prod(t.shape))
        else:
            kind = GGMLQuantizationType[t.kind]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            row = t.shape[-1] // block * size
            writer.add_tensor_info(t.name, (*t.shape[:-1], row), np.dtype(np.uint8), math.prod(t.shape[:-1]) * row,
                                   raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tqdm(planned, desc=f"Writing {Path(path).name}", unit="tensor", disable=not progress):
        values = t.make()
        if tuple(values.shape) != t.shape:
            raise ValueError(f"{t.name}: planned as {t.shape}, made as {tuple(values.shape)}")
        writer.write_tensor_data(encode(values, t.kind))
    writer.close()
    return {t.name: t.kind for t in planned}


def _writer_class():
    import gguf

    class Writer(gguf.GGUFWriter):
        """The gguf package's writer, with empty arrays: the format has them and llama.cpp's BPE loader
        needs `tokenizer.ggml.merges` present, which a byte vocabulary (no merges) leaves empty; the
        package refuses to write one."""
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)
    return Writer


def _add_value(writer: Any, key: str, value: Any) -> None:
    """One metadata key in llama.cpp's types: bools as bool, ints as uint32, floats as float32, strings,
    lists as arrays of bools, int32, float32 or strings (by their elements), an empty list as an empty
    array of strings (the merges of a vocabulary without any)."""
    from gguf import GGUFValueType

    if isinstance(value, list) and not value:
        writer.add_key_value(key, [], GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, list) and value and all(isinstance(v, (bool, int, float)) for v in value):
        kind = bool if all(isinstance(v, bool) for v in value) else int if all(
            isinstance(v, int) and not isinstance(v, bool) for v in value) else float
        writer.add_array(key, [kind(v) for v in value])
    else:
        raise ValueError(f"GGUF metadata {key}: {value!r} is not a bool, int, float, string or list of them")
