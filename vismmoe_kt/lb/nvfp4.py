"""NVFP4 numerics in pure torch: E2M1 values, 16-element blocks, E4M3 block scales, FP32 global scale.

    x ~= code_value * block_scale / global_scale
    global_scale = 448 * 6 / amax(|x|)             (so the largest block scale fits E4M3's 448)
    block_scale  = e4m3(amax(|block|) / 6 * global_scale)
    code_value   = round_to_e2m1(x * global_scale / block_scale)   nearest, ties to even

Codes are 4 bits (sign + 3-bit index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, the first
element in the low nibble. Blocks run along the last (reduction) dimension, which must be a
multiple of 16. This is the accuracy reference for the low-precision backends and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MAX, E4M3_MAX = 6.0, 448.0


@dataclass
class NVFP4Tensor:
    codes: torch.Tensor         # uint8 (..., K/2): two 4-bit codes per byte
    block_scales: torch.Tensor  # float8_e4m3fn (..., K/16)
    global_scale: torch.Tensor  # float32 scalar
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.block_scales.numel() + 4


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Index (0..7) of the nearest E2M1 magnitude to |x| (|x| <= 6), ties to the even index."""
    grid = E2M1.to(x.device)
    mag = x.abs().clamp(max=E2M1_MAX)
    high = torch.searchsorted(grid, mag.contiguous()).clamp(max=7)
    low = (high - 1).clamp(min=0)
    d_low, d_high = mag - grid[low], grid[high] - mag
    take_high = (d_high < d_low) | ((d_high == d_low) & (high % 2 == 0))
    return torch.where(take_high, high, low)


def global_scale_for(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().max().float()
    return torch.tensor(1.0) if amax == 0 else (E4M3_MAX * E2M1_MAX) / amax


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> NVFP4Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of {BLOCK}, got {x.shape[-1]}")
    if not torch.isfinite(x).all():
        raise ValueError("NVFP4 cannot encode NaN or infinite values")
    xf = x.float()
    g = global_scale_for(xf) if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32)
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=-1) / E2M1_MAX * g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    decoded = scales.float()
    safe = torch.where(decoded == 0, torch.ones_like(decoded), decoded)
    scaled = blocks * g / safe[..., None]
    index = round_to_e2m1(scaled)
    code = (index | ((scaled < 0) & (index > 0)).to(index.dtype) << 3).to(torch.uint8).reshape(*x.shape[:-1], -1)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return NVFP4Tensor(packed, scales, g.float(), x.shape)


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    low, high = q.codes & 0x0F, q.codes >> 4
    code = torch.stack([low, high], dim=-1).reshape(*q.codes.shape[:-1], -1).long()
    value = E2M1.to(q.codes.device)[code & 7] * torch.where(code & 8 > 0, -1.0, 1.0)
    blocks = value.reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK)
    out = blocks * q.block_scales.float()[..., None] / q.global_scale
    return out.reshape(q.shape).to(dtype)
