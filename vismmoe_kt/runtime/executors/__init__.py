"""The offload runtime's decode executors, each built once from the OffloadPlan (offload_plan.py).

    placement.py       prefill and eager decode, incl. the hybrid CPU path's misses (one host read a layer)
    table_step.py      a lean decode step through the DecodeTable (slabs, a quantized store dequantized
                       into slabs, or quantized slabs), device work only
    batch_step.py      a batched decode step: pinned banks by `batch_experts`; offloaded layers token by
                       token through the table, expert-major on quantized slabs, or the placement path
    cpu_join.py        the hybrid's CPU pairs inside a table step
    step_lookahead.py  the lookahead predictor's prefetches inside a table step

Each holds a per-layer table of callables (pinned or offloaded: layer data, bound at construction);
the runtime swaps which executor serves `run_layer` at the step hooks, never per layer.
"""
