"""vismmoe-kt: VisMMOE offloading and ReaLB mixed-precision operators for vision-language MoE models,
applied to Hugging Face models through KTransformers-compatible injection rules.

Public API: `vismmoe_kt.load(model_path, optimize_config_path, **overrides) -> (model, processor)`.
Nothing heavy is imported until it is used.
"""

__version__ = "0.1.0"


def load(model_path, optimize_config_path=None, **overrides):
    """See `vismmoe_kt.loader.load`."""
    from .loader import load as _load

    return _load(model_path, optimize_config_path, **overrides)


__all__ = ["load", "__version__"]
