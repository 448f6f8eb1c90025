"""GgufCheckpointReader: a model's tensors from GGUF files (llama.cpp's format, what KTransformers users
run with `--gguf_path`), the rest from the Hugging Face directory beside them.

As in KTransformers, config, tokenizer and processor come from the HF directory (`--model_path`)
and the weights from GGUF. The model family's adapter names the GGUF tensors behind each of the
model's tensors (`ModelAdapter.gguf_names`: llama.cpp's `blk.N.attn_q.weight`, the experts'
`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, concatenated where the model fuses them; where
llama.cpp's converter split a tensor otherwise, transposed or permuted it, the family's inverse,
`ModelAdapter.from_gguf`, e.g. MLA's `attn_k_b` / `attn_v_b` back into `kv_b_proj`).
The vision tower, which llama.cpp writes to a separate mmproj file, comes from that file when one is
given (`--mmproj_path`; `ModelAdapter.mmproj_source` names its tensors as llama.cpp's converter
does), else from safetensors in the HF directory; a tensor found in neither stops loading with an
error that names it.

Reading: the `gguf` package maps each file (memmap) and dequantizes a tensor when it is asked for
(`gguf.quants.dequantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K to
Q6_K), so a load holds one dequantized tensor at a time beside the model. The dequantized tensor
is float32, then converted to the checkpoint dtype asked for. By default that follows the file: float32
when every tensor of the model's GGUF files is F32 (a file written in F32 asks for full precision, and
llama.cpp computes it so), else bfloat16 (what a GGUF's unquantized tensors usually are, and half the
memory of float32 for a quantized model's dequantized tensors).
A file that is not GGUF (or is cut short), a tensor of another type, or a shape that does not
match the model's config is a LoadError naming the file and tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import LoadError
from .checkpoint import CheckpointReader, LayoutFix

SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_SPLIT = re.compile(r"^(?P<stem>.+)-\d{5}-of-\d{5}\.gguf$")  # llama.cpp's split files: X-00001-of-00003.gguf


def gguf_files(path: str | Path) -> list[Path]:
    """The GGUF files of a model: a directory's `*.gguf` (without mmproj files), or one file with the
    other parts of its split."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
    elif path.is_file():
        split = _SPLIT.match(path.name)
        files = sorted(path.parent.glob(f"{split['stem']}-*-of-*.gguf")) if split else [path]
    else:
        raise LoadError(f"--gguf_path {path}: no such file or directory")
    if not files:
        raise LoadError(f"--gguf_path {path}: no .gguf files there")
    return files


