"""Q4_0, llama.cpp's 4-bit block format, for the host expert store: about a quarter of BF16's bytes.

A row of `cols` weights is `cols / 32` blocks of 18 bytes: a float16 scale d, then 16 bytes whose low
nibbles are the block's first 16 weights and high nibbles its last 16, weight = d * (nibble - 8)
(ggml's `block_q4_0`; d = the block's weight of largest magnitude / -8). A GGUF file's Q4_0 expert
tensors are these bytes as stored. Same interface as q8.py.
"""

from __future__ import annotations

import torch

BLOCK = 32        # weights per block
BLOCK_BYTES = 18  # float16 scale + 16 bytes of two nibbles


def row_bytes(cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"Q4_0 needs rows whose length is a multiple of {BLOCK}, got {cols}")
    return cols // BLOCK * BLOCK_BYTES


def quantize(weights: torch.Tensor) -> torch.Tensor:
    """(..., cols) float -> (..., cols / 32 * 18) uint8, as ggml (and the gguf package) quantize."""
    *lead, cols = weights.shape
    row_bytes(cols)
    blocks = weights.float().reshape(*lead, cols // BLOCK, BLOCK)  # float32, as ggml and the gguf package
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # signed, largest magnitude
    scale = extreme / -8
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    q = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.uint8)
    out = torch.empty(*lead, cols // BLOCK, BLOCK_BYTES, dtype=torch.uint8, device=weights.device)
    out[..., :2] = scale.to(torch.float16).view(torch.uint8).reshape(*lead, cols // BLOCK, 2)
    out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(*lead, cols // BLOCK * BLOCK_BYTES)


def dequantize(data: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., cols / 32 * 18) uint8 -> (..., cols) in `dtype`."""
    *lead, nbytes = data.shape
    if nbytes != row_bytes(cols):
        raise ValueError(f"{nbytes} bytes per row is not Q4_0 for {cols} weights")
    blocks = data.reshape(*lead, cols // BLOCK, BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    packed = blocks[..., 2:]
    q = torch.cat([packed & 0xF, packed >> 4], dim=-1).float() - 8
    return (q * scale).reshape(*lead, cols).to(dtype)
