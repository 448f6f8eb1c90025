"""Low-precision expert compute behind one interface: `expert_mlp(x[T, H], gate_up[2I, H], down[H, I], act)`.

- `nvfp4-emulated`: weights and activations through NVFP4 quantize-dequantize, then a matmul in the
  input dtype: exact NVFP4 numerics, the accuracy reference and the CPU path.
- `fp8`: W8A8 E4M3 with per-output-row weight scales and per-token activation scales through
  `torch._scaled_mm` (Hopper and newer GPUs; also runs on the CPU). The operators keep every expert's
  weights in E4M3 from load on and run the switched pairs as grouped GEMMs (fp8_experts.py); the
  function here quantizes on every call (the accuracy studies' reference).
- `nvfp4` (flashinfer's FP4 GEMMs, Blackwell only) is not in this build; asking for it is an error.
`auto` picks fp8 on a GPU with FP8 tensor cores (compute capability >= 8.9), else nvfp4-emulated,
and says so in the operator's statistics. Weights are quantized on demand and not kept.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .nvfp4 import nvfp4_dequantize, nvfp4_quantize

E4M3_MAX = 448.0
BACKENDS = ("auto", "nvfp4-emulated", "fp8", "nvfp4")


def fake_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    return nvfp4_dequantize(nvfp4_quantize(x, global_scale), x.dtype)


def _emulated(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Callable,
              scales: dict | None = None) -> torch.Tensor:
    """`scales`: calibrated NVFP4 global scales {"input", "gate_up", "down"} (missing ones: from the data)."""
    scales = scales or {}
    gate, up = F.linear(fake_nvfp4(x, scales.get("input")), fake_nvfp4(gate_up, scales.get("gate_up"))).chunk(2, dim=-1)
    return F.linear(fake_nvfp4(act(gate) * up), fake_nvfp4(down, scales.get("down")))


def fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 quantization of (..., N, K): (values, float32 scales (..., N, 1))."""
    scale = (t.float().abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xq, xs = fp8_rows(x)
    wq, ws = fp8_rows(weight)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=out_dtype)


def _fp8(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Callable, scales: dict | None = None) -> torch.Tensor:
    """W8A8 with per-row scales measured on the fly (FP8 has the range for it; `scales` is unused)."""
    gate, up = _fp8_linear(x, gate_up).chunk(2, dim=-1)
    return _fp8_linear(act(gate) * up, down)


def resolve_backend(requested: str, device: torch.device | str) -> str:
    device = torch.device(device)
    if requested not in BACKENDS:
        raise ValueError(f"precision_backend {requested!r} is not one of: {', '.join(BACKENDS)}")
    if requested == "nvfp4":
        raise ValueError("precision_backend nvfp4 needs flashinfer's FP4 GEMMs on a Blackwell GPU, which this build "
                         "does not have yet; use nvfp4-emulated (numerics) or fp8 (Hopper speed)")
    if requested != "auto":
        return requested
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return "fp8"
    return "nvfp4-emulated"


def expert_mlp_fn(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]:
    return {"nvfp4-emulated": _emulated, "fp8": _fp8}[backend]
