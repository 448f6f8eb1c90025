"""The CPU proxy of Qwen3-VL-30B-A3B's expert layout that the host-work benchmarks load (`proxy-48x128`: 48 layers
x 128 experts, top-8, toy widths): their shared arguments, and the proxy saved for a run."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

PROXY = "proxy-48x128"
SLABS = 2427  # what 6 GiB of Q4_K slabs hold for the real model (40% of its 6016 experts)
RULES = ["optimize_rules/qwen3vl-lru.yaml", "optimize_rules/qwen3vl-offload.yaml"]


def add_arguments(parser, each: str, out_file: str) -> None:
    """--rules (each run `each`), --slabs, --threads and --out (where `out_file` goes)."""
    parser.add_argument("--rules", nargs="+", default=RULES, help=f"rule files to run ({each})")
    parser.add_argument("--slabs", type=int, default=SLABS, help="the expert budget in experts (slabs) of the proxy")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default=None, help=f"directory for {out_file}")


@contextmanager
def saved_proxy(threads: int) -> Iterator[tuple[Path, int]]:
    """(the proxy saved in a temporary directory, one fp32 expert's bytes), with `threads` torch threads."""
    from vismmoe_kt.demo.tiny import SPECS, save_tiny_model

    torch.set_num_threads(threads)
    spec = SPECS[PROXY]
    with tempfile.TemporaryDirectory() as tmp:
        yield save_tiny_model(Path(tmp) / "proxy", PROXY, seed=0), 3 * spec.moe_intermediate * spec.hidden * 4
