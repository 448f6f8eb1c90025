"""Prefill latency and decode speed of `generate`, and the spread of repeated measurements."""

from __future__ import annotations

import io
import statistics
import time
from typing import Callable, NamedTuple

import torch

from vismmoe_kt.core.context import context_of_model
from vismmoe_kt.engine.chat import TimingStreamer
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.engine.decoding import decode_engine


class _NoText:
    """Stands in for the tokenizer: decoding text is not what is being timed."""

    @staticmethod
    def decode(*args, **kwargs) -> str:
        return ""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TimedGeneration(NamedTuple):
    prefill_s: float           # seconds to the first token
    decode_tok_s: float        # tokens/s from the first token's arrival to the last's
    tokens: torch.Tensor       # the new tokens (host)
    gaps_s: list[float]        # seconds between consecutive tokens' arrivals


FIRST_TOKEN = "vismmoe-kt: first token"  # a profile's marker of the first token's arrival on the host


def mark_first_token() -> None:
    """Marks the first token's arrival in a running torch.profiler trace (kernel_timeline.decode_start finds
    the prompt's end by it)."""
    with torch.profiler.record_function(FIRST_TOKEN):
        pass


class _MarkingStreamer(TimingStreamer):
    """Calls `on_first_token` as the first new token arrives (a profile marks the prompt's end with it)."""

    def __init__(self, on_first_token: Callable[[], None]):
        super().__init__(_NoText(), io.StringIO())
        self.on_first_token = on_first_token

    def put(self, value: torch.Tensor) -> None:
        first = not self.token_times
        super().put(value)
        if first and self.token_times:
            self.on_first_token()


def timed_generate(model, request: dict, decode_tokens: int,
                   on_first_token: Callable[[], None] | None = None) -> TimedGeneration:
    """The first token's latency and the next `decode_tokens` tokens' rate, as a client sees them.

    Through the product's own generation (the lean decode path where the rules have a VisDecoder),
    greedy and forced to the full length (`min_new_tokens`): a random model's EOS would end early.
    Every request prefills cold: the lean path would otherwise reuse the same prompt's cache.
    Times are the tokens' arrivals (each after its id was read back, so after the compute stream's
    work for it). The device is synchronized after the last token, for the next measurement, but that
    wait is not decode time: it may include work queued for a later request, such as the layerwise
    prefill's copy of the next prompt's first layer.
    """
    streamer = TimingStreamer(_NoText(), io.StringIO()) if on_first_token is None else _MarkingStreamer(on_first_token)
    new_tokens = decode_tokens + 1  # the first token comes out of the prefill
    engine = decode_engine(model)
    if engine is not None:
        engine.forget()
    context = context_of_model(model)
    routing = context.routing if context is not None else None
    if routing is not None:  # the synthetic router's table for this request, made before the clock starts
        routing.prepare(request["input_ids"], new_tokens)
    _sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = generate(model, request, new_tokens, streamer=streamer, min_new_tokens=new_tokens)
    _sync()
    times = streamer.token_times
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    return TimedGeneration(times[0] - start, decode_tokens / (times[-1] - times[0]),
                           out[0, request["input_ids"].shape[1]:].cpu(), gaps)


def captured_segments(model) -> int:
    """Decode graph segments the model's lean decode engine has captured so far (0 without one, or before its first
    request)."""
    engine = decode_engine(model)
    return engine.stats().get("segments_captured", 0) if engine is not None else 0


# warm-up requests beyond those asked for, while they still capture decode graphs
EXTRA_WARM_UPS = 2


def warm_up(model, request: dict, decode_tokens: int, at_least: int = 1, extra: int = EXTRA_WARM_UPS,
            on_request: Callable[[], None] = lambda: None) -> int:
    """Untimed requests of the measured length before the timed ones (the same cache capacity), so that a timed
    request pays no graph capture: `at_least`, then up to `extra` more while the last one captured a decode graph.
    Why more: a trial of the default rules that settles in a request changes the decode step's variant there, and
    the spans that request had already passed are captured in the next one (143 ms in a rep on an H100). The
    timed requests then route as they would after `at_least + extra` warm-ups, whatever number ran, so every
    configuration's measured requests route alike (the synthetic routing is seeded by the request's number, a
    trace is read on request by request: RoutingSource.skip). Returns how many ran; `on_request` is called after
    each (a progress bar). `at_least` 0: none, and the routing is left as it is."""
    if at_least < 1:
        return 0
    count = 0
    while count < at_least + extra:
        before = captured_segments(model)
        timed_generate(model, request, decode_tokens)
        count += 1
        on_request()
        if count >= at_least and captured_segments(model) == before:  # (captures nothing at all: eager decode)
            break
    context = context_of_model(model)
    if context is not None and context.routing is not None:  # as if every warm-up had run: the same next request
        context.routing.skip(at_least + extra - count)       # in every configuration
    return count


def profile_decode(model, request: dict, decode_tokens: int) -> dict | None:
    """One more request with each lean decode piece timed to its end: seconds per step by piece kind
    and layer (None without the lean decode path)."""
    engine = decode_engine(model)
    if engine is None:
        return None
    engine.reset_profile()
    engine.profiling = True
    try:
        timed_generate(model, request, decode_tokens)
    finally:
        engine.profiling = False
    return engine.profile()


def spread(values: list[float]) -> dict[str, float]:
    """median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
