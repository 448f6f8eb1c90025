"""Q4_K, llama.cpp's 4-bit k-quant, for the host expert store: the experts' format in the Q4_K_M GGUF
files most users run (4.5 bits per weight, 0.28x of BF16's bytes, like Q4_0, with lower error: a
scale and a minimum per 32 weights).

A row of `cols` weights is `cols / 256` super-blocks of 144 bytes (ggml's `block_q4_K`):
    d, dmin      float16 each: the super-block's scale for the sub-blocks' scales and for their minimums
    scales[12]   eight 6-bit scales and eight 6-bit minimums, one pair per 32 weights, packed
                 (sub-block s < 4: scale = scales[s] & 63, min = scales[s + 4] & 63; s >= 4: the low
                 nibble / high nibble of scales[s + 4] plus the top two bits of scales[s - 4] / scales[s])
    qs[128]      4-bit quants: each 64 weights take 32 bytes, the first 32 weights in the low nibbles,
                 the next 32 in the high ones
weight = d * scale[s] * q - dmin * min[s].

`dequantize` reads any Q4_K bytes (a GGUF file's as stored: tested against the `gguf` package).
`quantize` is the plain min-max variant of ggml's reference (each sub-block's scale and minimum from its
range, then both rounded to 6 bits of the super-block's largest): valid Q4_K, with somewhat more error
than llama.cpp's searched scales. The `gguf` package has no Q4_K quantizer. Same interface as q8.py.
"""

from __future__ import annotations

import torch

BLOCK = 256        # weights per super-block
SUB = 32           # weights per scale / minimum
BLOCK_BYTES = 144  # d, dmin (2 + 2), scales (12), qs (128)


def row_bytes(cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"Q4_K needs rows whose length is a multiple of {BLOCK}, got {cols}")
    return cols // BLOCK * BLOCK_BYTES


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 12) uint8 -> the eight 6-bit scales and minimums (..., 8) as int32."""
    b = packed.to(torch.int32)
    low_scale, low_min = b[..., 0:4] & 63, b[..., 4:8] & 63
    high_scale = (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)
    high_min = (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)
    return torch.cat([low_scale, high_scale], -1), torch.cat([low_min, high_min], -1)


def _pack_scales_and_mins(scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The inverse of `_scales_and_mins`: (..., 8) integers in 0..63 each -> (..., 12) uint8."""
    s, m = scale.to(torch.int32), mins.to(torch.int32)
    out = torch.empty(*s.shape[:-1], 12, dtype=torch.int32, device=s.device)
    out[..., 0:4] = s[..., 0:4] | ((s[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (s[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    return out.to(torch.uint8)


def min_max_codes(weights: torch.Tensor, levels: int, name: str):
    """The k-quants' min-max encoding of (..., cols) weights into 256-weight super-blocks of eight
    32-weight sub-blocks, quants in 0..levels (15 for Q4_K, 31 for Q5_K): returns float16 d and dmin
    (..., nb, 1) as bytes (..., nb, 2) each, the packed 6-bit scales and minimums (..., nb, 12), and the
    quants (..., nb, 8, 32) uint8."""
    *lead, cols = weights.shape
    nb = cols // BLOCK
    x = weights.float().reshape(*lead, nb, BLOCK // SUB, SUB)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} cannot hold non-finite weights (NaN or inf)")
    low = x.amin(-1).clamp(max=0.0)                     # ggml keeps minimums <= 0 (stored as -min >= 0)
    scale = (x.amax(-1) - low) / levels
    d = scale.amax(-1, keepdim=True) / 63               # the super-block's scale of the 6-bit scales
    dmin = (-low).amax(-1, keepdim=True) / 63
    ls = torch.where(d > 0, torch.round(scale / torch.where(d > 0, d, 1)), 0).clamp(0, 63)
    lm = torch.where(dmin > 0, torch.round(-low / torch.where(dmin > 0, dmin, 1)), 0).clamp(0, 63)
    d16, dmin16 = d.to(torch.float16), dmin.to(torch.float16)  # what a reader will multiply by
    if not (torch.isfinite(d16).all() and torch.isfinite(dmin16).all()):
        raise ValueError(f"{name}'s float16 super-block scales overflow: a 32-weight sub-block spans more than "
                         "about 6e7 (as in ggml)")
    step = d16.float() * ls                              # (..., nb, 8)
    offset = dmin16.float() * lm
    q = torch.where(step[..., None] > 0, torch.round((x + offset[..., None]) / torch.where(step > 0, step, 1)[..., None]),
                    0).clamp(0, levels).to(torch.uint8)  # (..., nb, 8, 32)
    return (d16.view(torch.uint8).reshape(*lead, nb, 2), dmin16.view(torch.uint8).reshape(*lead, nb, 2),
            _pack_scales_and_mins(ls, lm), q)


def quantize(weights: torch.Tensor) -> torch.Tensor:
    """(..., cols) float -> (..., cols / 256 * 144) uint8 (min-max scales; see the module's note)."""
    *lead, cols = weights.shape
    row_bytes(cols)
    nb = cols // BLOCK
    d, dmin, scales, q = min_max_codes(weights, 15, "Q4_K")
    pairs = q.reshape(*lead, nb, 4, 2, SUB)              # sub-blocks 2j (low nibbles) and 2j + 1 (high)
    out = torch.empty(*lead, nb, BLOCK_BYTES, dtype=torch.uint8, device=weights.device)
    out[..., 0:2], out[..., 2:4], out[..., 4:16] = d, dmin, scales
    out[..., 16:] = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*lead, nb, 128)
    return out.reshape(*lead, nb * BLOCK_BYTES)


def scales_and_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., nb, block bytes) of Q4_K or Q5_K (the same first 16 bytes) -> d * scale and dmin * min per
    sub-block (..., nb, 8), float32."""
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()        # (..., nb, 1)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    scale, mins = _scales_and_mins(blocks[..., 4:16])                     # (..., nb, 8)
    return d * scale, dmin * mins


def dequantize(data: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., cols / 256 * 144) uint8 -> (..., cols) in `dtype`."""
    return kquant_dequantize(data, cols, dtype, BLOCK_BYTES, "Q4_K", fifth_bit=False)


def kquant_dequantize(data: torch.Tensor, cols: int, dtype: torch.dtype, block_bytes: int, name: str,
                      fifth_bit: bool) -> torch.Tensor:
    """Q4_K, or with `fifth_bit` Q5_K (q5k.py: qh[32] before the quants, bit s of qh[l] above weight
    32 s + l's nibble): (..., cols / 256 * block_bytes) uint8 -> (..., cols) in `dtype`."""
    *lead, nbytes = data.shape
    if cols % BLOCK or nbytes != cols // BLOCK * block_bytes:
        raise ValueError(f"{nbytes} bytes per row is not {name} for {cols} weights")
    nb = cols // BLOCK
    blocks = data.reshape(*lead, nb, block_bytes)
    step, offset = scales_and_mins(blocks)                                # (..., nb, 8)
    qs = blocks[..., block_bytes - 128:].reshape(*lead, nb, 4, SUB)
    q = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(*lead, nb, 8, SUB).to(torch.int32)
    if fifth_bit:
        qh = blocks[..., 16:48].to(torch.int32)[..., None, :]            # (..., nb, 1, 32)
        q = q | (((qh >> torch.arange(8, device=data.device)[:, None]) & 1) << 4)
    w = step[..., None] * q.float() - offset[..., None]
    return w.reshape(*lead, cols).to(dtype)
