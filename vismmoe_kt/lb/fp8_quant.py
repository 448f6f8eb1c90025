"""Activations into E4M3 with a scale per row, one pass each: the switched pairs' inputs to the FP8 GEMMs.

On the H200 the torch formula (precision.fp8_rows: a float32 copy, abs, amax, divide, clamp, cast: six
kernels and two float32 copies of the rows) took longer than the FP8 grouped GEMM it feeds: 437 us for
14,709 rows of 2,048 against 156 us for the gate/up GEMM (realb_layer_bench's probe, 2026-12-01). Here a
Triton program per row reads the row once, takes its amax, and writes the E4M3 values and the scale:

    quantize_rows(x (P, N))           -> (E4M3 (P, N), float32 scales (P,))
    silu_mul_quantize(gate_up (P, 2I)) -> the same of silu(gate) * up, the down projection's input,
                                         rounded to x's dtype between the steps as the torch formula is

Scales as fp8_rows: amax / 448, at least 1e-12. The kernels run on CUDA tensors (float32 division and
exp may round differently from torch's in the last bit, which can move a value to the next E4M3 step);
everywhere else, and for an activation other than SiLU, the torch formula runs, so the CPU's results
are precision.py's bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .precision import E4M3_MAX, fp8_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch formula runs
    triton = tl = None


def is_silu(act: Any) -> bool:
    """Whether `act` is SiLU (torch's function or module, or transformers' activation class)."""
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _kernels_serve(t: torch.Tensor) -> bool:
    return tl is not None and t.is_cuda and t.dtype in (torch.bfloat16, torch.float16, torch.float32) \
        and t.dim() == 2 and t.is_contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values (P, N), float32 scales (P,)) of x (P, N)."""
    if not _kernels_serve(x) or x.shape[0] == 0:
        q, s = fp8_rows(x)
        return q, s.squeeze(-1)
    return quantize_rows_kernel(x)


def quantize_rows_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows by the Triton kernel (x contiguous (P, N), P > 0; any device under the interpreter)."""
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(rows,)](x, q, s, n, E4M3_MAX, BLOCK=triton.next_power_of_2(n), num_warps=4)
    return q, s


def silu_mul_quantize(gate_up: torch.Tensor, act: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 (P, I), float32 scales (P,)) of act(gate) * up, gate_up = [gate | up] (P, 2I)."""
    if not is_silu(act) or not _kernels_serve(gate_up) or gate_up.shape[0] == 0:
        gate, up = gate_up.chunk(2, dim=-1)
        q, s = fp8_rows(act(gate) * up)
        return q, s.squeeze(-1)
    return silu_mul_quantize_kernel(gate_up)


def silu_mul_quantize_kernel(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul_quantize by the Triton kernel (gate_up contiguous (P, 2I), P > 0)."""
    rows, two_i = gate_up.shape
    inter = two_i // 2
    q = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    s = torch.empty(rows, dtype=torch.float32, device=gate_up.device)
    _silu_mul_quantize_kernel[(rows,)](gate_up, q, s, inter, E4M3_MAX, BLOCK=triton.next_power_of_2(inter),
                                       num_warps=4)
    return q, s


if tl is not None:
    @triton.jit
    def _store_quantized(v, q_ptr, s_ptr, row, cols, ok, n, MAX: tl.constexpr):
        """v (BLOCK,) float32 of one row -> its E4M3 values and scale."""
        amax = tl.max(tl.where(ok, tl.abs(v), 0.0), axis=0)
        scale = tl.maximum(amax / MAX, 1e-12)
        tl.store(q_ptr + row * n + cols, (v / scale).to(tl.float8e4nv), mask=ok)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n, MAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        v = tl.load(x_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
        _store_quantized(v, q_ptr, s_ptr, row, cols, ok, n, MAX)

    @triton.jit
    def _silu_mul_quantize_kernel(gu_ptr, q_ptr, s_ptr, inter, MAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=ok, other=0.0)
        up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        # rounded to the input dtype after the SiLU and after the product, as torch's bf16 ops are
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        h = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
        _store_quantized(h, q_ptr, s_ptr, row, cols, ok, inter, MAX)
