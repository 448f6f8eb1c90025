"""Q4_K GEMVs against int8 activations: four products an instruction (dp4a), as llama.cpp's MMVQ.

Why: the quantized slabs' Q4_K GEMVs (quantized_gemv.py, the `shared` form) turn every weight into an
fp32 and multiply in fp32. On the H200 they read 985 GB/s of quantized bytes, a fifth of HBM's, and
faster number conversions did not move them: the instructions per weight bound them. Here the
activations are first rounded, per 32 (a Q4_K sub-block), to int8 with one fp32 scale dx, and the sum
of each 32's rounded values is kept for the sub-block's minimum (as llama.cpp's q8_1 keeps it). A quant
word then holds four low nibbles (word & 0x0F0F0F0F) of sub-block 2j and four high nibbles of 2j + 1,
each four dotted with four int8 inputs in one `dp4a`, and each sub-block's integer sum is scaled once:

    sum_w (d sc_s q_w - dmin m_s) dx_s qx_w  =  d sc_s dx_s sum_w q_w qx_w  -  dmin m_s dx_s sum_w qx_w

which is the dequantized weights times the rounded inputs, exactly what the twin computes.

The int8 inputs cost accuracy (about 1e-2 of the outputs' scale, as llama.cpp's q8_1 inputs do), so this is
a load form of the quantized GEMVs' tuning (`dp4a`), which a device takes only where it measures faster.
Its twin is `dp4a_reference`: the same rounding of the inputs, the weights dequantized by the store.

In Triton's interpreter (no GPU) `dp4a` is the same sum of byte products in integer arithmetic (`ASM` off).
"""

from __future__ import annotations

from typing import Callable

import torch
from kernel_launch import cdiv, next_power_of_2

from .triton_support import tl, triton

Q8_BLOCK = 32            # inputs per int8 scale: a Q4_K sub-block
Q8_BLOCKS_PER_PROGRAM = 8


