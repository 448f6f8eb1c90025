"""CheckpointReader: tensors of a local safetensors checkpoint, read one at a time through mmap.

A checkpoint is one `model.safetensors` or shards listed in `model.safetensors.index.json`, in a float
dtype, or FP8 with block scales (`<name>_scale_inv`, as the published FP8 checkpoints store them:
dequantized to bfloat16 as each tensor is read). Tensors
are read lazily by name, straight to the device asked for, so loading never holds a second copy of
the checkpoint: at most one shard is mapped at a time (its pages count in RSS while it is open), and
each tensor is copied once into the memory that keeps it.

The reader also carries the plan's per-module kwargs (`device_map`, filled by `inject`), as
KTransformers' loader does, so operators' `load()` can ask where their tensors go.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import LoadError

INDEX_FILE = "model.safetensors.index.json"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SINGLE_FILE = "model.safetensors"

# (name, tensor as stored, shape the model wants) -> tensor in the model's layout
LayoutFix = Callable[[str, torch.Tensor, torch.Size], torch.Tensor]
# a model tensor's name -> the checkpoint tensors it is assembled from (ModelAdapter.checkpoint_sources)
Sources = Callable[[str], "tuple[tuple[str, ...], ...] | None"]
# a model tensor's name -> the name (or the candidate names, first found wins) a checkpoint stores it under,
# where it differs (ModelAdapter.checkpoint_name)
Renames = Callable[[str], "str | tuple[str, ...] | None"]


def _shard_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise LoadError(f"{index}: unreadable shard index ({exc})") from None
        shards = {name: model_dir / shard for name, shard in weight_map.items()}
        missing = sorted({str(p.name) for p in shards.values() if not p.exists()})
        if missing:
            raise LoadError(f"{model_dir}: shards listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return shards
    files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).exists() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{model_dir}: no safetensors checkpoint ({SINGLE_FILE} or {INDEX_FILE} with shards)")
    shards = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                shards.update({name: path for name in f.keys()})
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise LoadError(f"{path}: not a readable safetensors file ({exc})") from None
    return shards


class CheckpointReader:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype | None = None,
        layout_fix: LayoutFix | None = None,
        default_device: str = "cpu",
        sources: Sources | None = None,
        renames: Renames | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.dtype = dtype  # None keeps each tensor's stored dtype
        self.layout_fix = layout_fix
        self.sources = sources
        self.renames = renames
        self.default_device = default_device
        self.device_map: dict[str, dict[str, Any]] = {}
        self.on_tensor: Callable[[str, int], None] | None = None  # progress hook: (name, bytes)
        self._shards = _shard_map(self.model_dir)
        self._open_path: Path | None = None
        self._open_file: Any = None

    def keys(self) -> list[str]:
        return list(self._shards)

    def __contains__(self, name: str) -> bool:
        return self._stored(name) is not None or self._parts(name) is not None

    def _stored(self, name: str) -> str | None:
        """The name the checkpoint holds tensor `name` under: itself, or the adapter's rename; None if neither."""
        if name in self._shards:
            return name
        renamed = self.renames(name) if self.renames is not None else None
        candidates = (renamed,) if isinstance(renamed, str) else renamed or ()
        return next((candidate for candidate in candidates if candidate in self._shards), None)

    def _parts(self, name: str) -> tuple[tuple[str, ...], ...] | None:
        """The stored tensors a tensor the checkpoint lacks is assembled from (all present), else None."""
        if self.sources is None or self._stored(name) is not None:
            return None
        rows = self.sources(name)
        return rows if rows and all(self._stored(part) is not None for row in rows for part in row) else None

    def planned_device(self, module_key: str, fallback: torch.device | str) -> torch.device:
        """The generate_device the plan gives `module_key`, else `fallback` (its parent's device)."""
        kwargs = self.device_map.get(module_key, {})
        return torch.device(kwargs.get("generate_device", fallback))

    def _file_for(self, name: str) -> Any:
        path = self._shards[name]
        if path != self._open_path:
            self.close()  # one mapped shard at a time keeps the RSS overhead to a shard, not a model
            try:
                self._open_file = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise LoadError(f"{path}: not a readable safetensors file ({exc})") from None
            self._open_path = path
        return self._open_file

    def close(self) -> None:
        if self._open_file is not None:
            self._open_file.__exit__(None, None, None)
        self._open_file, self._open_path = None, None

    def load_tensor(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """Read one tensor onto `device` (KTransformers' SafeTensorLoader.load_tensor signature)."""
        return self._read(name, device, self.dtype)

    def load_buffer(self, name: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """A persistent buffer in the dtype the model keeps it in (e.g. a router's fp32 correction bias),
        whatever dtype the weights are converted to."""
        return self._read(name, device, dtype)

    def _read(self, name: str, device: torch.device | str, dtype: torch.dtype | None) -> torch.Tensor:
        parts = self._parts(name)
        if parts is not None:  # e.g. fused experts from per-expert tensors: rows stacked, each row concatenated
            return torch.stack([torch.cat([self._read(part, device, dtype) for part in row]) for row in parts])
        if self._stored(name) is None:
            raise LoadError(f"{self.model_dir}: checkpoint has no tensor {name!r}")
        name = self._stored(name)
        try:
            tensor = self._file_for(name).get_tensor(name)
        except LoadError:
            raise
        except Exception as exc:
            raise LoadError(f"{self._shards[name]}: cannot read tensor {name!r} ({exc})") from None
        if not tensor.is_floating_point():
            # Every tensor of the families we load is a float weight: integer data is a quantized or foreign
            # checkpoint, which would load without complaint and fail (or compute nonsense) in the forward.
            raise LoadError(f"{self.describe(name)} is {str(tensor.dtype).removeprefix('torch.')}, not a floating-point "
                            f"type; this loader reads float checkpoints (float32, bfloat16, float16), FP8 ones with "
                            f"block scales (`*_scale_inv`) and GGUF files (--gguf_path), not integer-quantized "
                            f"ones (GPTQ, AWQ)")
        if tensor.dtype in FP8_DTYPES:  # an FP8 checkpoint: dequantized with its block scales
            tensor = self._dequantize_fp8(name, tensor)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.to(device)
        if self.on_tensor is not None:
            self.on_tensor(name, tensor.numel() * tensor.element_size())
        return tensor

    def _dequantize_fp8(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """FP8 weights as published (e.g. Qwen3-VL-30B-A3B-Instruct-FP8): each block of the last two dims
        times its `<name>_scale_inv` entry (the block size follows from the two shapes), in bfloat16."""
        scale_name = f"{name}_scale_inv"
        if scale_name not in self._shards:
            raise LoadError(f"{self.describe(name)} is {str(tensor.dtype).removeprefix('torch.')} without "
                            f"{scale_name!r}: an FP8 weight needs its block scales")
        scale = self._file_for(scale_name).get_tensor(scale_name).float()
        if scale.dim() != tensor.dim() or scale.shape[:-2] != tensor.shape[:-2]:
            raise LoadError(f"{self.describe(scale_name)} has shape {tuple(scale.shape)}, which does not tile "
                            f"{name!r} {tuple(tensor.shape)}")
        rows, cols = tensor.shape[-2:]
        block_rows, block_cols = -(-rows // scale.shape[-2]), -(-cols // scale.shape[-1])  # ceil division
        full = scale.repeat_interleave(block_rows, -2).repeat_interleave(block_cols, -1)[..., :rows, :cols]
        return (tensor.float() * full).to(torch.bfloat16)

    def describe(self, name: str) -> str:
        """Where a tensor comes from, for error messages."""
        return f"{self._shards.get(name, self.model_dir)}: tensor {name!r}"
