"""The decode step's experts on quantized slabs: the GEMVs of bf16_gemv.py, each pair's weights
decoded from its slab's blocks as they are read.

Shapes: P pairs, H hidden, I intermediate; H and I multiples of 256. Quantized slabs hold the
store's blocks as they are (misses were staged into their slabs first: block_staging.py). A program
dots its rows' 256-weight super-blocks (or runs of eight 32-weight blocks) with the 256 matching
inputs, in fp32; `_dot` picks the format's decode:

    Q8_0, Q4_0   `_q8_dot`          eight 32-weight blocks, one scale each
    Q4_K, Q5_K   `_kquant_dot`      sub-blocks summed against their inputs first, scaled once
    Q4_K         `_q4k_words_dot`   the same, the quant bytes read as 32-bit words
    Q6_K         block_decode's `_q6k_weights`, weight by weight

How a program walks its rows' super-blocks (`_rows_dots`, LOAD_FORMS):
    loop       one super-block of every row a step: few loads in flight per program
    unrolled   the same steps unrolled, so the compiler may issue every step's loads up front
    tile       every super-block of the rows as one tile (rows x super-blocks flattened), decoded at once
    shared     Q4_K only (`_q4k_shared_rows`): the rows' super-blocks as one (rows, super-blocks, words)
               tile, the inputs loaded once for every row (the tile form loads them per row)
    dp4a       Q4_K only: the shared tile against inputs rounded to int8 per 32, four nibbles times four
               inputs an instruction (q4k_dp4a.py; about 1e-2 of the outputs' scale less accurate)

The pool comes in as a pointer (a tensor), not an integer address: Triton then knows it is 16-byte
aligned (and a launch specializes the slab bytes as a multiple of 16), so it reads blocks in 16-byte
loads; from an address cast to a pointer it read them one word or byte at a time.

The rows per program, warps and load form are tuned per format and device (tuning.py, key
quantized_gemv), and whether Q4_K reads words (q4_k_word_loads).
"""

from __future__ import annotations

import torch
from kernel_launch import cdiv, next_power_of_2

from . import q4k_dp4a, triton_support, tuning
from .block_decode import TILE_BYTES
from .triton_support import tl, triton

# each format's code path in `_dot` (Q4_K read by words is 44: `_kind`)
TILE_KINDS = {"q8_0": 8, "q4_0": 40, "q4_k": 4, "q5_k": 5, "q6_k": 6}
# how a program walks its rows' super-blocks (the kernels' LOADS; the third value of a quantized_gemv tuning);
# `dp4a` (Q4_K only) is q4k_dp4a.py's kernels: int8 inputs, four products an instruction
LOAD_FORMS = {"loop": 0, "unrolled": 1, "tile": 2, "shared": 3, "dp4a": 4}
Q4_K_ONLY = ("shared", "dp4a")

