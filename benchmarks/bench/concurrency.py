"""N requests at once through the model runner (engine/runner.py): what a server's N clients see.

All N arrive together, each with its own picture of the same size (and, under a routing source, its
own routing table). One ModelRunner serves a warm-up and the timed run, as a server keeps one: the
CUDA graphs of each batch size are captured in the warm-up. Per level:
    aggregate_tok_s            generated tokens / wall time of the run (the prefills included)
    full_batch_decode_tok_s    the rate over the decode steps that ran all N together
    ttft_p50_s / ttft_p95_s    time to each request's first token (the last waits for N - 1 prefills)
    itl_p50_s / itl_p95_s      every gap between a request's consecutive tokens (steps that also
                               prefilled a newcomer included: what a streaming client sees)
    per_request_tok_s          median over requests of their decode rate after the first token
    decode_bytes_per_token     offloaded: expert bytes over PCIe per generated decode token
    tokens_agreeing_alone      with `alone`: per request, the share of its tokens, from the first, that
                               equal what it gets alone (greedy; low-precision kernels may differ late)
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from vismmoe_kt.engine.runner import PREFILL_BUDGET, BatchRequest, ModelRunner
from vismmoe_kt.engine.inputs import build_inputs, user_turn
from benchmarks.bench.inputs import PROMPT
from benchmarks.bench.timing import mark_first_token


def concurrent_requests(processor: Any, n: int, size: int, device: torch.device | str, first: int = 0) -> list[dict]:
    """N requests of PROMPT, each with its own random `size` x `size` picture (seeded: every run alike;
    `first`: the pictures from that index on, e.g. another rank's share)."""
    images = [Image.fromarray(np.random.default_rng([size, i]).integers(0, 256, (size, size, 3), dtype=np.uint8))
              for i in range(first, first + n)]
    return [build_inputs(processor, [user_turn(PROMPT, 1)], [image], device) for image in images]


def decode_pcie_bytes(runtime: Any) -> int:
    """Expert bytes that crossed PCIe in decode so far: copies, and misses the kernels read in place."""
    summary = runtime.summary()
    return summary["bytes_copied_decode"] + summary["bytes_host_reads_decode"]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, 100 * q, method="nearest")) if values else None


def _agreeing(got: list[int], want: list[int]) -> float:
    """The share of `want` that `got` repeats from the first token on."""
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return same / max(len(want), 1)


def _run(runner: ModelRunner, requests: list[dict], tokens: int, generated: list[list[int]] | None = None,
         on_first_token: Callable[[], None] | None = None) -> tuple[list[list[float]], list[tuple[float, int]]]:
    """Every request's token times and every step's (end time, decode batch size); each request's
    tokens into `generated` if given; `on_first_token` called as the run's first token arrives."""
    times: list[list[float]] = [[] for _ in requests]
    generated = [[] for _ in requests] if generated is None else generated

    def record(i: int, token: int) -> None:
        if on_first_token is not None and not any(times):
            on_first_token()
        times[i].append(time.perf_counter())
        generated[i].append(token)

    batch = [BatchRequest(dict(r), tokens, min_new_tokens=tokens, on_token=lambda token, i=i: record(i, token))
             for i, r in enumerate(requests)]
    for request in batch:
        runner.add(request)
    steps = []
    while not runner.idle:
        size, _ = runner.step()  # its tokens were read on the host: the step's device work is done
        steps.append((time.perf_counter(), size))
    return times, steps


