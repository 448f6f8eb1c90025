"""A multi-turn image chat over a loaded model: streams the reply and times prefill and decode."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from transformers import TextStreamer

from .generation import generate
from .decoding import decode_engine
from .inputs import build_inputs, model_device, user_turn
from ..errors import InputError


@dataclass
class TurnTimings:
    prompt_tokens: int
    prompt_seconds: float  # input to first generated token: vision tower + prefill
    generated_tokens: int
    decode_seconds: float  # first generated token to the last

    def ollama_lines(self) -> str:
        """The lines ktransformers' local_chat (after Ollama) prints after each answer."""
        prompt_rate = self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0
        steps = max(self.generated_tokens - 1, 0)  # the first token comes out of the prefill
        # one token (or none) means no decode step: a rate of 0.00 would read as a stall
        eval_rate = (f"{steps / self.decode_seconds:.2f} tokens/s" if steps and self.decode_seconds > 0
                     else "n/a (no decode step)")
        return (
            f"prompt eval count:    {self.prompt_tokens} token(s)\n"
            f"prompt eval duration: {self.prompt_seconds:.3f}s\n"
            f"prompt eval rate:     {prompt_rate:.2f} tokens/s\n"
            f"eval count:           {self.generated_tokens} token(s)\n"
            f"eval duration:        {self.decode_seconds:.3f}s\n"
            f"eval rate:            {eval_rate}"
        )


class TimingStreamer(TextStreamer):
    """Prints text as it is generated and records when each new token arrived."""

    def __init__(self, tokenizer: Any, out: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out
        self.token_times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if not (self.skip_prompt and self.next_tokens_are_prompt):
            self.token_times.extend([time.perf_counter()] * int(value.numel()))
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


class ChatSession:
    def __init__(self, model: Any, processor: Any, max_new_tokens: int = 1000, greedy: bool = False,
                 temperature: float | None = None, top_p: float | None = None):
        self.model, self.processor = model, processor
        self.max_new_tokens = max_new_tokens
        self.sampling = self._sampling(greedy, temperature, top_p)
        self.messages: list[dict[str, Any]] = []
        self.images: list[Any] = []
        self.context = model.vismmoe.adapter.context_length(model.config)

    def _sampling(self, greedy: bool, temperature: float | None, top_p: float | None) -> dict[str, Any]:
        if greedy:
            return {"do_sample": False}
        defaults = self.model.generation_config
        if temperature is None and top_p is None and not defaults.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": temperature if temperature is not None else (defaults.temperature or 1.0),
                "top_p": top_p if top_p is not None else (defaults.top_p or 1.0)}

    def clear(self) -> None:
        """Forget the conversation: its turns and images (the next question starts a new one)."""
        self.messages, self.images = [], []
        self.forget_cache()

    def forget_cache(self) -> None:
        """The next turn prefills whole instead of continuing what the decode engine's cache holds."""
        engine = decode_engine(self.model)
        if engine is not None:
            engine.forget()

    def ask(self, text: str, images: list[Any] = (), out: TextIO | None = None) -> tuple[str, TurnTimings]:
        """Add a user turn (with its images), stream the assistant's reply to `out` (default stdout).

        A prompt (the whole conversation with this turn) over the model's context is an InputError,
        raised before anything is generated; the session is then unchanged. So is it after an error or a
        KeyboardInterrupt while answering: a turn is recorded once it is answered."""
        out = out or sys.stdout
        messages = self.messages + [user_turn(text, len(images))]
        try:
            inputs = build_inputs(self.processor, messages, self.images + list(images))
        except (ValueError, TypeError) as exc:  # the processor's own checks: the turn is dropped, as the server answers 400
            raise InputError(f"the model's processor refused the input: {exc or type(exc).__name__}") from None
        length = int(inputs["input_ids"].shape[1])
        if length + 1 > self.context:  # no room for one new token (the server refuses the same prompts)
            raise InputError(f"the prompt is {length} tokens, over this model's context of {self.context}")
        inputs = inputs.to(model_device(self.model))
        streamer = TimingStreamer(self.processor.tokenizer, out)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                output = generate(self.model, inputs, min(self.max_new_tokens, self.context - length),
                                  streamer=streamer, **self.sampling)
        except BaseException:  # KeyboardInterrupt (the chat's Ctrl-C) included: the cache may be half written
            self.forget_cache()
            raise
        end = time.perf_counter()
        new_tokens = output[0, inputs["input_ids"].shape[1]:]
        reply = self.processor.tokenizer.decode(new_tokens, skip_special_tokens=True)
        # The turn is recorded only once it is answered: a turn that failed leaves no half of itself behind.
        self.messages.extend([messages[-1], {"role": "assistant", "content": [{"type": "text", "text": reply}]}])
        self.images.extend(images)
        first = streamer.token_times[0] if streamer.token_times else end
        timings = TurnTimings(int(inputs["input_ids"].shape[1]), first - start, int(new_tokens.numel()), end - first)
        return reply, timings
