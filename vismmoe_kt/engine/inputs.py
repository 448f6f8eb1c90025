"""The one request builder: chat messages and images -> the processor's model inputs, on the model's device.

Everything that asks a model something (chat, the server, eval, calibrate, the benchmarks) builds
its inputs here, so the chat template, the processor call and the device move are written once.
"""

from __future__ import annotations

from typing import Any, Sequence


def user_turn(text: str, images: int = 0) -> dict[str, Any]:
    """A user message in the processor's chat-template form: `images` image slots, then the text."""
    return {"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]}


def build_inputs(processor: Any, messages: Sequence[dict[str, Any]], images: Sequence[Any] = (),
                 device: Any = None, tools: Sequence[dict[str, Any]] | None = None) -> Any:
    """Processor outputs (input ids, pixel values, grids, ...) for a conversation, on `device` if given;
    `tools`: function definitions for a chat template that renders them (transformers' `tools=`)."""
    extra = {"tools": list(tools)} if tools else {}
    prompt = processor.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)
    inputs = processor(text=[prompt], images=list(images) or None, return_tensors="pt")
    return inputs.to(device) if device is not None else inputs


def model_device(model: Any) -> Any:
    """Where a model's inputs go: the device of its input embeddings."""
    return model.get_input_embeddings().weight.device


def ask_inputs(model: Any, processor: Any, text: str, images: Sequence[Any] = ()) -> Any:
    """One user turn with its images, ready for `model`."""
    return build_inputs(processor, [user_turn(text, len(images))], images, model_device(model))
