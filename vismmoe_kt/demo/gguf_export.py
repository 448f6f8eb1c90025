"""Write a model's text weights as a GGUF file with the `gguf` package's writer (tests and demos), and its
vision tower as llama.cpp's separate mmproj file (`export_mmproj`).

Each tensor the family's adapter maps to GGUF (`ModelAdapter.gguf_names`) is written under
llama.cpp's name, split along dim 1 where the model fuses several GGUF tensors (gate and up experts).
2-D and 3-D weights whose rows divide into the type's blocks are written in `qtype`; the rest (norms,
rows of other lengths) as F32, as llama.cpp keeps them. The vision tower is not written there
(llama.cpp puts it in an mmproj file: `export_mmproj`).

The `gguf` package quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; it reads the K-quants but
cannot write them. Q4_K and Q5_K are written with the host store's own quantizers (runtime/q4k.py,
q5k.py: min-max scales, valid bytes that the `gguf` package and llama.cpp read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K")


def export_gguf(state: dict[str, torch.Tensor], adapter: Any, path: str | Path, qtype: str = "Q8_0",
                arch: str = "qwen3vlmoe") -> dict[str, str]:
    """Write `state`'s GGUF-mapped tensors to `path`; returns GGUF name -> the type it was written in."""
    def parts():
        for name, tensor in state.items():
            names = adapter.gguf_names(name)
            if names:  # fused in the model (gate and up): split along dim 1
                yield from zip(names, tensor.float().chunk(len(names), dim=1) if len(names) > 1 else (tensor.float(),))
    return _write(parts(), path, qtype, arch)


def export_mmproj(state: dict[str, torch.Tensor], adapter: Any, config: Any, path: str | Path,
                  qtype: str = "F16") -> dict[str, str]:
    """Write `state`'s vision tower as an mmproj GGUF under llama.cpp's names (`ModelAdapter.mmproj_source`,
    a 3-D convolution split into its 2-D slices as llama.cpp's converter does). Matrices whose rows
    divide into `qtype`'s blocks are written in it, the rest in F32. Returns GGUF name -> type."""
    def parts():
        for name, tensor in state.items():
            source = adapter.mmproj_source(name, config)
            if source is not None:
                values = tensor.float()
                yield from zip(source.names, values.unbind(source.stack_dim) if source.stack_dim is not None else (values,))
    return _write(parts(), path, qtype, "clip")


def _write(parts, path: str | Path, qtype: str, arch: str) -> dict[str, str]:
    """(GGUF name, float tensor) pairs to a GGUF file: 2-D and larger whose rows divide into `qtype`'s
    blocks in `qtype`, the rest in F32."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    if qtype not in WRITABLE:
        raise ValueError(f"the gguf package writes {', '.join(WRITABLE)}, not {qtype}")
    kind = GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    written: dict[str, str] = {}
    for gguf_name, part in parts:
        values = part.contiguous().numpy().astype(np.float32)
        use = kind if values.ndim >= 2 and values.shape[-1] % block == 0 else GGMLQuantizationType.F32
        if use == GGMLQuantizationType.F32:
            data = values
        elif use in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):  # the store's own quantizers
            from ..runtime import q4k, q5k

            codec = q4k if use == GGMLQuantizationType.Q4_K else q5k
            data = codec.quantize(torch.from_numpy(values)).numpy()
        else:
            data = quants.quantize(values, use)
        writer.add_tensor(gguf_name, data, raw_dtype=use)
        written[gguf_name] = use.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
