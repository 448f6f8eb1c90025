"""VisDecoder and VisionSaliency: visual-token pruning after the pinned prefix (VisMMOE Algorithm 1).

VisDecoder replaces the language model; its forward is the engine's `TextForward` (static-cache
masks, pruning after the prefix: vismmoe_kt/engine/text_forward.py says how). Registering the text
model in the load context is what lets the decode engine run the decode steps itself.
VisionSaliency replaces the vision tower, unchanged, and records the saliency of each merged visual
token (vismmoe_kt/vision/saliency.py) for the decoder. The two find each other through the context,
in either rule order; a compression that needs saliency without a VisionSaliency rule is an error
once every rule is applied.

Rule kwargs (VisDecoder): CompressionSettings (vismmoe_kt/vision/compression.py). `decode` and
`graphs` were kwargs of this rule; they are the engine's options now (`--decode`, `--graphs`,
`load(..., decode=, graphs=)`), and old rule files that carry them still load, with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

from ..core.context import DecodeOptions
from ..engine.text_forward import TextForward
from ..vision.compression import CompressionSettings
from ..vision.saliency import SaliencyRecorder
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule, settings_from

ENGINE_KWARGS = ("decode", "graphs")


class VisionSaliency(BaseInjectedModule):
    """The vision tower, unchanged, plus a hook that records visual-token saliency when asked."""

    def __init__(self, key, gguf_loader, config, orig_module, prefill_device="cuda", generate_device="cuda", **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        adapter = self.adapter
        recorder = SaliencyRecorder(adapter.vision_last_attention(orig_module), adapter.vision_merge_size(config),
                                    adapter.attention_received)
        recorder.enabled = self.context.pruning.needs_vision_saliency  # a VisDecoder rule came first
        self.context.saliency = recorder


class VisDecoder(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("gradient_checkpointing",)

    def __init__(self, key, gguf_loader, config, orig_module, prefill_device="cuda", generate_device="cuda", **kwargs):
        engine = {name: kwargs.pop(name) for name in ENGINE_KWARGS if name in kwargs}
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device)
        context = self.context
        if engine:
            warnings.warn(f"VisDecoder kwargs {', '.join(engine)} are engine options now: pass --decode/--graphs "
                          f"(or load(..., decode=, graphs=)) and remove them from the rule file", DeprecationWarning,
                          stacklevel=2)
            context.decode = DecodeOptions(**{**asdict(context.decode), **engine})
        self.settings = settings_from(CompressionSettings, kwargs, "VisDecoder")
        self.text_forward = TextForward(orig_module, self.adapter, self.settings, context)
        context.text_model = orig_module
        context.text_forward = self.text_forward
        if self.settings.needs_vision_saliency:
            context.pruning.needs_vision_saliency = True
            if context.saliency is not None:  # a VisionSaliency rule came first
                context.saliency.enabled = True
            context.checks.append(self._check_saliency)

    def _check_saliency(self) -> None:
        if self.context.saliency is None:
            raise ValueError(f"compression {self.settings.compression!r} needs the vision tower's saliency: add a rule "
                             f"replacing the vision tower with vismmoe_kt.operators.vis_decoder.VisionSaliency")

    def set_compression(self, **changes: Any) -> None:
        """New compression settings for the next prefills (studies sweep methods and ratios on one model)."""
        self.settings = CompressionSettings(**{**asdict(self.settings), "salient_ratio": None, **changes})
        self.text_forward.settings = self.settings
        self.context.pruning.active = self.settings.active

    def forward(self, *args: Any, **kwargs: Any):
        return self.text_forward(*args, **kwargs)

    def stats(self) -> dict[str, Any]:
        state = self.context.decode_state  # the engine's, when it decoded for this model
        decode = {f"decode_{k}": v for k, v in state.stats().items()} if state is not None else {}
        options = self.context.decode
        return {**self.text_forward.stats(), "decode": options.decode, "graphs": options.graphs, **decode}