class GgufCheckpointReader:
    def __init__(self, model_dir: str | Path, gguf_path: str | Path, gguf_names: Callable[[str], tuple[str, ...] | None],
                 dtype: torch.dtype | None = None, layout_fix: LayoutFix | None = None, default_device: str = "cpu",
                 mmproj_path: str | Path | None = None, mmproj_source: Callable[[str], Any] | None = None,
                 from_gguf: Callable[[str, list[torch.Tensor]], torch.Tensor | None] | None = None):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise LoadError("--gguf_path needs the gguf package (pip install gguf==0.19.0; `make test` installs it)") from None

        self.model_dir = Path(model_dir)
        self.gguf_path = Path(gguf_path)
        self.layout_fix = layout_fix
        self.default_device = default_device
        self.device_map: dict[str, dict[str, Any]] = {}
        self.on_tensor: Callable[[str, int], None] | None = None
        self.gguf_names = gguf_names
        self.mmproj_source = mmproj_source
        self.mmproj_path = mmproj_path
        self.from_gguf = from_gguf  # the family's inverse where llama.cpp split or permuted a tensor (ModelAdapter)
        self._tensors: dict[str, tuple[Path, Any]] = {}
        self.files = gguf_files(gguf_path)
        if mmproj_path is not None:
            mmproj = Path(mmproj_path)
            if not mmproj.is_file():
                raise LoadError(f"--mmproj_path {mmproj}: no such file")
            self.files.append(mmproj)
        for file in self.files:
            try:
                reader = GGUFReader(str(file), "r")
            except Exception as exc:  # the gguf package raises ValueError/struct errors on bad or short files
                raise LoadError(f"{file}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
            for tensor in reader.tensors:
                self._tensors[tensor.name] = (file, tensor)
        self.dtype = dtype if dtype is not None else self.file_dtype()
        has_safetensors = any(self.model_dir.glob("*.safetensors"))
        # tensors the GGUF lacks (a vision tower without --mmproj_path) in the same dtype: one model, one dtype
        self._fallback = CheckpointReader(self.model_dir, self.dtype, layout_fix, default_device) if has_safetensors else None

    def file_dtype(self) -> torch.dtype:
        """The dtype a load without `dtype` converts to: float32 for a model written all in F32 (its
        mmproj aside: llama.cpp's converter writes that in F16 by default), else bfloat16."""
        mmproj = Path(self.mmproj_path) if self.mmproj_path is not None else None
        text = [tensor for file, tensor in self._tensors.values() if file != mmproj]
        all_f32 = bool(text) and all(tensor.tensor_type.name == "F32" for tensor in text)
        return torch.float32 if all_f32 else torch.bfloat16

    # --- what the loader asks ----------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return self._sources(name) is not None or (self._fallback is not None and name in self._fallback)

    def planned_device(self, module_key: str, fallback: torch.device | str) -> torch.device:
        kwargs = self.device_map.get(module_key, {})
        return torch.device(kwargs.get("generate_device", fallback))

    def load_tensor(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """Read one of the model's tensors onto `device` (KTransformers' loader signature)."""
        sources = self._sources(name)
        if sources is None:
            wanted = self.gguf_names(name)
            mmproj = self.mmproj_source(name) if self.mmproj_source is not None and not wanted else None
            listed = lambda names: f"tensor{'s' if len(names) > 1 else ''} {', '.join(names)}"  # noqa: E731
            if mmproj is not None and self.mmproj_path:  # never half the vision tower from elsewhere
                raise LoadError(f"{self.mmproj_path}: the model's vision tensor {name!r} is missing: it maps to "
                                f"mmproj {listed(mmproj.names)}")
            if self._fallback is not None and name in self._fallback:
                return self._fallback.load_tensor(name, device)
            if wanted:
                where = f"GGUF {listed(wanted)}"
            elif mmproj is not None:
                where = f"mmproj {listed(mmproj.names)} (no --mmproj_path given)"
            else:
                where = "no GGUF tensor (llama.cpp keeps the vision tower in an mmproj file: --mmproj_path)"
            raise LoadError(f"{self.gguf_path}: the model's tensor {name!r} is missing: it maps to {where}, and "
                            f"{self.model_dir} has no safetensors holding it")
        sources, stack_dim = sources
        parts = [self._dequantize(gguf_name) for gguf_name in sources]
        # llama.cpp wrote it split and transposed, or permuted: the family's inverse; else the plain join
        tensor = self.from_gguf(name, parts) if self.from_gguf is not None else None
        if tensor is None:
            tensor = self._joined(name, parts, stack_dim)
        tensor = tensor.to(self.dtype).to(device)
        if self.on_tensor is not None:
            self.on_tensor(name, tensor.numel() * tensor.element_size())
        return tensor

    def _joined(self, name: str, parts: list[torch.Tensor], stack_dim: int | None) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0]
        # fused in the model: concatenated along dim 1, or slices stacked back (a 3-D convolution)
        if stack_dim is not None and len({p.shape for p in parts}) > 1:
            raise LoadError(f"{self.describe(name)}: its slices have different shapes "
                            f"{', '.join(str(tuple(p.shape)) for p in parts)}")
        return torch.cat(parts, dim=1) if stack_dim is None else torch.stack(parts, dim=stack_dim)

    def load_buffer(self, name: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """A persistent buffer (e.g. GLM's fp32 router correction bias, llama.cpp's `exp_probs_b`) in the
        dtype the model keeps it in, whatever dtype the weights are converted to."""
        if self._sources(name) is None:
            if self._fallback is not None and name in self._fallback:
                return self._fallback.load_buffer(name, device, dtype)
            return self.load_tensor(name, device)  # the error naming it
        return torch.cat([self._dequantize(n) for n in self._sources(name)[0]]).to(dtype).to(device)

    def describe(self, name: str) -> str:
        sources = self._sources(name)
        if sources is None:
            return self._fallback.describe(name) if self._fallback is not None else f"tensor {name!r}"
        names = sources[0]
        return f"{self._tensors[names[0]][0]}: tensor {', '.join(names)} (the model's {name!r})"

    def weight_files(self) -> list[Path]:
        """The files the weights come from outside the model directory (caches derived from the
        weights fingerprint them)."""
        return list(self.files)

    def close(self) -> None:
        """Unmap the files: a mapped page the load touched counts in the process's resident memory for
        as long as the mapping lives, so a model kept after loading would seem to hold its file twice."""
        self._tensors.clear()
        if self._fallback is not None:
            self._fallback.close()

    # --- reading -----------------------------------------------------------------------------
    def _sources(self, name: str) -> tuple[tuple[str, ...], int | None] | None:
        """The GGUF tensors behind `name` and the dim they stack along (None: concatenated along dim 1)."""
        names, stack_dim = self.gguf_names(name), None
        if not names and self.mmproj_source is not None:
            source = self.mmproj_source(name)
            if source is not None:
                names, stack_dim = source.names, source.stack_dim
        if not names or not all(n in self._tensors for n in names):
            return None
        return names, stack_dim

    def tensor_type(self, gguf_name: str) -> str:
        return self._tensors[gguf_name][1].tensor_type.name

    def raw_tensors(self, name: str) -> list[tuple[torch.Tensor, int]] | None:
        """The GGUF tensors behind the model's tensor `name` as stored: (bytes (rows, row bytes), ggml
        type id) each, without dequantizing (for kernels that compute on the stored type); None where
        they are not all in the GGUF files."""
        sources = self._sources(name)
        if sources is None:
            return None
        out = []
        for gguf_name in sources[0]:
            file, tensor = self._tensors[gguf_name]
            data = np.asarray(tensor.data)
            try:
                raw = torch.from_numpy(np.array(data.view(np.uint8), copy=True))  # the file's memmap is read-only
            except ValueError as exc:
                raise LoadError(f"{file}: cannot read tensor {gguf_name!r} ({exc})") from None
            out.append((raw, int(tensor.tensor_type)))
        return out

    def _dequantize(self, gguf_name: str) -> torch.Tensor:
        from gguf import quants

        file, tensor = self._tensors[gguf_name]
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED:
            raise LoadError(f"{file}: tensor {gguf_name!r} is {kind}; this loader reads {', '.join(SUPPORTED)}")
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:  # a tensor whose data is cut short or malformed
            raise LoadError(f"{file}: cannot read tensor {gguf_name!r} ({kind}: {type(exc).__name__}: {exc})") from None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists dims innermost first
        if values.size != int(np.prod(shape)):
            raise LoadError(f"{file}: tensor {gguf_name!r} holds {values.size} values, its header says {shape}")
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy: the file is read-only
