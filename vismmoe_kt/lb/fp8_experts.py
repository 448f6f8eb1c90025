"""FP8 experts for ReaLB's switched pairs: every expert's weights in E4M3 once, at load; the switched pairs
of a call in one grouped GEMM per projection.

Shapes: E experts, P switched pairs of a call, H hidden, I expert intermediate size.

The fp8 backend's per-expert function (precision.py) quantizes an expert's BF16 weights on every call
and runs one `_scaled_mm` per switched expert. Reading the BF16 weights to quantize them costs what the
BF16 GEMM would have cost, so switching an expert could only add time. Here instead:
- at load, each expert's gate_up (2I, H) and down (H, I) rows in E4M3, one float32 scale per output
  row (its amax / 448): half the BF16 bytes, read instead of them when the expert is switched;
- per call, the pairs sorted by expert, each row's activations quantized with a scale of its own (per
  token, as precision.py does; on the GPU one Triton pass per projection, fp8_quant.py, the down
  projection's with the SiLU and product fused in), then each projection as one grouped GEMM over
  every switched expert: `torch._scaled_grouped_mm` (FP8 tensor cores, rowwise scales, fast
  accumulation) on a GPU that has it (Hopper), else `torch._scaled_mm` expert by expert (the CPU, and
  the GPU's fallback, whose reason `stats` gives).
Both ways quantize the same values with the same scales, so on the CPU the result is precision.py's
fp8 backend's, bit for bit. The rows come back in the caller's order.
"""

from __future__ import annotations

from typing import Any

import torch

from .fp8_quant import quantize_rows, silu_mul_quantize
from .precision import fp8_rows


class Fp8Experts:
    """E4M3 copies of a layer's (or a rank's) experts, made once; `__call__` computes pairs from them."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up, self.gate_up_scale = self._quantized(gate_up)   # (E, 2I, H), (E, 2I)
        self.down, self.down_scale = self._quantized(down)            # (E, H, I), (E, H)
        self.grouped = _has_grouped_fp8(gate_up.device)
        self.reason_per_expert: str | None = None if self.grouped else "no FP8 grouped GEMM on this device"

    @staticmethod
    def _quantized(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.empty(weights.shape, dtype=torch.float8_e4m3fn, device=weights.device)
        scales = torch.empty(weights.shape[:2], dtype=torch.float32, device=weights.device)
        for e in range(weights.shape[0]):  # an expert at a time: no float32 copy of the whole layer
            q, s = fp8_rows(weights[e])
            values[e], scales[e] = q, s.squeeze(-1)
        return values, scales

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.gate_up_scale, self.down, self.down_scale))

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, act: Any) -> torch.Tensor:
        """(P, H) outputs of the pairs (x[p], expert experts[p]) in x's dtype (float32 from float32)."""
        sorted_experts, order = torch.sort(experts, stable=True)
        # each expert's group end, from the sorted ids on the device (bincount would wait for the host)
        ends = torch.searchsorted(sorted_experts, torch.arange(self.gate_up.shape[0], device=experts.device),
                                  right=True)
        y = self.grouped_rows(x[order], ends, act)
        out = torch.empty_like(y)
        out[order] = y
        return out

    def grouped_rows(self, x: torch.Tensor, ends: torch.Tensor, act: Any) -> torch.Tensor:
        """(P, H) outputs of rows x (P, H) already grouped by expert, group e ending at ends[e]."""
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        xq, xs = quantize_rows(x.contiguous())
        gate_up = self._project(xq, xs, self.gate_up, self.gate_up_scale, ends, out_dtype)
        hq, hs = silu_mul_quantize(gate_up, act)  # act(gate) * up in E4M3, one pass
        return self._project(hq, hs, self.down, self.down_scale, ends, out_dtype)

    def _project(self, xq: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor,
                 ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """E4M3 rows xq (scales xs (P,)) grouped by expert (group e ends at ends[e]) times their expert's
        weights (E, N, K)."""
        if self.grouped:
            try:
                # fast accumulation: without it the FP8 grouped GEMM took 364 us where BF16's took 191
                # (14,709 rows, 16 experts, H200, 2026-12-01), with it 156, the same error
                return torch._scaled_grouped_mm(xq, weights.transpose(-2, -1), xs, scales,
                                                offs=ends.to(torch.int32), out_dtype=out_dtype, use_fast_accum=True)
            except (RuntimeError, NotImplementedError) as exc:  # shapes or a build it refuses: per expert
                self.grouped = False
                self.reason_per_expert = f"torch._scaled_grouped_mm: {str(exc).splitlines()[0][:160]}"
        out = torch.empty(xq.shape[0], weights.shape[1], dtype=out_dtype, device=xq.device)
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                out[start:end] = torch._scaled_mm(xq[start:end], weights[e].t(), scale_a=xs[start:end, None],
                                                  scale_b=scales[e][None, :], out_dtype=out_dtype)
            start = end
        return out

    def stats(self) -> dict[str, Any]:
        return {"fp8_grouped": self.grouped, "fp8_weight_bytes": self.nbytes,
                **({"fp8_per_expert_reason": self.reason_per_expert} if self.reason_per_expert else {})}


def _has_grouped_fp8(device: torch.device) -> bool:
    """torch's FP8 grouped GEMM runs on Hopper (compute capability 9.x) GPUs."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] == 9)