def measure_concurrency(model: Any, requests: list[dict], tokens: int, pcie_bytes: Callable[[], int] | None = None,
                        prefill_chunk: int | None = None, prefill_budget: int = PREFILL_BUDGET,
                        profile: Callable[[Callable[[], int]], dict] | None = None,
                        alone: Callable[[int, dict, int], list[int]] | None = None,
                        samples: bool = False, before_timed: Callable[[], None] | None = None) -> dict[str, Any]:
    """The figures above for len(requests) requests of `tokens` new tokens each, prompts prefilled
    `prefill_chunk` tokens a step (None: whole, those waiting together in one forward up to
    `prefill_budget` tokens). `profile(run)`: one more run of them under a profiler (`run()` returns
    its decode steps), its result under "kernels". `alone(i, request, tokens)`: request i's greedy
    tokens run by itself (after the timed run, which made it the i-th request), for the agreement.
    `samples`: also every time to first token and inter-token gap ("samples"), to pool over ranks.
    `before_timed()`: called between the warm-up and the timed run."""
    n = len(requests)
    if n < 2 or tokens < 2:
        raise ValueError(f"a concurrency run needs at least 2 requests of 2 tokens, got {n} of {tokens}")
    runner = ModelRunner(model, n, max(r["input_ids"].shape[1] for r in requests) + tokens, max_queue=n,
                         prefill_chunk=prefill_chunk, prefill_budget=prefill_budget)
    _run(runner, requests, tokens)  # warm-up: captures, caches
    runner.forget_histories()  # the same prompts again: prefilled whole, as new requests are
    if before_timed is not None:
        before_timed()
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    copied = pcie_bytes() if pcie_bytes is not None else None
    before = runner.stats()
    sync()
    start = time.perf_counter()
    generated: list[list[int]] = [[] for _ in requests]
    times, steps = _run(runner, requests, tokens, generated)
    wall = time.perf_counter() - start
    full = [(t1 - t0) for (t0, _), (t1, b) in zip(steps, steps[1:]) if b == n]  # steps after every prefill
    gaps = [b - a for stamps in times for a, b in zip(stamps, stamps[1:])]
    rates = [(len(stamps) - 1) / (stamps[-1] - stamps[0]) for stamps in times if len(stamps) > 1 and stamps[-1] > stamps[0]]
    stats = runner.stats()
    result = {"requests": n, "tokens_per_request": tokens, "wall_s": wall, "aggregate_tok_s": n * tokens / wall,
              "full_batch_decode_tok_s": n * len(full) / sum(full) if full else None, "full_batch_steps": len(full),
              "ttft_p50_s": percentile([s[0] - start for s in times if s], 0.5),
              "ttft_p95_s": percentile([s[0] - start for s in times if s], 0.95),
              "itl_p50_s": percentile(gaps, 0.5), "itl_p95_s": percentile(gaps, 0.95),
              "per_request_tok_s": float(np.median(rates)) if rates else None,
              "decode_bytes_per_token": None if copied is None else (pcie_bytes() - copied) / (n * (tokens - 1)),
              "steps": stats["steps"], "graphed_steps": stats["graphed_steps"],
              "eager_pieces_per_step": stats["eager_pieces_per_step"], "captured_shapes": stats["captured_shapes"],
              "prefill_chunk": stats["prefill_chunk"], "prefill_budget": prefill_budget,
              # the timed run's own (the runner's counters include the warm-up's)
              **{key: stats[key] - before[key] for key in ("prefill_groups", "grouped_prompts", "reused_prefixes")}}
    if samples:
        result["samples"] = {"ttft_s": [s[0] - start for s in times if s], "itl_s": gaps}
    if alone is not None:
        result["tokens_agreeing_alone"] = [_agreeing(got, alone(i, r, tokens)) for i, (got, r)
                                           in enumerate(zip(generated, requests))]
    if profile is not None:
        def run() -> int:
            runner.forget_histories()
            # the first token marks the prompts' end in the trace (kernel_timeline.decode_start)
            return sum(1 for _, size in _run(runner, requests, tokens, on_first_token=mark_first_token)[1] if size)

        result["kernels"] = profile(run)
    return result


def measure_data_parallel(model: Any, processor: Any, n: int, size: int, tokens: int, group: Any,
                          prefill_chunk: int | None = None) -> dict[str, Any]:
    """Data parallel + expert parallelism: every rank of `group` decodes N requests of its own (its own
    pictures) together, the ranks in lockstep (parallel/lockstep.py), as `measure_concurrency` does
    for one process. Returns, on every rank, the group's figures: N x ranks requests, tokens over the
    slowest rank's wall time, the ranks' full-batch rates summed, TTFT and inter-token percentiles over
    every rank's samples, each rank's own figures ("per_rank"), and the timed run's expert compute per
    rank with its straggler time (parallel/compute_timer.py: per layer call, the slowest rank's compute
    minus the mean)."""
    import torch.distributed as dist

    from vismmoe_kt.parallel.compute_timer import straggler_seconds
    from vismmoe_kt.parallel.launch import expert_parallel_operators
    from vismmoe_kt.parallel.lockstep import Lockstep

    requests = concurrent_requests(processor, n, size, group.device, first=group.rank * n)
    timers = [op.timer for op in expert_parallel_operators(model)]

    def start_timing() -> None:  # each layer's own compute, call by call, in the timed run only
        for timer in timers:
            timer.enabled = True
            timer.take()
    with Lockstep(model, group) as lockstep:
        mine = measure_concurrency(model, requests, tokens, prefill_chunk=prefill_chunk, samples=True,
                                   before_timed=start_timing)
    mine.update(passes=lockstep.passes, idle_passes=lockstep.idle_passes)
    mine["compute_s"] = [timer.take() for timer in timers]  # after the drain: the other ranks' passes too
    for timer in timers:
        timer.enabled = False
    ranks: list[dict] = [{} for _ in range(group.world)]
    dist.all_gather_object(ranks, mine)
    balance = straggler_seconds([r.pop("compute_s") for r in ranks])
    pooled = {key: [v for r in ranks for v in r["samples"][key]] for key in ("ttft_s", "itl_s")}
    for r in ranks:
        r.pop("samples")
    full = [r["full_batch_decode_tok_s"] for r in ranks]
    wall = max(r["wall_s"] for r in ranks)
    return {"requests": n * group.world, "ranks": group.world, "requests_per_rank": n, "tokens_per_request": tokens,
            "wall_s": wall, "aggregate_tok_s": n * group.world * tokens / wall,
            "full_batch_decode_tok_s": sum(full) if all(f is not None for f in full) else None,
            "ttft_p50_s": percentile(pooled["ttft_s"], 0.5), "ttft_p95_s": percentile(pooled["ttft_s"], 0.95),
            "itl_p50_s": percentile(pooled["itl_s"], 0.5), "itl_p95_s": percentile(pooled["itl_s"], 0.95),
            "per_request_tok_s": float(np.median([r["per_request_tok_s"] for r in ranks
                                                  if r["per_request_tok_s"] is not None] or [np.nan])),
            "decode_bytes_per_token": None,
            **{key: sum(r[key] for r in ranks) for key in ("steps", "graphed_steps", "prefill_groups")},
            **balance, "per_rank": ranks}
