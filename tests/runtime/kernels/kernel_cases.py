"""What this folder's kernel tests share, so each test file holds only its checks.

In the test process, two fixtures (a test file imports them by name: a conftest.py here would take the
module name `conftest` from tests/conftest.py, which other folders import helpers from):
    interpreter  runs a script of twin-against-kernel checks in Triton's interpreter, in a subprocess
                 (the interpreter is chosen when the kernels are defined: TRITON_INTERPRET=1 at import)
    hopper       Triton's front end and ptxas for sm_90 at Qwen3-VL-30B-A3B's shapes and the H200's
                 tuned tiles (what the interpreter does not check: e.g. a name given two types)
In the interpreter's scripts (the preamble makes this folder importable): the quantized stores they
fill and the dequantize-then-compute reference they hold the kernels to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

HERE = Path(__file__).resolve().parent
QWEN3_VL_30B_A3B = {"H": 2048, "I": 768}  # hidden and expert intermediate sizes

# every script: torch, seed 0, this module importable; `print("OK")` after it says it ran to its end
PREAMBLE = f"""import sys
sys.path.insert(0, {str(HERE)!r})
import torch
torch.manual_seed(0)
"""


@pytest.fixture
def interpreter() -> Callable[..., None]:
    """run(script, timeout=300): `script` after PREAMBLE in a fresh process under Triton's interpreter
    (skips without Triton); it must run to its end."""
    from conftest import run_in_triton_interpreter

    def run(script: str, timeout: int = 300) -> None:
        run_in_triton_interpreter(PREAMBLE + script + '\nprint("OK")\n', timeout=timeout)
    return run


@dataclass
class Hopper:
    triton: Any
    tuned: dict[str, Any]   # the H200's entry of tuning.json
    compile_fn: Callable[..., Any]
    shapes: dict[str, int] = field(default_factory=lambda: dict(QWEN3_VL_30B_A3B))

    @property
    def tl(self) -> Any:
        return self.triton.language

    def compile(self, kernel: Any, signature: dict, constants: dict, **options: Any) -> Any:
        return self.compile_fn(kernel, signature, constants, **options)


@pytest.fixture
def hopper() -> Hopper:
    """Compiling for sm_90: skips under the interpreter (it replaces the compiler) or without Triton."""
    from conftest import UNDER_INTERPRETER, compile_for_hopper

    if UNDER_INTERPRETER:
        pytest.skip("the interpreter replaces the compiler")
    triton = pytest.importorskip("triton")
    from vismmoe_kt.runtime.kernels import tuning

    return Hopper(triton, tuning.entry("NVIDIA H200"), compile_for_hopper)


# --- inside the interpreter's scripts --------------------------------------------------------------
def q6k_rows(experts: int, rows: int, inter: int, d_scale: float, d_low: float,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Random Q6_K bytes of `rows` rows of `inter` weights, each super-block's own d finite (rand * d_scale
    + d_low): a kernel reading another block's d would give other outputs."""
    blocks = inter // 256
    data = torch.randint(0, 256, (experts, rows, blocks * 210), dtype=torch.uint8, generator=generator)
    for d_at in range(208, blocks * 210, 210):
        d = (torch.rand(experts, rows, 1, generator=generator) * d_scale + d_low).to(torch.float16)
        data[..., d_at:d_at + 2] = d.view(torch.uint8)
    return data


def filled_store(experts: int, hidden: int, inter: int, dtype: torch.dtype, fmt: str,
                 q6k_down: Callable[[], torch.Tensor] | None = None) -> Any:
    """An ExpertStore in `fmt` whose layer 0 holds random experts; with `q6k_down` (the down parts' Q6_K
    bytes, drawn after gate and up), a Q4_K_M file's layer: gate and up in Q4_K, down in Q6_K, as stored."""
    from vismmoe_kt.runtime import q4k
    from vismmoe_kt.runtime.store import ExpertStore

    store = ExpertStore(experts, hidden, inter, dtype, pin_memory=False, fmt=fmt)
    if q6k_down is None:
        store.fill_layer(0, torch.randn(experts, 2 * inter, hidden) / 8, torch.randn(experts, hidden, inter) / 8)
    else:
        gate, up = (q4k.quantize(torch.randn(experts, inter, hidden) / 8) for _ in range(2))
        store.fill_layer_raw(0, gate, up, q6k_down(), down_format="q6_k")
    return store


def dequantized_reference(store: Any, ids: torch.Tensor, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each pair's output the plain way (pair p is token p // top_k's): its expert of layer 0 dequantized,
    then computed in fp32."""
    gate_up, down = store.dequantized(store.layers[0][ids], 0)
    xs = x.float()[torch.arange(ids.numel()) // top_k]
    gate, up = torch.bmm(gate_up.float(), xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    return torch.bmm(down.float(), (torch.nn.functional.silu(gate) * up).unsqueeze(-1)).squeeze(-1)


def assert_nibbles_by_exponent(ptx: str) -> None:
    """The PTX turns 4-bit weights into floats by the exponent trick (block_decode._nibble_float: an OR of
    2^23's bits), not by int-to-float conversions, an eighth of the FP32 rate on sm_90: those left are the
    scales', a few per super-block against one OR per weight pair of nibbles."""
    import re

    conversions = re.findall(r"cvt\.rn\.f32\.[su]32", ptx)
    exponents = re.findall(r"or\.b32\s+%r\d+, %r\d+, 1258291200;", ptx)   # | 0x4B000000
    assert exponents and 4 * len(conversions) <= len(exponents), (len(conversions), len(exponents))
