"""Q6_K, llama.cpp's 6-bit k-quant, as a part of a host store's blocks: Q4_K_M files keep the experts'
down projection in Q6_K in about half of the layers (llama.cpp gives those layers more bits), and a
Q4_K store takes them as the file stores them (store.py: a block's parts may differ in format).

A row of `cols` weights is `cols / 256` super-blocks of 210 bytes (ggml's `block_q6_K`):
    ql[128]      the quants' low 4 bits: each 128 weights take 64 bytes, weights 0-31 and 64-95 of
                 them in the low nibbles of bytes 0-31 and 0-31 again (high nibbles), 32-63 and 96-127
                 in bytes 32-63
    qh[64]       the quants' high 2 bits: each 128 weights take 32 bytes, weight 32 q + l (q = 0..3)
                 in bits 2q, 2q + 1 of byte l
    scales[16]   int8, one per 16 weights
    d            float16, the super-block's scale
weight = d * scales[w / 16] * (q - 32), q in 0..63.

Only read here (what a GGUF file holds, tested against the `gguf` package): the store writes its own
blocks in its own format (q4k.py for a Q4_K store), so there is no quantizer; `row_bytes` and
`dequantize` as in q8.py.
"""

from __future__ import annotations

import torch

BLOCK = 256        # weights per super-block
BLOCK_BYTES = 210  # ql (128), qh (64), scales (16), d (2)


def row_bytes(cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"Q6_K needs rows whose length is a multiple of {BLOCK}, got {cols}")
    return cols // BLOCK * BLOCK_BYTES


def dequantize(data: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., cols / 256 * 210) uint8 -> (..., cols) in `dtype`."""
    *lead, nbytes = data.shape
    if nbytes != row_bytes(cols):
        raise ValueError(f"{nbytes} bytes per row is not Q6_K for {cols} weights")
    nb = cols // BLOCK
    blocks = data.reshape(*lead, nb, BLOCK_BYTES)
    ql = blocks[..., :128].reshape(*lead, nb, 2, 2, 32).to(torch.int32)      # (half, byte group, l)
    qh = blocks[..., 128:192].reshape(*lead, nb, 2, 32).to(torch.int32)      # (half, l)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).reshape(*lead, nb, 2, 8).float()
    d = blocks[..., 208:210].contiguous().view(torch.float16).float().reshape(*lead, nb, 1, 1, 1, 1)
    # quarter q of a half: low nibbles of group q % 2 for q < 2, high nibbles for q >= 2; bits 2q of qh
    low = torch.stack([ql[..., 0, :] & 0xF, ql[..., 1, :] & 0xF, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], dim=-2)
    high = torch.stack([(qh >> (2 * q)) & 3 for q in range(4)], dim=-2)     # (..., nb, 2, 4, 32)
    q = (low | (high << 4)) - 32
    # scale of weight 32 q + l of a half: scales[8 h + l // 16 + 2 q]
    scale = scales.reshape(*lead, nb, 2, 4, 2)                               # (half, q, l // 16)
    w = q.float().reshape(*lead, nb, 2, 4, 2, 16) * scale[..., None] * d
    return w.reshape(*lead, cols).to(dtype)
