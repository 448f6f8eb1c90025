"""Q8_0, llama.cpp's 8-bit block format, for the host expert store: half the bytes per fetched expert.

A row of `cols` weights is `cols / 32` blocks of 34 bytes: a float16 scale d, then 32 int8 values q,
weight = d * q (ggml's `block_q8_0`; d = max |w| / 127 over the block). A GGUF file's Q8_0 expert
tensors are these bytes as stored. The GPU keeps slabs in the model's dtype: experts are dequantized
as they arrive (transfers, and the decode step's misses), so only the PCIe bytes and the host's
memory shrink.
"""

from __future__ import annotations

import torch

BLOCK = 32        # weights per block
BLOCK_BYTES = 34  # float16 scale + 32 int8


def row_bytes(cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"Q8_0 needs rows whose length is a multiple of {BLOCK}, got {cols}")
    return cols // BLOCK * BLOCK_BYTES


def quantize(weights: torch.Tensor) -> torch.Tensor:
    """(..., cols) float -> (..., cols / 32 * 34) uint8 (round half away from zero, as ggml)."""
    *lead, cols = weights.shape
    row_bytes(cols)  # checks the length
    blocks = weights.float().reshape(*lead, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    scaled = blocks * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)  # half away from zero
    out = torch.empty(*lead, cols // BLOCK, BLOCK_BYTES, dtype=torch.uint8, device=weights.device)
    out[..., :2] = scale.to(torch.float16).view(torch.uint8).reshape(*lead, cols // BLOCK, 2)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(*lead, cols // BLOCK * BLOCK_BYTES)


def dequantize(data: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., cols / 32 * 34) uint8 -> (..., cols) in `dtype`."""
    *lead, nbytes = data.shape
    if nbytes != row_bytes(cols):
        raise ValueError(f"{nbytes} bytes per row is not Q8_0 for {cols} weights")
    blocks = data.reshape(*lead, cols // BLOCK, BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # (..., nb, 1)
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * scale).reshape(*lead, cols).to(dtype)
