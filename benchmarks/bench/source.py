"""Where the benchmarked model comes from: a model directory, the demo model, a model's GGUF files (with a
model directory, or alone: `--gguf_path FILE --mmproj_path FILE`, the directory rebuilt from their metadata as
`vismmoe-kt chat` does), or a synthetic full-size model built in host memory (`--layers N` of its layers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vismmoe_kt.errors import InputError


@dataclass(frozen=True)
class ModelSource:
    model_path: Path | None = None   # a Hugging Face directory (or the demo model's)
    synthetic: str | None = None     # a name in benchmarks.models.synthetic.SYNTHETIC_MODELS
    layers: int | None = None        # synthetic only: keep the first N decoder layers
    demo: bool = False
    dtype: str | None = None
    narrow: bool = False             # synthetic only: the family's layout at CPU-sized widths
    gguf_path: Path | None = None    # the weights from GGUF (core/gguf_checkpoint.py)
    mmproj_path: Path | None = None  # with gguf_path: the vision tower from llama.cpp's mmproj file

    def describe(self) -> str:
        if self.synthetic:
            from benchmarks.models.synthetic import total_layers

            total = total_layers(self.synthetic)
            narrow = " at narrow (CPU-sized) widths" if self.narrow else ""
            return f"{self.synthetic} shapes{narrow}, {self.layers or total} of {total} layers, random weights"
        if self.demo:
            from vismmoe_kt.demo.tiny import DEMO_SPEC

            return f"demo model {DEMO_SPEC}, trained on the synthetic shapes task (tiny)"
        if self.gguf_path:
            return f"{self.gguf_path}" + (f" + {self.mmproj_path}" if self.mmproj_path else "")
        return str(self.model_path)

    @property
    def family(self) -> str:
        """The model family (`config.model_type`), which picks the configurations' rule files."""
        if self.synthetic:
            from benchmarks.models.synthetic import SYNTHETIC_MODELS

            return SYNTHETIC_MODELS[self.synthetic]["family"]
        try:
            return str(json.loads((Path(self.model_path) / "config.json").read_text())["model_type"])
        except (OSError, ValueError, KeyError) as exc:
            raise InputError(f"--model_path {self.model_path}: cannot read model_type from config.json ({exc})") from None

    @property
    def random_weights(self) -> bool:
        return self.synthetic is not None  # the demo model is trained (vismmoe_kt/demo/weights)

    def load(self, rules: Any, overrides: dict[str, Any], progress: bool = False):
        """(model, processor) with `rules` (a rule list) and loader overrides (devices)."""
        if self.synthetic:
            from benchmarks.models.synthetic import load_synthetic

            return load_synthetic(self.synthetic, rules, layers=self.layers, dtype=self.dtype or "bfloat16",
                                  narrow=self.narrow, progress=progress, **overrides)

        from vismmoe_kt.core.loader import load

        files = {name: getattr(self, name) for name in ("gguf_path", "mmproj_path") if getattr(self, name)}
        return load(self.model_path, rules, dtype=self.dtype, progress=progress, **files, **overrides)

    def expert_bytes(self) -> int | None:
        """The routed experts' bytes of a synthetic model (what a budget such as 30% is a share of); None
        for a model directory (the runtime resolves a share there at load)."""
        if not self.synthetic:
            return None
        from benchmarks.models.synthetic import routed_expert_bytes, synthetic_config, synthetic_processor

        config = synthetic_config(self.synthetic, synthetic_processor(self.synthetic).tokenizer, self.layers, self.narrow)
        return routed_expert_bytes(config, self.dtype or "bfloat16")


def model_source(args) -> ModelSource:
    """The one model the flags name (--model_path, --demo, --synthetic, or --gguf_path with --mmproj_path)."""
    gguf, mmproj = getattr(args, "gguf_path", None), getattr(args, "mmproj_path", None)
    chosen = [flag for flag, given in (("--model_path", args.model_path), ("--demo", args.demo),
                                       ("--synthetic", args.synthetic)) if given]
    if mmproj and not gguf:
        raise InputError("--mmproj_path goes with --gguf_path (the model's GGUF file)")
    if gguf and (args.demo or args.synthetic):
        raise InputError(f"--gguf_path goes with --model_path DIR or alone, not with {' and '.join(chosen)}")
    if len(chosen) != 1 and not (gguf and not chosen):
        raise InputError("give exactly one of --model_path DIR, --demo, --synthetic NAME or --gguf_path FILE "
                         "--mmproj_path FILE" + (f" (got {' and '.join(chosen)})" if chosen else ""))
    for flag, given in (("--layers", args.layers is not None), ("--narrow", args.narrow)):
        if given and not args.synthetic:
            raise InputError(f"{flag} applies to --synthetic models only")
    if args.synthetic:  # argparse's choices already checked the name
        from benchmarks.models.synthetic import SYNTHETIC_MODELS, total_layers

        total = total_layers(args.synthetic)
        if args.layers is not None and not 1 <= args.layers <= total:
            raise InputError(f"--layers must be in 1..{total} for {args.synthetic}, got {args.layers}")
        if args.narrow and "narrow" not in SYNTHETIC_MODELS[args.synthetic]:
            raise InputError(f"--narrow: {args.synthetic} has no narrow variant (those that do: "
                             f"{', '.join(n for n, m in SYNTHETIC_MODELS.items() if 'narrow' in m)})")
        return ModelSource(synthetic=args.synthetic, layers=args.layers, dtype=args.dtype, narrow=args.narrow)
    if args.demo:
        from vismmoe_kt.demo.tiny import demo_model_dir

        return ModelSource(model_path=demo_model_dir(), demo=True, dtype=args.dtype)
    files = dict(gguf_path=Path(gguf) if gguf else None, mmproj_path=Path(mmproj) if mmproj else None)
    if gguf and not args.model_path:  # a model from its GGUF files alone: the directory their metadata rebuilds
        from vismmoe_kt.core.gguf_model import model_dir_from_gguf

        return ModelSource(model_path=model_dir_from_gguf(gguf, mmproj), dtype=args.dtype, **files)
    path = Path(args.model_path)
    if not (path / "config.json").is_file():
        raise InputError(f"--model_path {path}: not a Hugging Face model directory (no config.json)")
    return ModelSource(model_path=path, dtype=args.dtype, **files)
