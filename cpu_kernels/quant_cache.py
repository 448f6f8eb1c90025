"""Where kt-kernel's quantized CPU experts are kept between runs, and when they may be reused.

kt-kernel quantizes BF16 experts to INT8 / INT4 itself (its AMX / AVX-512 `AMXInt8_MOE`,
`AMXInt4_MOE`: per-row scales) and can write the result to a directory (`MOEConfig.save` + `path`,
one `_layer_N` folder per layer) and read it back (`MOEConfig.load`), which skips the quantization
and the BF16 read of those experts. We keep that directory beside the checkpoint:

    <model dir>/.vismmoe-cache/cpu-<dtype>/          (or ~/.cache/vismmoe-kt/... if the model's is read-only)
        manifest.json       what the files were made from: checkpoint files (name, size, mtime),
                            expert shape, dtype, kt-kernel's version
        _layer_N/           kt-kernel's files for layer N
        _layer_N.done       written after layer N's files are complete (a run killed half-way
                            leaves no marker, so that layer is quantized again)

A manifest that does not match (another checkpoint, another kt-kernel) empties the directory first.
Models without a checkpoint directory (synthetic weights) quantize every time, in a temporary
directory removed afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

FORMAT = 1


def checkpoint_fingerprint(model_dir: Path, extra: list[Path] = ()) -> list[list]:
    """(name, bytes, mtime_ns) of every weight file, and of `extra` files (GGUF weights read from
    elsewhere): changes when the checkpoint does."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".gguf") or p.name.endswith(".json"))
    files += sorted(Path(p) for p in extra)
    return [[str(p) if p.parent != model_dir else p.name, p.stat().st_size, p.stat().st_mtime_ns]
            for p in files if p.is_file()]


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


class QuantCache:
    """One dtype's cache directory for one model (see the module docstring)."""

    def __init__(self, model_dir: Path | None, dtype: str, shape: dict, kt_version: str, layout: dict | None = None,
                 sources: list[Path] = ()):
        """`layout`: what kt-kernel's files depend on beyond the shape (its build variant, the worker
        sub-pools it splits each layer across); `sources`: weight files outside `model_dir`."""
        self.temporary = model_dir is None
        if model_dir is None:
            self.root = Path(tempfile.mkdtemp(prefix=f"vismmoe-cpu-{dtype}-"))
            self.manifest: dict = {}
            weakref.finalize(self, shutil.rmtree, str(self.root), True)
            return
        model_dir = Path(model_dir).resolve()
        self.manifest = {"format": FORMAT, "dtype": dtype, "shape": shape, "kt_kernel": kt_version,
                         "layout": layout or {}, "checkpoint": checkpoint_fingerprint(model_dir, list(sources))}
        root = model_dir / ".vismmoe-cache" / f"cpu-{dtype}"
        if not _writable(root):
            digest = hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]
            base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
            root = base / "vismmoe-kt" / f"{model_dir.name}-{digest}" / f"cpu-{dtype}"
            root.mkdir(parents=True, exist_ok=True)
        self.root = root
        manifest = root / "manifest.json"
        try:
            matches = json.loads(manifest.read_text()) == self.manifest
        except (OSError, ValueError):
            matches = False
        if not matches:  # made from something else (or never): start over
            for entry in root.iterdir():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            manifest.write_text(json.dumps(self.manifest, indent=1))

    def has(self, layer: int) -> bool:
        return not self.temporary and (self.root / f"_layer_{layer}.done").exists()

    def saved(self, layer: int, least_bytes: int) -> None:
        """Layer `layer` is loaded from files kt-kernel just wrote: mark them complete if they hold at
        least `least_bytes` (kt-kernel only prints when a write fails, and a full disk truncates), or
        (temporary) delete them at once, so a synthetic model never holds its experts on disk too."""
        folder = self.root / f"_layer_{layer}"
        if self.temporary:
            shutil.rmtree(folder, ignore_errors=True)
            return
        written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
        if written >= least_bytes:
            (self.root / f"_layer_{layer}.done").write_text("")
        else:  # not trusted next time: quantized again
            print(f"warning: kt-kernel wrote {written} of at least {least_bytes} bytes for layer {layer} to {folder}; "
                  "it will be quantized again at the next start")

    def forget(self, layer: int) -> None:
        """A layer whose files kt-kernel could not read back: drop them, so it is quantized again."""
        (self.root / f"_layer_{layer}.done").unlink(missing_ok=True)
        shutil.rmtree(self.root / f"_layer_{layer}", ignore_errors=True)

