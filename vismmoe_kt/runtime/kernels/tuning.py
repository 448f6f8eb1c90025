"""The kernels' tuned configurations, as data per device (tuning.json next to this module).

An entry is named as torch.cuda.get_device_name names the device ("NVIDIA H200"); "default" serves
every other device and the CPU (the Triton interpreter), and a device's entry overrides it key by
key, so a new GPU's entry holds only what was measured on it. `decode_kernel_bench --tune` (with
--batch, --batch --quantized) measures the alternatives; benchmarks/results/kernel-tuning.md keeps
the measurements behind each value.

Keys (lists in the file, tuples here):
  bf16_gemv          gate_up, down: (output rows per program, input elements per loaded tile, warps)
  quantized_gemv     per format: (output rows per program, warps, load form) of the quantized slabs'
                     GEMVs; the form (quantized_gemv.LOAD_FORMS) is how a program walks its rows'
                     super-blocks: "loop" a step at a time, "unrolled", "tile" all at once, or (Q4_K)
                     "shared": all at once with the inputs loaded once for every row, or (Q4_K) "dp4a":
                     the shared tile against int8 inputs (q4k_dp4a.py; less exact: a device names it
                     where it measured faster)
  q4_k_word_loads    Q4_K's tile and loop forms read the quant bytes as 32-bit words (else byte by byte;
                     the shared form always reads words)
  expert_major       gate_up, down: (output columns per program, input elements per loop step, warps,
                     pipeline stages)
  quantized_major    gate_up, down: (output rows per program, warps, pipeline stages)
  quantized_batch_gemv_pairs  a batched step's pinned quantized blocks go pair by pair (the GEMVs in one
                     launch) up to this many token x expert pairs, the quantized_major kernels beyond
  quantized_prefill  the same kernels for a prompt's layers on filled slabs: block_m (pairs per block: a
                     prompt has many tokens per expert) and gate_up, down as quantized_major's (with a
                     fourth value, 64: a quarter super-block a kernel step, and a fifth, "weights": the
                     decoded weights as the tensor cores' first operand, quantized_major.tile_form);
                     optionally `long`: other tiles for prompts of at least `from_pairs_per_expert` pairs
                     per expert (`prefill_tiles`). Formats other than Q4_K adjust them (format_form)
  prefetch_programs  programs of the lookahead prefetch's copy: few, so the layers computing
                     meanwhile keep the GPU
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any, Iterator

import torch

TABLE = Path(__file__).with_name("tuning.json")
DEFAULT = "default"

_overrides: dict[str, Any] = {}


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


@functools.cache
def entry(device_name: str) -> dict[str, Any]:
    """Every tuned value for the device of this name: its entry over the default one."""
    table = json.loads(TABLE.read_text(encoding="utf-8"))
    return _tuples({**table[DEFAULT], **table.get(device_name, {})})


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str | None) -> str:
    """tuning.json's name for `device` (None, a non-CUDA device, or CUDA named where none is present, as a plan
    resolved for a GPU in a test on the CPU: the default)."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return DEFAULT
    index = torch.device(device).index
    return _cuda_name(torch.cuda.current_device() if index is None else index)


def get(key: str, device: torch.device | str | None = None) -> Any:
    """The tuned value of `key` (see the module's docstring) for kernels running on `device`."""
    return _overrides[key] if key in _overrides else entry(device_name(device))[key]


def prefill_tiles(device: torch.device | str | None, pairs_per_expert: float) -> dict[str, Any]:
    """quantized_prefill's tiles for a prompt averaging `pairs_per_expert` (tokens x K / E): its `long` ones from
    their threshold on, where the device has them (larger blocks decode each expert's weights fewer times, which
    pays once a block fills: on the H100 blocks of 64 with quarter steps took 928 against 1052 us a layer at 512
    tokens, 32 pairs per expert, and lost at 236 tokens, 15 pairs)."""
    tuned = get("quantized_prefill", device)
    long = tuned.get("long")
    return long if long is not None and pairs_per_expert >= long["from_pairs_per_expert"] else tuned


@contextlib.contextmanager
def overridden(**values: Any) -> Iterator[None]:
    """Within the block `get` returns these values on every device: the alternatives a benchmark
    times, or a test's other code path."""
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
