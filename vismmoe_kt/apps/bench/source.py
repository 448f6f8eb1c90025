"""Where the benchmarked model comes from: a model directory, the demo model, or a synthetic
full-size model built in host memory (`--layers N` of its layers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InputError


@dataclass(frozen=True)
class ModelSource:
    model_path: Path | None = None   # a Hugging Face directory (or the demo model's)
    synthetic: str | None = None     # a name in vismmoe_kt.demo.synthetic.SYNTHETIC_MODELS
    layers: int | None = None        # synthetic only: keep the first N decoder layers
    demo: bool = False
    dtype: str | None = None

    def describe(self) -> str:
        if self.synthetic:
            from ...demo.synthetic import SYNTHETIC_MODELS

            total = SYNTHETIC_MODELS[self.synthetic]["text"]["num_hidden_layers"]
            return f"{self.synthetic} shapes, {self.layers or total} of {total} layers, random weights"
        if self.demo:
            from ...demo.tiny import DEMO_SPEC

            return f"demo model {DEMO_SPEC}, trained on the synthetic shapes task (tiny)"
        return str(self.model_path)

    @property
    def random_weights(self) -> bool:
        return self.synthetic is not None  # the demo model is trained (vismmoe_kt/demo/weights)

    def load(self, rules: Any, overrides: dict[str, Any], progress: bool = False):
        """(model, processor) with `rules` (a rule list) and loader overrides (devices)."""
        if self.synthetic:
            from ...demo.synthetic import load_synthetic

            return load_synthetic(self.synthetic, rules, layers=self.layers, dtype=self.dtype or "bfloat16",
                                  progress=progress, **overrides)
        from ...core.loader import load

        return load(self.model_path, rules, dtype=self.dtype, progress=progress, **overrides)


def model_source(args) -> ModelSource:
    """The one model the flags name (--model_path, --demo or --synthetic)."""
    chosen = [flag for flag, given in (("--model_path", args.model_path), ("--demo", args.demo),
                                       ("--synthetic", args.synthetic)) if given]
    if len(chosen) != 1:
        raise InputError("give exactly one of --model_path DIR, --demo or --synthetic NAME"
                         + (f" (got {' and '.join(chosen)})" if chosen else ""))
    if args.layers is not None and not args.synthetic:
        raise InputError("--layers applies to --synthetic models only")
    if args.layers is not None and args.layers < 1:
        raise InputError(f"--layers must be at least 1, got {args.layers}")
    if args.synthetic:  # argparse's choices already checked the name
        return ModelSource(synthetic=args.synthetic, layers=args.layers, dtype=args.dtype)
    if args.demo:
        from ...demo.tiny import demo_model_dir

        return ModelSource(model_path=demo_model_dir(), demo=True, dtype=args.dtype)
    path = Path(args.model_path)
    if not (path / "config.json").is_file():
        raise InputError(f"--model_path {path}: not a Hugging Face model directory (no config.json)")
    return ModelSource(model_path=path, dtype=args.dtype)
