"""vismmoe-kt: VisMMOE offloading and ReaLB mixed-precision operators for vision-language MoE models,
applied to Hugging Face models through KTransformers-compatible injection rules.

Public API: `vismmoe_kt.load(model_path, optimize_config_path, **overrides) -> (model, processor)`,
`vismmoe_kt.generate(model, inputs, max_new_tokens, ...) -> token ids`, `vismmoe_kt.core.stats(model) -> dict`.
Nothing heavy is imported until it is used.
"""

__version__ = "0.1.0"


def load(model_path, optimize_config_path=None, **overrides):
    """See `vismmoe_kt.core.loader.load`."""
    from .core.loader import load as _load

    return _load(model_path, optimize_config_path, **overrides)


def generate(model, inputs, max_new_tokens, **kwargs):
    """See `vismmoe_kt.engine.generation.generate`: our decode path where the rules have a VisDecoder."""
    from .engine.generation import generate as _generate

    return _generate(model, inputs, max_new_tokens, **kwargs)


def stats(model):
    """Runtime statistics of a loaded model (what `--stats` prints), as a dict."""
    from .core.stats import collect_stats

    return collect_stats(model)


__all__ = ["load", "generate", "stats", "__version__"]
