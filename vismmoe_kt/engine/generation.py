"""Generation with our decode path, one request or many, all through a ModelRunner (runner.py).

`generate(model, inputs, ...)` is what chat, eval and the benchmarks call: one request (batch 1), like
`model.generate`. Where the model has a decode engine (decoding.py: a VisDecoder rule and `decode: lean`,
the default), the request runs on the engine's single-request runner: the prompt through the model once
(vision tower, M-RoPE positions, pruning) into its KV slot, every further token from the decode step, as
a step of one row (no DynamicCache growth, no HF generation loop, one host read per token: the sampled
id, which the streamer and the stop check need anyway). A conversation's next turn prefills only what
follows its history. Otherwise it is `model.generate`, unchanged.

`generate_batch(model, requests, ...)` decodes several requests together on a runner of several slots
(the server keeps one open instead: apps/serve/).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.context import context_of_model
from .decoding import decode_engine
from ..core.model_pass import ModelPass, PrefillRow
from .runner import PREFILL_BUDGET, REQUEST_KEYS, BatchRequest, ModelRunner
from .sampling import Sampling, check_context, samples


def generate(model: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int, streamer: Any = None,
             do_sample: bool = False, temperature: float | None = None, top_p: float | None = None,
             stopping_criteria: Any = None, min_new_tokens: int = 0) -> torch.Tensor:
    """(1, prompt + new) token ids, like `model.generate` (batch 1). End-of-sequence tokens do not stop
    it before `min_new_tokens` (benchmarks decode a fixed count). `stopping_criteria` (transformers'
    StoppingCriteria) is asked after every token, with the ids so far."""
    do_sample = samples(do_sample, temperature)  # greedy below MIN_TEMPERATURE on both paths (sampling.py)
    engine = decode_engine(model)
    if engine is None:
        context = context_of_model(model)
        if context is not None:  # the prompt, for operators keyed by position (transformers' loop decodes on from it)
            prompt = inputs["input_ids"]
            row = PrefillRow(next(REQUEST_KEYS), None, 0, int(prompt.shape[1]), prompt, max_new_tokens)
            context.model_pass = ModelPass((row,))
        sampling = {"do_sample": do_sample} if not do_sample else {"do_sample": True, "temperature": temperature,
                                                                     "top_p": top_p}
        return model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                              streamer=streamer, stopping_criteria=stopping_criteria, **sampling)
    prompt = inputs["input_ids"]
    check_context(model, engine.adapter, int(prompt.shape[1]), max_new_tokens)
    if prompt.shape[0] != 1:
        raise ValueError(f"generate takes one request at a time, got a batch of {prompt.shape[0]}: generate_batch "
                         "decodes several")
    if max_new_tokens < 1:
        return prompt
    runner = engine.runner_for(int(prompt.shape[1]) + max_new_tokens)
    produced: list[int] = []

    def on_token(token: int) -> bool:
        produced.append(token)
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        if stopping_criteria is None:
            return False
        so_far = torch.cat([prompt, torch.tensor([produced], device=prompt.device)], dim=1)
        return bool(torch.as_tensor(stopping_criteria(so_far, None)).all())

    sampling = Sampling(do_sample, 1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p)
    request = BatchRequest(inputs, max_new_tokens, sampling, min_new_tokens, on_token)
    if streamer is not None:
        streamer.put(prompt.cpu())
    try:
        runner.add(request)
        while not runner.idle:
            runner.step()
    except BaseException:
        runner.cancel(request)  # its slot comes back, and holds nothing for a next turn
        try:
            runner.step()
        except Exception:  # the runner cannot step any more: the next request gets a new one
            engine.discard(runner)
        raise
    finally:
        if streamer is not None:
            streamer.end()
    return torch.cat([prompt, torch.tensor([produced], dtype=prompt.dtype, device=prompt.device)], dim=1)


def generate_batch(model: Any, requests: list[dict[str, torch.Tensor]], max_new_tokens: int | list[int],
                   max_batch: int = 8, sampling: Sampling | list[Sampling] | None = None,
                   min_new_tokens: int = 0, on_step: Callable[[int], None] | None = None,
                   stats: dict | None = None, runner: ModelRunner | None = None,
                   prefill_chunk: int | None = None, prefill_budget: int = PREFILL_BUDGET) -> list[torch.Tensor]:
    """Each request's (1, prompt + new) token ids, the requests decoded together (at most `max_batch` at
    once, the rest waiting for a free slot). `on_step(B)` is told each decode step's batch size; `stats`
    gets the step's counters (ModelRunner.stats). `runner`: an idle ModelRunner to run them on
    (its slots, and the graphs its earlier steps captured), instead of a new one of `max_batch` slots
    that prefills `prefill_chunk` prompt tokens per step (None: whole prompts, fresh ones together up to
    `prefill_budget` tokens)."""
    budgets = [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    samplings = sampling if isinstance(sampling, list) else [sampling or Sampling()] * len(requests)
    if not len(budgets) == len(samplings) == len(requests):
        raise ValueError(f"{len(requests)} requests, {len(budgets)} token budgets, {len(samplings)} samplings")
    for request, budget in zip(requests, budgets):
        check_context(model, model.vismmoe.adapter, int(request["input_ids"].shape[1]), budget)
    if runner is None:
        capacity = max(r["input_ids"].shape[1] + n for r, n in zip(requests, budgets))
        runner = ModelRunner(model, min(max_batch, len(requests)), capacity, max_queue=len(requests),
                             prefill_chunk=prefill_chunk, prefill_budget=prefill_budget)
    elif not runner.idle:
        raise ValueError("generate_batch needs an idle runner")
    batch = [BatchRequest(r, n, s, min_new_tokens) for r, n, s in zip(requests, budgets, samplings)]
    for request in batch:
        runner.add(request)
    while not runner.idle:
        size, _ = runner.step()
        if size and on_step is not None:
            on_step(size)
    if stats is not None:
        stats.update(runner.stats())
    return [torch.cat([r.inputs["input_ids"], torch.tensor([r.sequence.generated], dtype=r.inputs["input_ids"].dtype,
                                                           device=r.inputs["input_ids"].device)], dim=1)
            for r in batch]