def q8_activations(x: torch.Tensor, use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, C) activations (C a multiple of 32) as int8 per 32 with a scale each: the int8 values
    (rows, C), the scales (rows, C / 32) fp32 (max |x| / 127 of the 32) and each 32's rounded sum (scale
    times the int8 values' sum). Rounded half away from zero; `use_kernel` off: the torch twin."""
    rows, cols = x.shape
    if cols % Q8_BLOCK:
        raise ValueError(f"{cols} activations a row: not whole blocks of {Q8_BLOCK}")
    if not use_kernel:
        blocks = x.float().reshape(rows, cols // Q8_BLOCK, Q8_BLOCK)
        amax = blocks.abs().amax(dim=-1)
        scaled = blocks * torch.where(amax > 0, 127.0 / amax.clamp(min=1e-30), 0.0)[..., None]
        q = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).clamp(-127, 127)
        return q.to(torch.int8).reshape(rows, cols), amax / 127.0, q.sum(dim=-1) * (amax / 127.0)
    q = torch.empty(rows, cols, dtype=torch.int8, device=x.device)
    scales = torch.empty(rows, cols // Q8_BLOCK, dtype=torch.float32, device=x.device)
    sums = torch.empty_like(scales)
    _q8_kernel[(rows, cdiv(cols // Q8_BLOCK, Q8_BLOCKS_PER_PROGRAM))](
        x.contiguous(), q, scales, sums, COLS=cols, BLOCKS=Q8_BLOCKS_PER_PROGRAM)
    return q, scales, sums


def gate_up_dp4a(x: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, pool: torch.Tensor, inter: int,
                 hidden: int, top_k: int, rows: int, warps: int, by_expert: bool) -> torch.Tensor:
    """(P, I) fp32 SiLU(gate) * up of each pair's token through its expert's Q4_K gate and up rows (slab
    `slots[p]` of `pool`, or with `by_expert` the slab `table[slots[p]]`), the token's inputs as int8."""
    q, scales, sums = q8_activations(x)
    pairs = slots.numel()
    h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    _gate_up_dp4a_kernel[(pairs, cdiv(inter, rows))](
        q.view(torch.int32), scales, sums, slots, table, h, pool, pool.shape[1], TOP_K=top_k, H=hidden, I=inter,
        BLOCK_ROWS=rows, SB_TILE=next_power_of_2(hidden // 256), BY_EXPERT=by_expert, ASM=x.is_cuda,
        num_warps=warps)
    return h


def down_dp4a(h: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, pool: torch.Tensor, part_bytes: int,
              inter: int, hidden: int, rows: int, warps: int, by_expert: bool) -> torch.Tensor:
    """(P, H) fp32: each pair's `h` (P, I) through its expert's Q4_K down rows (from `part_bytes` into its
    slab), `h` rounded to int8 per 32 first."""
    q, scales, sums = q8_activations(h)
    pairs = slots.numel()
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=h.device)
    _down_dp4a_kernel[(pairs, cdiv(hidden, rows))](
        q.view(torch.int32), scales, sums, slots, table, y, pool, pool.shape[1], part_bytes, H=hidden, I=inter,
        BLOCK_ROWS=rows, SB_TILE=next_power_of_2(inter // 256), BY_EXPERT=by_expert, ASM=h.is_cuda,
        num_warps=warps)
    return y


def dp4a_reference(x: torch.Tensor, ids: torch.Tensor, dequantize: Callable, top_k: int, act: Callable,
                   gate_up_int8: bool = True, down_int8: bool = True) -> torch.Tensor:
    """The kernels' twin: (P, H) fp32 outputs of pairs `ids` (experts; pair p is token p // top_k's), the
    weights from `dequantize(ids)` ((P, 2I, H), (P, H, I)), the inputs of each int8 GEMV rounded as the kernels
    round them (`q8_activations`) and computed in fp32."""
    def rounded(v: torch.Tensor, on: bool) -> torch.Tensor:
        if not on:
            return v.float()
        q, scales, _ = q8_activations(v, use_kernel=False)
        return (q.float().reshape(v.shape[0], -1, Q8_BLOCK) * scales[..., None]).reshape(v.shape)

    gate_up, down = dequantize(ids)
    x_pairs = rounded(x, gate_up_int8)[torch.arange(ids.numel()) // top_k]
    gate, up = torch.bmm(gate_up.float(), x_pairs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    h = act(gate) * up
    return torch.bmm(down.float(), rounded(h, down_int8).unsqueeze(-1)).squeeze(-1)


if tl is not None:
    from .block_decode import _pair_slab, _q4k_header

    @triton.jit
    def _dp4a(a, b, ASM: tl.constexpr):
        """Per element: the four bytes of `a` (unsigned) times the four of `b` (signed), summed (int32)."""
        if ASM:
            out = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, a * 0],
                                            dtype=tl.int32, is_pure=True, pack=1)
        else:  # the interpreter: the same products, each signed byte of b sign-extended by shifts
            out = (a & 0xFF) * ((b << 24) >> 24) + ((a >> 8) & 0xFF) * ((b << 16) >> 24) \
                + ((a >> 16) & 0xFF) * ((b << 8) >> 24) + ((a >> 24) & 0xFF) * (b >> 24)
        return out

    @triton.jit
    def _q8_kernel(x_ptr, q_ptr, scale_ptr, sum_ptr, COLS: tl.constexpr, BLOCKS: tl.constexpr):
        """q8_activations: program (row, BLOCKS blocks of 32)."""
        row = tl.program_id(0)
        block = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        lane = tl.arange(0, 32)
        ok = block < COLS // 32
        at = row * COLS + block[:, None] * 32 + lane[None, :]
        x = tl.load(x_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scaled = x * tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)[:, None]
        q = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(0.5 - scaled))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + at, q.to(tl.int8), mask=ok[:, None])
        tl.store(scale_ptr + row * (COLS // 32) + block, amax / 127.0, mask=ok)
        tl.store(sum_ptr + row * (COLS // 32) + block, tl.sum(q, axis=1) * (amax / 127.0), mask=ok)

    @triton.jit
    def _q4k_dp4a_rows(at, ok, q_row, scale_row, sum_row, SBS: tl.constexpr, SB_TILE: tl.constexpr,
                       R: tl.constexpr, ASM: tl.constexpr):
        """Whole Q4_K rows at `at` (R, 1) (SBS super-blocks each, SB_TILE >= SBS a power of two, the padding
        masked) dotted with SBS * 256 int8 inputs (`q_row`: their 32-bit words; `scale_row`, `sum_row`: each
        32's scale and rounded sum): (R,) floats. Word w of a super-block's quants (group j = w // 8) holds inputs
        4 (w % 8) .. + 3 of sub-block 2j in its low nibbles and of 2j + 1 in its high ones: input words
        64 sb + 16 j + w % 8 and 8 further."""
        sb = tl.arange(0, SB_TILE)
        w = tl.arange(0, 32)
        k = tl.arange(0, 4)
        mask = ok[:, :, None] & (sb < SBS)[None, :, None]                                # (R, SB_TILE, 1)
        blocks = (at[:, :, None] + (sb * 144)[None, :, None]).to(tl.pointer_type(tl.int32), bitcast=True)
        head = tl.load(blocks + k[None, None, :], mask=mask, other=0)                   # (R, SB_TILE, 4)
        quants = tl.load(blocks + 4 + w[None, None, :], mask=mask, other=0)            # (R, SB_TILE, 32)
        d, dmin, scale_even, min_even, scale_odd, min_odd = _q4k_header(head, k)
        sb_in = tl.minimum(sb, SBS - 1)  # the padding reads real inputs (its weights are 0)
        # (SB_TILE, 4, 8): runs of 8 words (32 bytes) a group, so they load as 16-byte vectors
        x_at = q_row + (sb_in * 64)[:, None, None] + (16 * k)[None, :, None] + tl.arange(0, 8)[None, None, :]
        # broadcast to the quants' shape: the inline asm takes its operands in one shape
        x_low = tl.reshape(tl.load(x_at), SB_TILE, 32)[None, :, :] + quants * 0          # (R, SB_TILE, 32)
        x_high = tl.reshape(tl.load(x_at + 8), SB_TILE, 32)[None, :, :] + quants * 0
        dot_low = tl.sum(tl.reshape(_dp4a(quants & 0x0F0F0F0F, x_low, ASM), R, SB_TILE, 4, 8), axis=3)
        dot_high = tl.sum(tl.reshape(_dp4a((quants >> 4) & 0x0F0F0F0F, x_high, ASM), R, SB_TILE, 4, 8), axis=3)
        sub = (sb_in * 8)[:, None] + 2 * k[None, :]                                     # (SB_TILE, 4): 2j
        dx_even = tl.load(scale_row + sub)[None, :, :]
        dx_odd = tl.load(scale_row + sub + 1)[None, :, :]
        sx_even = tl.load(sum_row + sub)[None, :, :]
        sx_odd = tl.load(sum_row + sub + 1)[None, :, :]
        scaled = tl.sum(scale_even * dx_even * dot_low.to(tl.float32) + scale_odd * dx_odd * dot_high.to(tl.float32),
                        axis=2)
        offsets = tl.sum(min_even * sx_even + min_odd * sx_odd, axis=2)
        return tl.sum(d * scaled - dmin * offsets, axis=1)

    @triton.jit
    def _gate_up_dp4a_kernel(q_ptr, scale_ptr, sum_ptr, slots_ptr, table_ptr, h_ptr, pool_ptr, slab_bytes,
                             TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                             SB_TILE: tl.constexpr, BY_EXPERT: tl.constexpr, ASM: tl.constexpr):
        """gate_up_dp4a: program (pair, BLOCK_ROWS rows of gate and of up)."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        slot = _pair_slab(slots_ptr, table_ptr, pair, BY_EXPERT)
        ok = ((rows < I) & (slot >= 0))[:, None]
        ROW_BYTES: tl.constexpr = H // 256 * 144
        at = pool_ptr + tl.maximum(slot, 0) * slab_bytes + rows[:, None].to(tl.int64) * ROW_BYTES
        token = pair // TOP_K
        inputs = (q_ptr + token * (H // 4), scale_ptr + token * (H // 32), sum_ptr + token * (H // 32))
        gate = _q4k_dp4a_rows(at, ok, *inputs, H // 256, SB_TILE, BLOCK_ROWS, ASM)
        up = _q4k_dp4a_rows(at + I * ROW_BYTES, ok, *inputs, H // 256, SB_TILE, BLOCK_ROWS, ASM)
        tl.store(h_ptr + pair * I + rows, gate / (1.0 + tl.exp(-gate)) * up, mask=rows < I)

    @triton.jit
    def _down_dp4a_kernel(q_ptr, scale_ptr, sum_ptr, slots_ptr, table_ptr, y_ptr, pool_ptr, slab_bytes, part_bytes,
                          H: tl.constexpr, I: tl.constexpr, BLOCK_ROWS: tl.constexpr, SB_TILE: tl.constexpr,
                          BY_EXPERT: tl.constexpr, ASM: tl.constexpr):
        """down_dp4a: program (pair, BLOCK_ROWS output rows)."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        slot = _pair_slab(slots_ptr, table_ptr, pair, BY_EXPERT)
        ok = ((rows < H) & (slot >= 0))[:, None]
        ROW_BYTES: tl.constexpr = I // 256 * 144
        at = pool_ptr + tl.maximum(slot, 0) * slab_bytes + part_bytes + rows[:, None].to(tl.int64) * ROW_BYTES
        y = _q4k_dp4a_rows(at, ok, q_ptr + pair * (I // 4), scale_ptr + pair * (I // 32), sum_ptr + pair * (I // 32),
                           I // 256, SB_TILE, BLOCK_ROWS, ASM)
        tl.store(y_ptr + pair * H + rows, y, mask=rows < H)

