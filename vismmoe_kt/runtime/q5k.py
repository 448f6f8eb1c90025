"""Q5_K, llama.cpp's 5-bit k-quant, for the host store: the experts' type in the Q5_K_M GGUF files
(5.5 bits per weight, 0.34x of BF16's bytes), with Q4_K's scales and minimums and one more bit.

A row of `cols` weights is `cols / 256` super-blocks of 176 bytes (ggml's `block_q5_K`):
    d, dmin, scales[12]   as in Q4_K (q4k.py): a 6-bit scale and minimum per 32 weights
    qh[32]                the quants' fifth bits: weight w's in bit w // 32 of byte w % 32
    qs[128]               their low 4 bits, laid out as Q4_K's quants
weight = d * scale[s] * q - dmin * min[s], q in 0..31, s = w // 32.

`quantize` is the min-max variant (q4k.min_max_codes); `dequantize` reads any Q5_K bytes (tested
against the `gguf` package). Same interface as q8.py.
"""

from __future__ import annotations

import torch

from .q4k import BLOCK, SUB, kquant_dequantize, min_max_codes

BLOCK_BYTES = 176  # d, dmin (2 + 2), scales (12), qh (32), qs (128)


def row_bytes(cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"Q5_K needs rows whose length is a multiple of {BLOCK}, got {cols}")
    return cols // BLOCK * BLOCK_BYTES


def quantize(weights: torch.Tensor) -> torch.Tensor:
    """(..., cols) float -> (..., cols / 256 * 176) uint8 (min-max scales, as q4k.quantize)."""
    *lead, cols = weights.shape
    row_bytes(cols)
    nb = cols // BLOCK
    d, dmin, scales, q = min_max_codes(weights, 31, "Q5_K")      # q: (..., nb, 8, 32) in 0..31
    low = (q & 0xF).reshape(*lead, nb, 4, 2, SUB)                 # sub-blocks 2j (low nibbles), 2j + 1 (high)
    fifth = (q >> 4).to(torch.int32) << torch.arange(8, dtype=torch.int32, device=q.device)[:, None]
    out = torch.empty(*lead, nb, BLOCK_BYTES, dtype=torch.uint8, device=weights.device)
    out[..., 0:2], out[..., 2:4], out[..., 4:16] = d, dmin, scales
    out[..., 16:48] = fifth.sum(-2).to(torch.uint8)              # bit s of byte l: sub-block s's weight l
    out[..., 48:] = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*lead, nb, 128)
    return out.reshape(*lead, nb * BLOCK_BYTES)


def dequantize(data: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., cols / 256 * 176) uint8 -> (..., cols) in `dtype`."""
    return kquant_dequantize(data, cols, dtype, BLOCK_BYTES, "Q5_K", fifth_bit=True)