if tl is not None:
    from .block_decode import _nibble_float, _pair_slab, _q4k_header, _q6k_weights, _scales_mins

    @triton.jit
    def _kquant_dot(at, xs, ok, FIFTH_BIT: tl.constexpr):
        """Q4_K (or, with FIFTH_BIT, Q5_K) super-blocks at `at` (R, 1) dotted with the 256 values at `xs`
        (1, 1) or (R, 1): (R,) floats. Sub-blocks 2j and 2j + 1 share the 32 quant bytes 32j.. (low and high nibbles), so
        each is summed against its 32 inputs first and scaled once (d * scale, dmin * min times the
        inputs' sum): whole bytes loaded, no per-weight scale."""
        j = tl.arange(0, 4)
        lane = tl.arange(0, 32)
        x_even = tl.load(xs[:, :, None] + ((2 * j)[:, None] * 32 + lane[None, :])[None, :, :]).to(tl.float32)
        x_odd = tl.load(xs[:, :, None] + ((2 * j + 1)[:, None] * 32 + lane[None, :])[None, :, :]).to(tl.float32)
        # (1 or R, 4, 32): sub-blocks 0, 2, .. and 1, 3, ..
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        d = tl.load(at.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)      # (R, 1)
        dmin = tl.load((at + 2).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        scale_even, min_even = _scales_mins(at8, 2 * j, ok)                              # (R, 4)
        scale_odd, min_odd = _scales_mins(at8, 2 * j + 1, ok)
        QS: tl.constexpr = 48 if FIFTH_BIT else 16                                        # Q5_K's qh[32] come first
        quants = tl.load(at8[:, :, None] + QS + (j[:, None] * 32 + lane[None, :])[None, :, :], mask=ok[:, :, None],
                         other=0).to(tl.int32)                                            # (R, 4, 32)
        low, high = quants & 0xF, quants >> 4
        if FIFTH_BIT:  # bit s of qh[lane] is sub-block s's fifth bit
            qh = tl.load(at8[:, :, None] + 16 + lane[None, None, :], mask=ok[:, :, None], other=0).to(tl.int32)
            low = low | (((qh >> (2 * j)[None, :, None]) & 1) << 4)
            high = high | (((qh >> (2 * j + 1)[None, :, None]) & 1) << 4)
        dot_even = tl.sum(low.to(tl.float32) * x_even, axis=2)                           # (R, 4)
        dot_odd = tl.sum(high.to(tl.float32) * x_odd, axis=2)
        sum_even, sum_odd = tl.sum(x_even, axis=2), tl.sum(x_odd, axis=2)                 # (1 or R, 4)
        terms = d * (scale_even * dot_even + scale_odd * dot_odd) - dmin * (min_even * sum_even + min_odd * sum_odd)
        return tl.sum(terms, axis=1)

    @triton.jit
    def _q4k_words_dot(at, xs, ok):
        """`_kquant_dot` for Q4_K with the 128 quant bytes read as 32-bit words (a quarter of the loads:
        the super-blocks are 144 bytes, so rows of them keep 4-byte alignment): byte b of word w of
        group j holds weight 4w + b of sub-block 2j (low nibble) and 2j + 1 (high nibble)."""
        j = tl.arange(0, 4)
        w = tl.arange(0, 8)
        b = tl.arange(0, 4)
        lanes = (4 * w[:, None] + b[None, :])[None, :, :]                                # (1, 8, 4)
        x_even = tl.load(xs[:, :, None, None] + ((2 * j)[:, None, None] * 32 + lanes)[None]).to(tl.float32)
        x_odd = tl.load(xs[:, :, None, None] + ((2 * j + 1)[:, None, None] * 32 + lanes)[None]).to(tl.float32)
        # (1 or R, 4, 8, 4)
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        d = tl.load(at.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)      # (R, 1)
        dmin = tl.load((at + 2).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        scale_even, min_even = _scales_mins(at8, 2 * j, ok)                              # (R, 4)
        scale_odd, min_odd = _scales_mins(at8, 2 * j + 1, ok)
        words = tl.load((at + 16).to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]
                        + (j[:, None] * 8 + w[None, :])[None, :, :], mask=ok[:, :, None], other=0)  # (R, 4, 8)
        shifted = words[:, :, :, None] >> (8 * b)[None, None, None, :]                  # (R, 4, 8, 4)
        low = _nibble_float(shifted)
        high = _nibble_float(shifted >> 4)
        dot_even = tl.sum(tl.sum(low * x_even, axis=3), axis=2)                          # (R, 4)
        dot_odd = tl.sum(tl.sum(high * x_odd, axis=3), axis=2)
        sum_even = tl.sum(tl.sum(x_even, axis=3), axis=2)                                # (1 or R, 4)
        sum_odd = tl.sum(tl.sum(x_odd, axis=3), axis=2)
        terms = d * (scale_even * dot_even + scale_odd * dot_odd) - dmin * (min_even * sum_even + min_odd * sum_odd)
        return tl.sum(terms, axis=1)

    @triton.jit
    def _q4k_shared_rows(at, x_row, ok, up_bytes, R: tl.constexpr, SBS: tl.constexpr, SB_TILE: tl.constexpr,
                         UP: tl.constexpr):
        """Whole Q4_K rows at `at` (R, 1) (each row's first super-block; SBS of them, SB_TILE a power of two
        >= SBS, the padding masked) dotted with the SBS * 256 inputs at `x_row`, and with UP the rows
        `up_bytes` further: two (R,) floats. Every row's super-blocks are one (R, SB_TILE, ...) tile read in
        16-byte loads (the header's 4 words: d and dmin, 12 scale bytes; the 32 quant words), and the
        inputs are loaded once for all the program's rows: word w of group j = w // 8 holds weights
        4 (w % 8) + b of sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)."""
        sb = tl.arange(0, SB_TILE)
        w = tl.arange(0, 32)
        b = tl.arange(0, 4)
        k = tl.arange(0, 4)  # the header's words; the groups j of sub-blocks
        sb_ok = sb < SBS
        # the inputs, (1, SB_TILE, 32, 4): low nibbles' and high nibbles' (32 further)
        x_at = x_row + (tl.minimum(sb, SBS - 1) * 256)[None, :, None, None] \
            + ((w // 8) * 64 + (w % 8) * 4)[None, None, :, None] + b[None, None, None, :]
        x_low = tl.load(x_at).to(tl.float32)
        x_high = tl.load(x_at + 32).to(tl.float32)
        # each sub-block's input sum, (1, SB_TILE, 4) per group j: sub-blocks 2j and 2j + 1
        sum_low = tl.sum(tl.reshape(tl.sum(x_low, axis=3), 1, SB_TILE, 4, 8), axis=3)
        sum_high = tl.sum(tl.reshape(tl.sum(x_high, axis=3), 1, SB_TILE, 4, 8), axis=3)
        mask = ok[:, :, None] & sb_ok[None, :, None]                                     # (R, SB_TILE, 1)
        blocks = (at[:, :, None] + (sb * 144)[None, :, None]).to(tl.pointer_type(tl.int32), bitcast=True)
        first = _q4k_shared_part(blocks, mask, x_low, x_high, sum_low, sum_high, w, k, R, SB_TILE)
        second = first * 0.0
        if UP:
            up = (at[:, :, None] + up_bytes + (sb * 144)[None, :, None]).to(tl.pointer_type(tl.int32), bitcast=True)
            second = _q4k_shared_part(up, mask, x_low, x_high, sum_low, sum_high, w, k, R, SB_TILE)
        return first, second

    @triton.jit
    def _q4k_shared_part(words_at, mask, x_low, x_high, sum_low, sum_high, w, k, R: tl.constexpr,
                         S: tl.constexpr):
        """`_q4k_shared_rows` for one matrix: `words_at` (R, S, 1) int32 pointers to the super-blocks."""
        head = tl.load(words_at + k[None, None, :], mask=mask, other=0)                # (R, SB_TILE, 4) words
        quants = tl.load(words_at + 4 + w[None, None, :], mask=mask, other=0)         # (R, SB_TILE, 32)
        d, dmin, scale_even, min_even, scale_odd, min_odd = _q4k_header(head, k)
        shifted = quants[:, :, :, None] >> (8 * k)[None, None, None, :]                  # (R, SB_TILE, 32, 4)
        low = _nibble_float(shifted)
        high = _nibble_float(shifted >> 4)
        dot_low = tl.sum(tl.reshape(tl.sum(low * x_low, axis=3), R, S, 4, 8), axis=3)   # (R, SB_TILE, 4)
        dot_high = tl.sum(tl.reshape(tl.sum(high * x_high, axis=3), R, S, 4, 8), axis=3)
        scaled = tl.sum(scale_even * dot_low + scale_odd * dot_high, axis=2)
        offsets = tl.sum(min_even * sum_low + min_odd * sum_high, axis=2)
        return tl.sum(d * scaled - dmin * offsets, axis=1)

    @triton.jit
    def _q8_dot(at, xs, ok, Q4: tl.constexpr):
        """Eight Q8_0 blocks (34 bytes: an fp16 scale, 32 int8) or, with Q4, Q4_0 blocks (18: the scale, 16
        bytes of nibbles, weight l the low nibble of byte l < 16, else the high nibble of byte l - 16,
        minus 8) at `at` (R, 1) dotted with the 256 values at `xs` (1, 1) or (R, 1): (R,) floats, one
        scale per block."""
        QB: tl.constexpr = 18 if Q4 else 34
        blocks = tl.arange(0, 8)
        lane = tl.arange(0, 32)
        x = tl.load(xs[:, :, None] + (blocks[:, None] * 32 + lane[None, :])[None, :, :]).to(tl.float32)  # (1|R, 8, 32)
        first = at + (blocks * QB)[None, :]                                              # (R, 8)
        scale = tl.load(first.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        if Q4:
            packed = tl.load((first[:, :, None] + 2 + (lane % 16)[None, None, :]).to(tl.pointer_type(tl.uint8),
                                                                                      bitcast=True),
                             mask=ok[:, :, None], other=0).to(tl.int32)
            q = ((packed >> (4 * (lane // 16))[None, None, :]) & 0xF) - 8
        else:
            q = tl.load((first[:, :, None] + 2 + lane[None, None, :]).to(tl.pointer_type(tl.int8), bitcast=True),
                        mask=ok[:, :, None], other=0).to(tl.int32)
        return tl.sum(scale * tl.sum(q.to(tl.float32) * x, axis=2), axis=1)

    @triton.jit
    def _dot(at, xs, ok, KIND: tl.constexpr):
        """256 weights per row, from the blocks at `at` (R, 1) in the format `KIND` (TILE_KINDS), dotted
        with the 256 values at `xs`, a pointer tile: (1, 1) (every row the same inputs) or (R, 1) (each
        row its own): (R,) floats."""
        if KIND == 6:  # Q6_K (a Q4_K_M file's down experts in some layers): decoded weight by weight
            w = tl.arange(0, 256)
            x = tl.load(xs + w[None, :]).to(tl.float32)                                  # (1 or R, 256)
            result = tl.sum(_q6k_weights(at, at.to(tl.pointer_type(tl.uint8), bitcast=True), w, ok) * x, axis=1)
        elif KIND == 8 or KIND == 40:
            result = _q8_dot(at, xs, ok, KIND == 40)
        elif KIND == 44:
            result = _q4k_words_dot(at, xs, ok)
        else:
            result = _kquant_dot(at, xs, ok, KIND == 5)
        return result

    @triton.jit
    def _step(first, second, at, up_bytes, xs, ok, KIND: tl.constexpr, UP: tl.constexpr):
        """One step of the loop forms: a super-block of every row at `at` (R, 1) (and, with UP, of the
        row `up_bytes` further) dotted with the 256 inputs at `xs` (1, 1), added to the running dots."""
        first += _dot(at, xs, ok, KIND)
        if UP:
            second += _dot(at + up_bytes, xs, ok, KIND)
        return first, second

    @triton.jit
    def _rows_dots(base, row0, n_rows, slot_ok, x_row, up_bytes, SBS: tl.constexpr, KIND: tl.constexpr,
                   SB_BYTES: tl.constexpr, LOADS: tl.constexpr, SB_TILE: tl.constexpr, UP: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr):
        """Rows row0 .. row0 + BLOCK_ROWS (those < n_rows; none unless slot_ok) of the matrix at byte
        address `base`, SBS super-blocks of SB_BYTES a row, dotted with the SBS * 256 inputs at `x_row`,
        and with UP the rows `up_bytes` further (the up rows) too: two (BLOCK_ROWS,) floats, the second
        zero without UP. LOADS (LOAD_FORMS): 0 a loop over the super-blocks, 1 the loop unrolled, 2 all
        (rows x SB_TILE super-blocks, SBS rounded up to a power of two, the padding masked) as one tile:
        the loop's step waits on its loads, so a program has one step's bytes in flight at a time; 3
        (Q4_K) the tile with the inputs shared by the rows."""
        ROW_BYTES: tl.constexpr = SBS * SB_BYTES
        first = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        second = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        if LOADS == 3:  # Q4_K only: the rows' super-blocks as one tile, the inputs loaded once for every row
            tl.static_assert(KIND == 4 or KIND == 44, "the shared form reads Q4_K only")
            rows = row0 + tl.arange(0, BLOCK_ROWS)
            ok = ((rows < n_rows) & slot_ok)[:, None]
            first, second = _q4k_shared_rows(base + rows[:, None].to(tl.int64) * ROW_BYTES, x_row, ok, up_bytes,
                                             BLOCK_ROWS, SBS, SB_TILE, UP)
        elif LOADS == 2:  # virtual row v: row v // SB_TILE's super-block v % SB_TILE, with its own inputs
            v = tl.arange(0, BLOCK_ROWS * SB_TILE)
            rows, sb = row0 + v // SB_TILE, v % SB_TILE
            ok = ((rows < n_rows) & (sb < SBS) & slot_ok)[:, None]
            at = base + (rows.to(tl.int64) * ROW_BYTES + sb * SB_BYTES)[:, None]
            xs = x_row + (tl.minimum(sb, SBS - 1) * 256)[:, None]  # the padding reads real inputs (its weights are 0)
            first = tl.sum(tl.reshape(_dot(at, xs, ok, KIND), BLOCK_ROWS, SB_TILE), axis=1)
            if UP:
                second = tl.sum(tl.reshape(_dot(at + up_bytes, xs, ok, KIND), BLOCK_ROWS, SB_TILE), axis=1)
        else:
            rows = row0 + tl.arange(0, BLOCK_ROWS)
            ok = ((rows < n_rows) & slot_ok)[:, None]
            at = base + rows[:, None].to(tl.int64) * ROW_BYTES
            xs = x_row + tl.zeros([1, 1], dtype=tl.int32)
            if LOADS == 1:
                for sb in tl.static_range(SBS):
                    first, second = _step(first, second, at + sb * SB_BYTES, up_bytes, xs + sb * 256, ok, KIND, UP)
            else:
                for sb in range(0, SBS):
                    first, second = _step(first, second, at + sb * SB_BYTES, up_bytes, xs + sb * 256, ok, KIND, UP)
        return first, second

    @triton.jit
    def _gate_up_q_kernel(x_ptr, slots_ptr, table_ptr, h_ptr, pool_ptr, slab_bytes, TOP_K: tl.constexpr,
                          H: tl.constexpr, I: tl.constexpr, KIND: tl.constexpr, SB_BYTES: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, LOADS: tl.constexpr, SB_TILE: tl.constexpr,
                          BY_EXPERT: tl.constexpr):
        """`_gate_up_kernel` for quantized slabs: each pair's weights decoded from its slab's blocks as
        they are read (every pair reads a slab: misses were staged into theirs)."""
        pair = tl.program_id(0)
        row0 = tl.program_id(1) * BLOCK_ROWS
        slot = _pair_slab(slots_ptr, table_ptr, pair, BY_EXPERT)
        base = pool_ptr + tl.maximum(slot, 0) * slab_bytes
        gate, up = _rows_dots(base, row0, I, slot >= 0, x_ptr + pair // TOP_K * H, I * (H // 256) * SB_BYTES,
                              H // 256, KIND, SB_BYTES, LOADS, SB_TILE, True, BLOCK_ROWS)
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + pair * I + rows, h, mask=rows < I)

    @triton.jit
    def _down_q_kernel(h_ptr, slots_ptr, table_ptr, y_ptr, pool_ptr, slab_bytes, part_bytes, H: tl.constexpr,
                       I: tl.constexpr, KIND: tl.constexpr, SB_BYTES: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                       LOADS: tl.constexpr, SB_TILE: tl.constexpr, BY_EXPERT: tl.constexpr):
        """`_down_kernel` for quantized slabs (the down part starts `part_bytes` into the slab)."""
        pair = tl.program_id(0)
        row0 = tl.program_id(1) * BLOCK_ROWS
        slot = _pair_slab(slots_ptr, table_ptr, pair, BY_EXPERT)
        base = pool_ptr + tl.maximum(slot, 0) * slab_bytes + part_bytes
        acc, _ = _rows_dots(base, row0, H, slot >= 0, h_ptr + pair * I, 0, I // 256, KIND, SB_BYTES, LOADS, SB_TILE,
                            False, BLOCK_ROWS)
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        tl.store(y_ptr + pair * H + rows, acc, mask=rows < H)


def available(dtype: torch.dtype) -> bool:
    """Whether the quantized GEMVs run for activations of `dtype` (Triton present)."""
    return triton_support.available(dtype)


def quantized_experts(x: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, fmt: str, down_fmt: str, inter: int,
                      hidden: int, top_k: int, config: tuple | None = None,
                      table_row: torch.Tensor | None = None) -> torch.Tensor:
    """(P, H) fp32 expert outputs, unweighted, each pair's weights decoded from its quantized slab (a row
    of `pool`, uint8 (S, slab bytes): gate and up rows, then down rows, in `fmt` / `down_fmt` blocks;
    every slot >= 0). H and I must be multiples of 256 (whole 256-weight tiles in every format).
    `table_row` (int64, one slab per expert): `slots` are the pairs' experts, their slabs read from it
    inside the kernels. `config` (rows per program, warps[, load form: LOAD_FORMS, default "loop"];
    default: the device's tuned one per format) is for the tuning benchmark."""
    tuned = tuning.get("quantized_gemv", x.device)
    rows_up, warps_up, loads_up = _launch(config or tuned[fmt], fmt)
    rows_down, warps_down, loads_down = _launch(config or tuned[down_fmt], down_fmt)
    pairs = slots.numel()
    part_bytes = 2 * inter * (hidden // 256) * TILE_BYTES[fmt]
    by_expert = table_row is not None
    table = table_row if by_expert else slots
    if loads_up == LOAD_FORMS["dp4a"]:
        h = q4k_dp4a.gate_up_dp4a(x, slots, table, pool, inter, hidden, top_k, rows_up, warps_up, by_expert)
    else:
        h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
        _gate_up_q_kernel[(pairs, cdiv(inter, rows_up))](
            x.contiguous(), slots, table, h, pool, pool.shape[1], TOP_K=top_k, H=hidden, I=inter,
            KIND=_kind(fmt, x.device), SB_BYTES=TILE_BYTES[fmt], BLOCK_ROWS=rows_up, LOADS=loads_up,
            SB_TILE=next_power_of_2(hidden // 256), BY_EXPERT=by_expert, num_warps=warps_up)
    if loads_down == LOAD_FORMS["dp4a"]:
        return q4k_dp4a.down_dp4a(h, slots, table, pool, part_bytes, inter, hidden, rows_down, warps_down, by_expert)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _down_q_kernel[(pairs, cdiv(hidden, rows_down))](
        h, slots, table, y, pool, pool.shape[1], part_bytes, H=hidden, I=inter,
        KIND=_kind(down_fmt, x.device), SB_BYTES=TILE_BYTES[down_fmt], BLOCK_ROWS=rows_down, LOADS=loads_down,
        SB_TILE=next_power_of_2(inter // 256), BY_EXPERT=by_expert, num_warps=warps_down)
    return y


def form_reads(config: tuple, fmt: str) -> bool:
    """Whether a quantized_gemv tuning's load form reads `fmt` (the shared and dp4a forms read Q4_K only)."""
    return (*config, "loop")[2] not in Q4_K_ONLY or fmt == "q4_k"


def _launch(config: tuple, fmt: str) -> tuple[int, int, int]:
    """(rows per program, warps, LOADS) of a quantized_gemv tuning for `fmt`: (rows, warps[, load form])."""
    if not form_reads(config, fmt):
        raise ValueError(f"quantized_gemv's {config[2]} load form reads Q4_K only, not {fmt} (config {config})")
    rows, warps, form = (*config, "loop")[:3]
    return rows, warps, LOAD_FORMS[form]


def _kind(fmt: str, device: torch.device) -> int:
    """The GEMVs' code path for a format: Q4_K by 32-bit words where the device's tuning says so."""
    return 44 if fmt == "q4_k" and tuning.get("q4_k_word_loads", device) else TILE_KINDS[fmt]
