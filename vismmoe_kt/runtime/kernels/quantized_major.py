"""A batched decode step's experts on quantized slabs, expert by expert, on tensor cores.

Shapes: T tokens (the step's rows), K experts per token, P = T x K pairs, H hidden, I expert
intermediate size, M = BLOCK_M pairs per block, N = BLOCK_N output rows per program.

Quantized slabs (slab_format quantized) hold the store's blocks as they are. One token's experts
are GEMVs that decode each pair's weights as they read them (quantized_gemv.py). Run
token by token, a step of T tokens decodes T x K experts' blocks, although 8 requests route to
only about 50 distinct experts of a layer's 64 pairs. The decoding, not the bytes, bounds those
GEMVs: an H200 decodes Q4_K at about 400 GB/s of quantized bytes that way.

Here the step's pairs are looked up together, and each routed expert's weights are decoded once per
block of its tokens and multiplied with the block on tensor cores (`tl.dot`), as expert_major.py
does for resident banks, with the same block plan:

    gate_up:  h[p] = silu(W_gate[e] @ x[t_p]) * (W_up[e] @ x[t_p])   grid (blocks, I / N), H / 256 steps
    down:     y[p] = W_down[e] @ h[p]                                  grid (blocks, H / N), I / 256 steps

Each step of a program decodes an (N, 256) tile: per row, one k-quant super-block or eight 32-weight
blocks. The decoded weights are rounded to the activations' dtype for the tensor cores (BF16 on
the GPU), as a dequantized bank would hold them. Q4_K and Q4_0 pack two weights per byte; the tile
keeps them in the order they come out of the bytes (each byte's low and high nibble side by side),
so nothing is shuffled in registers; the token rows come in that same column order (`in_tile_order`,
one gather a layer before the first kernel, and the first kernel stores h in the down format's), so a
block's rows are read in contiguous 16-byte runs rather than element by element.

A block reads its expert at its first pair: the slab holding it, or for a miss the landing slab its
block was staged into, or without one that pair's staging row (`stage_misses` copies each miss's
block first, in one launch). Every pair of one expert reads the same bytes wherever they lie. No atomics; each output row is written
by one program per tile, and the caller combines each token's K rows in a fixed order.

Q4_K may decode a quarter super-block a step instead, with the token rows first (the weights the product's
second operand, through shared memory) or the weights first (`_gate_up_q_rows`, `_down_q_rows`: the product's
first operand, which Hopper's tensor cores read from registers): `tile_form`.

`experts_by_pair_blocks` is the torch twin (the CPU tests): the same plan, weights dequantized by
the store's codecs. The tiles are tuned per device (tuning.py, keys quantized_major and quantized_prefill;
`format_form` adjusts them per format).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from kernel_launch import cdiv, launch

from . import expert_major, tuning
from .block_decode import TILE_BYTES
from .block_staging import STAGE_CHUNK
from .expert_major import BLOCK_M, block_plan, expert_blocks, experts_by_block
from .triton_support import tl, triton

# each format's tile code in the kernels (`_tile`; Q4_K's quant bytes read as 32-bit words)
TILE_KINDS = {"q8_0": 8, "q4_0": 40, "q4_k": 44, "q5_k": 5, "q6_k": 6}

def stage_misses(ids: torch.Tensor, slots: torch.Tensor, land: torch.Tensor, pool: torch.Tensor, staging: torch.Tensor,
                 host_address: int, block_bytes: int) -> None:
    """Each missing pair's block (slot < 0), at `host_address` + expert * block_bytes in mapped host
    memory, copied as it is into its landing slab of `pool`, or, where it claimed none (land < 0), into
    its row of `staging`: one launch, contiguous 4-byte words (PCIe moves each block's bytes once)."""
    if block_bytes % 4 or pool.shape[1] % 4 or staging.shape[1] % 4:
        raise ValueError(f"blocks of {block_bytes} bytes into rows of {pool.shape[1]} / {staging.shape[1]}: "
                         "not whole 4-byte words")
    words = block_bytes // 4
    _stage_kernel[(ids.numel(), cdiv(words, STAGE_CHUNK))](
        ids, slots, land, pool.view(torch.int32), staging.view(torch.int32), host_address, words, pool.shape[1] // 4,
        staging.shape[1] // 4, CHUNK=STAGE_CHUNK)


IN_ORDER = 0  # a kernel's `_tile_position` code for columns in order


PIECES = (256, 64)  # input columns a kernel step decodes per row: a super-block, or (Q4_K) a quarter of one
# which operand of the tensor cores' product comes first (see tile_form); "weights-ahead": the weights first, each
# step asking the cache for the next step's bytes
ORDERS = ("tokens", "weights", "weights-ahead")
WEIGHTS_FIRST = ("weights", "weights-ahead")


def tile_form(tiles: tuple[int | str, ...]) -> tuple[int, int, int, int, str]:
    """(BLOCK_N, warps, stages, piece, order) of a tuned tile: three values, four with the piece (default 256),
    five with the order (default "tokens"). A Q4_K step of 64 columns holds a quarter of a whole super-block's
    decoded weights in registers, which leaves room for more rows and pipeline stages; the other formats always
    decode whole super-blocks. Order "tokens" multiplies the block's token rows by the decoded weights (the
    weights, the product's second operand, go through shared memory on their way to the tensor cores);
    "weights" (Q4_K quarter steps only) multiplies the decoded weights by the token rows, so the weights are
    the first operand, which Hopper's tensor cores read from registers: Triton then decodes each weight where
    the product reads it and only the quant bytes pass through shared memory (`_gate_up_q_rows`). That holds
    with one pipeline stage; with more, Triton's pipeliner routes the decoded weights through shared memory
    again. "weights-ahead" is "weights" with each step prefetching the next step's quant bytes, super-block
    constants and token rows into L1 (`_ask_l1`): the one-stage kernels otherwise wait on every step's loads (on an
    H100, ncu: long-scoreboard stalls half of gate_up's cycles at 236 tokens, with 3 warps a scheduler), and a
    prefetch returns no value, so the decoded weights keep their registers (a loaded value carried to the next
    step did not: 233 registers, the weights stored to shared memory)."""
    n, warps, stages, *rest = tiles
    piece = rest[0] if rest else 256
    order = rest[1] if len(rest) > 1 else "tokens"
    if piece not in PIECES:
        raise ValueError(f"a tile's piece of {piece} columns: the kernels decode {' or '.join(map(str, PIECES))}")
    if order not in ORDERS:
        raise ValueError(f"a tile's order {order!r}: one of {', '.join(ORDERS)}")
    if order in WEIGHTS_FIRST and piece != 64:
        raise ValueError(f"a tile with the weights first decodes a quarter super-block a step (piece 64), not {piece}")
    return n, warps, stages, piece, order


def quarter_steps(fmt: str, form: tuple[int, int, int, int, str]) -> bool:
    """Whether a kernel of this tile form decodes `fmt` a quarter super-block a step (reading its rows in order)."""
    return fmt == "q4_k" and form[3] == 64


# Q5_K and Q6_K decode a whole super-block with more live values a weight than Q4_K: beyond these rows a program
# (8 warps) ptxas spills (sm_90, Triton 3.6: Q6_K down at the prompt's (128, 4, 1) 8601 local loads and stores, at a
# batched step's (64, 2, 1) 6827, at (64, 8, 1) none; gate_up, two tiles a step, at (64, 8, 1) 286, at (32, 8, 1) none)
WIDE_DECODE_ROWS = {"gate_up": 32, "down": 64}
WIDE_DECODE_WARPS = 8


def format_form(fmt: str, part: str, form: tuple[int, int, int, int, str]) -> tuple[int, int, int, int, str]:
    """The form a kernel for `fmt` runs (`part` "gate_up" or "down"). A weights-first tile was tuned for Q4_K's
    quarter steps, and says nothing of another format's whole super-blocks (128 rows of them spill a thread's
    registers): those take the default entry's prompt tiles instead (tuning.json's "default" quantized_prefill).
    Q5_K and Q6_K then run 8 warps and at most WIDE_DECODE_ROWS rows a program, which keeps their decoding in
    registers; the other formats' tiles are as tuned."""
    if form[4] in WEIGHTS_FIRST and fmt != "q4_k":
        form = tile_form(tuning.entry(tuning.DEFAULT)["quantized_prefill"][part])
    if fmt in ("q5_k", "q6_k"):
        n, _, stages, piece, order = form
        return min(n, WIDE_DECODE_ROWS[part]), WIDE_DECODE_WARPS, stages, piece, order
    return form


def weights_first(fmt: str, form: tuple[int, int, int, int, str]) -> bool:
    """Whether this tile form's kernel for `fmt` puts the decoded weights first (Q4_K quarter steps; the other
    formats decode whole super-blocks with the tokens first)."""
    return quarter_steps(fmt, form) and form[4] in WEIGHTS_FIRST


def experts_quantized_major(hidden: torch.Tensor, top_k_index: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                            pool: torch.Tensor, staging: torch.Tensor, fmt: str, down_fmt: str, inter: int,
                            num_experts: int, gate_up_tiles: tuple[int, ...] | None = None,
                            down_tiles: tuple[int, ...] | None = None, block_m: int = BLOCK_M) -> torch.Tensor:
    """(P, H) fp32 unweighted pair outputs of T tokens' K experts each (`top_k_index` (T, K)), every
    pair's expert read from quantized slab `slots[p]` of `pool` (uint8 (S, slab bytes)), or, a miss
    (slot < 0), from its landing slab `land[p]`, or, without one, from row p of `staging`; SiLU-gated.
    H and I must be multiples of 256. The tiles: (BLOCK_N, warps, stages[, piece[, order]]) per kernel (`tile_form`;
    default: the device's tuned ones); `block_m`: pairs per block (a prompt's many tokens per expert: larger blocks
    decode each expert fewer times)."""
    tokens, top_k = top_k_index.shape
    hidden_size = hidden.shape[1]
    ids = top_k_index.reshape(-1)
    pairs = ids.numel()
    block_expert, block_pairs = block_plan(ids, num_experts, block_m)
    # the blocks in use come first: an expert of c pairs takes ceil(c / M) <= c / M + 1 of them
    blocks = min(pairs, pairs // block_m + num_experts)
    tuned = tuning.get("quantized_major", hidden.device)
    gate_up_form = format_form(fmt, "gate_up", tile_form(gate_up_tiles or tuned["gate_up"]))
    down_form = format_form(down_fmt, "down", tile_form(down_tiles or tuned["down"]))
    # each kernel reads its rows in the order its steps unpack the weights (quarter steps: in order); the
    # first kernel stores h in the second's
    x = in_tile_order(hidden, None if quarter_steps(fmt, gate_up_form) else fmt)
    h_order = IN_ORDER if quarter_steps(down_fmt, down_form) else TILE_KINDS[down_fmt]
    h = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    # staging as an offset from the pool: the kernels read both through the pool's pointer (its alignment known)
    rows = (pool, pool.shape[1], staging.data_ptr() - pool.data_ptr(), staging.shape[1])
    n, warps, stages, piece, _ = gate_up_form
    if weights_first(fmt, gate_up_form):
        launch(_gate_up_q_rows, (blocks, cdiv(inter, n)),
               x, block_expert, block_pairs, slots, land, h, *rows, TOP_K=top_k, H=hidden_size, I=inter,
               DOWN_KIND=h_order, SB_BYTES=TILE_BYTES[fmt], BLOCK_M=block_m, BLOCK_N=n,
               AHEAD=gate_up_form[4] == "weights-ahead", num_warps=warps, num_stages=stages)
    else:
        launch(_gate_up_q_blocks, (blocks, cdiv(inter, n)),
               x, block_expert, block_pairs, slots, land, h, *rows, TOP_K=top_k, H=hidden_size, I=inter,
               KIND=TILE_KINDS[fmt], DOWN_KIND=h_order, SB_BYTES=TILE_BYTES[fmt], BLOCK_M=block_m, BLOCK_N=n,
               PIECE=piece, num_warps=warps, num_stages=stages)
    n, warps, stages, piece, _ = down_form
    part_bytes = 2 * inter * (hidden_size // 256) * TILE_BYTES[fmt]
    if weights_first(down_fmt, down_form):
        launch(_down_q_rows, (blocks, cdiv(hidden_size, n)),
               h, block_expert, block_pairs, slots, land, y, *rows, PART_BYTES=part_bytes, H=hidden_size, I=inter,
               SB_BYTES=TILE_BYTES[down_fmt], BLOCK_M=block_m, BLOCK_N=n, AHEAD=down_form[4] == "weights-ahead",
               num_warps=warps, num_stages=stages)
    else:
        launch(_down_q_blocks, (blocks, cdiv(hidden_size, n)),
               h, block_expert, block_pairs, slots, land, y, *rows, PART_BYTES=part_bytes, H=hidden_size, I=inter,
               KIND=TILE_KINDS[down_fmt], SB_BYTES=TILE_BYTES[down_fmt], BLOCK_M=block_m, BLOCK_N=n, PIECE=piece,
               num_warps=warps, num_stages=stages)
    return y


def tile_columns(fmt: str) -> torch.Tensor | None:
    """(256,) the input column each weight of a decoded tile row multiplies, in the order the format's
    bytes unpack them (`_tile`); None: in order."""
    k = torch.arange(256)
    if fmt == "q4_k":   # (group j of 64, lane l, nibble n) <- weight 64 j + 32 n + l
        return 64 * (k // 64) + 32 * (k % 2) + (k % 64) // 2
    if fmt == "q4_0":   # (block b of 32, byte l, nibble n) <- weight 32 b + 16 n + l
        return 32 * (k // 32) + 16 * (k % 2) + (k % 32) // 2
    return None


def in_tile_order(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """(T, C) rows with each 256 columns in the order `fmt`'s tiles unpack their weights: the kernels
    then read a block's token rows as contiguous runs (16-byte loads) where they gathered each element
    (None: in order, contiguous)."""
    # a transpose, not a gather: no index tensor to copy to the device (a batched step is captured)
    tokens, width = x.shape
    if fmt == "q4_k":   # column 64 j + 32 n + l to place 64 j + 2 l + n
        return x.reshape(tokens, width // 64, 2, 32).transpose(-1, -2).reshape(tokens, width)
    if fmt == "q4_0":   # column 32 b + 16 n + l to place 32 b + 2 l + n
        return x.reshape(tokens, width // 32, 2, 16).transpose(-1, -2).reshape(tokens, width)
    return x.contiguous()


def experts_by_pair_blocks(hidden: torch.Tensor, top_k_index: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                           pool: torch.Tensor, staging: torch.Tensor, block_bytes: int, num_experts: int,
                           dequantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                           act: Any) -> torch.Tensor:
    """The kernels' torch twin: (P, H) fp32. `dequantize` turns (n, block_bytes) uint8 blocks into
    (n, 2I, H) and (n, H, I) weights; each block of the plan computes with its first pair's."""
    ids = top_k_index.reshape(-1)
    pairs = torch.arange(ids.numel(), device=ids.device)
    read = torch.where(slots < 0, land, slots)  # < 0: the pair's staging row
    blocks = torch.where((read < 0)[:, None], staging[pairs, :block_bytes], pool[read.clamp(min=0), :block_bytes])
    gate_up, down = dequantize(blocks)                        # per pair: (P, 2I, H), (P, H, I)
    block_expert, block_pairs = expert_blocks(ids, num_experts)
    first_pair = torch.where(block_expert >= 0, block_pairs[:, 0], -1)  # the block's weights: its first pair's
    x = hidden.to(gate_up.dtype) if gate_up.dtype.is_floating_point else hidden
    return experts_by_block(x, top_k_index.shape[1], first_pair, block_pairs, gate_up, down, act)


def available(dtype: torch.dtype) -> bool:
    """Whether the kernels run for activations of `dtype`: tensor-core dtypes with Triton present."""
    return expert_major.available(dtype)


if tl is not None:
    from .block_decode import _kquant_weights, _nibble_float, _q6k_weights, _scales_mins
    from .expert_major import _block

    @triton.jit
    def _tile_position(cols, KIND: tl.constexpr):
        """Where column `cols` of a row goes in KIND's tile order (`tile_columns`' inverse, per 256)."""
        r = cols % 256
        if KIND == 4 or KIND == 44:  # weight 64 j + 32 n + l -> 64 j + 2 l + n
            at = 64 * (r // 64) + 2 * (r % 32) + (r % 64) // 32
        elif KIND == 40:             # weight 32 b + 16 n + l -> 32 b + 2 l + n
            at = 32 * (r // 32) + 2 * (r % 16) + (r % 32) // 16
        else:
            at = r
        return cols - r + at

    @triton.jit
    def _tile(at, ok, KIND: tl.constexpr, R: tl.constexpr):
        """(R, 256) fp32: 256 weights of each of R rows from the blocks at `at` (R, 1) in format KIND,
        in `tile_columns` order."""
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        if KIND == 4 or KIND == 44:  # Q4_K: d, dmin, 12 bytes of 6-bit scales and minimums, 128 quant bytes
            j = tl.arange(0, 4)
            d = tl.load(at.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
            dmin = tl.load((at + 2).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
            scale_even, min_even = _scales_mins(at8, 2 * j, ok)                 # (R, 4): sub-blocks 0, 2, ..
            scale_odd, min_odd = _scales_mins(at8, 2 * j + 1, ok)               # 1, 3, ..
            if KIND == 44:  # the quant bytes as 32-bit words: byte b of word w is lane 4 w + b
                w = tl.arange(0, 8)
                b = tl.arange(0, 4)
                words = tl.load((at + 16).to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]
                                + (j[:, None] * 8 + w[None, :])[None, :, :], mask=ok[:, :, None], other=0)
                quants = tl.reshape((words[:, :, :, None] >> (8 * b)[None, None, None, :]) & 0xFF, [R, 4, 32])
            else:
                lane = tl.arange(0, 32)
                quants = tl.load(at8[:, :, None] + 16 + (j[:, None] * 32 + lane[None, :])[None, :, :],
                                 mask=ok[:, :, None], other=0).to(tl.int32)     # (R, 4, 32)
            low = _nibble_float(quants)
            high = _nibble_float(quants >> 4)
            even = (d * scale_even)[:, :, None] * low - (dmin * min_even)[:, :, None]
            odd = (d * scale_odd)[:, :, None] * high - (dmin * min_odd)[:, :, None]
            weights = tl.reshape(tl.join(even, odd), [R, 256])
        elif KIND == 8 or KIND == 40:  # Q8_0 / Q4_0: eight 32-weight blocks, each an fp16 scale first
            QB: tl.constexpr = 18 if KIND == 40 else 34
            blocks = tl.arange(0, 8)
            first = at + (blocks * QB)[None, :]                                  # (R, 8)
            scale = tl.load(first.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
            if KIND == 40:  # byte l holds weight l (low nibble) and l + 16 (high), each minus 8
                lane = tl.arange(0, 16)
                packed = tl.load((first[:, :, None] + 2 + lane[None, None, :]).to(tl.pointer_type(tl.uint8),
                                                                                   bitcast=True),
                                 mask=ok[:, :, None], other=0).to(tl.int32)     # (R, 8, 16)
                low = ((packed & 0xF) - 8).to(tl.float32) * scale[:, :, None]
                high = ((packed >> 4) - 8).to(tl.float32) * scale[:, :, None]
                weights = tl.reshape(tl.join(low, high), [R, 256])
            else:
                lane = tl.arange(0, 32)
                q = tl.load((first[:, :, None] + 2 + lane[None, None, :]).to(tl.pointer_type(tl.int8), bitcast=True),
                            mask=ok[:, :, None], other=0)
                weights = tl.reshape(q.to(tl.float32) * scale[:, :, None], [R, 256])
        elif KIND == 6:
            weights = _q6k_weights(at, at8, tl.arange(0, 256), ok)
        else:  # Q5_K
            weights = _kquant_weights(at, at8, tl.arange(0, 256), ok, True)
        return weights

    @triton.jit
    def _q4k_quarter(at, ok, j, R: tl.constexpr):
        """(R, 32), (R, 32) fp32: sub-blocks 2 j and 2 j + 1 (weights 64 j .. 64 j + 31 and the next 32, in
        order) of R rows' Q4_K super-blocks at `at` (R, 1): the low and high nibbles of the same 32 bytes."""
        d, dmin, scale_low, scale_high, min_low, min_high = _q4k_quarter_constants(at, ok, j)
        w = tl.arange(0, 8)
        b = tl.arange(0, 4)
        words = tl.load((at + 16).to(tl.pointer_type(tl.int32), bitcast=True) + (8 * j + w)[None, :],
                        mask=ok, other=0)                                                # (R, 8): 32 quant bytes
        quants = tl.reshape((words[:, :, None] >> (8 * b)[None, None, :]) & 0xFF, [R, 32])
        low = d * scale_low * _nibble_float(quants) - dmin * min_low
        high = d * scale_high * _nibble_float(quants >> 4) - dmin * min_high
        return low, high

    @triton.jit
    def _q4k_quarter_constants(at, ok, j):
        """Sub-blocks 2 j and 2 j + 1 of R rows' Q4_K super-blocks at `at` (R, 1): d, dmin, and the two scales and
        the two minimums, six (R, 1) fp32 (a weight is d scale n - dmin min)."""
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        d = tl.load(at.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        dmin = tl.load((at + 2).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        scale, minimum = _scales_mins(at8, 2 * j + tl.arange(0, 2), ok)                 # (R, 2)
        first = tl.arange(0, 2)[None, :] == 0
        return (d, dmin, tl.sum(tl.where(first, scale, 0.0), axis=1)[:, None],
                tl.sum(tl.where(first, 0.0, scale), axis=1)[:, None],
                tl.sum(tl.where(first, minimum, 0.0), axis=1)[:, None],
                tl.sum(tl.where(first, 0.0, minimum), axis=1)[:, None])

    @triton.jit
    def _gate_up_rows(pair, ok, cols, slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset,
                      staging_bytes, TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SB_BYTES: tl.constexpr,
                      BLOCK_M: tl.constexpr):
        """A used block's gate_up inputs: each lane's token row, and where its expert's gate rows `cols` start (N, 1)
        (the up rows are I rows on)."""
        base = _expert_at(slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset, staging_bytes, BLOCK_M)
        row_bytes = H // 256 * SB_BYTES
        gate_at = base + cols[:, None].to(tl.int64) * row_bytes
        return tl.where(ok, pair // TOP_K, 0).to(tl.int64), gate_at, gate_at + I * row_bytes

    @triton.jit
    def _down_rows(pair, ok, cols, slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset,
                   staging_bytes, PART_BYTES: tl.constexpr, I: tl.constexpr, SB_BYTES: tl.constexpr,
                   BLOCK_M: tl.constexpr):
        """A used block's down inputs: each lane's row of h, and where its expert's down rows `cols` start (N, 1)
        (PART_BYTES after the gate and up rows)."""
        base = _expert_at(slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset, staging_bytes, BLOCK_M)
        w_at = base + PART_BYTES + cols[:, None].to(tl.int64) * (I // 256 * SB_BYTES)
        return tl.where(ok, pair, 0).to(tl.int64), w_at

    @triton.jit
    def _q4k_quarter_rows(at, ok, j, R: tl.constexpr):
        """`_q4k_quarter` for the weights-first kernels: the quant bytes loaded as bytes, so every step from the
        load to the weight is elementwise and Triton can do them in the tensor cores' operand layout (32-bit
        words would need a reshape, which it cannot move). Each nibble n goes into the top of 1.0's mantissa,
        1 + n / 16 exactly, and one FMA a weight gives d * scale * n - dmin * min as
        (16 d scale) (1 + n / 16) - (16 d scale + dmin min): the constant's rounding is 2^-24 of it, far below
        the BF16 rounding of the weight the product reads (the exponent trick needs an FMA and a subtraction)."""
        d, dmin, scale_low, scale_high, min_low, min_high = _q4k_quarter_constants(at, ok, j)
        step_low, step_high = 16.0 * d * scale_low, 16.0 * d * scale_high
        offset_low, offset_high = step_low + dmin * min_low, step_high + dmin * min_high
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        quants = tl.load(at8 + 16 + 32 * j + tl.arange(0, 32)[None, :], mask=ok, other=0).to(tl.int32)  # (R, 32)
        # nibble << 19 in 0x780000 (bits 19-22, the mantissa's top), 0x3F800000: 1.0
        low = (((quants << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        high = (((quants << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        return step_low * low - offset_low, step_high * high - offset_high

    @triton.jit
    def _ask_l1(at):
        """Ask L1 for the line holding each address of pointer tensor `at`, for a load a step later. PTX's prefetch
        returns nothing and waits on nothing (the dummy result only satisfies inline asm); an address outside
        the allocation is not a fault for a prefetch, but callers stay within their rows anyway."""
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [at], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _ask_l1_quarter(at, k, SB_BYTES: tl.constexpr):
        """Prefetch (`_ask_l1`) what quarter step k of rows at `at` (R, 1) reads: its super-block's constants (the
        first 16 bytes) and its 32 quant bytes (both ends: the 32 bytes may straddle two 128-byte lines)."""
        block = at + (k // 4) * SB_BYTES
        _ask_l1(block)
        _ask_l1(block + 16 + 32 * (k % 4))
        _ask_l1(block + 16 + 32 * (k % 4) + 31)

    @triton.jit
    def _gate_up_q_rows(x_ptr, expert_ptr, pairs_ptr, slots_ptr, land_ptr, h_ptr, pool_ptr, slab_bytes,
                        staging_offset, staging_bytes, TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                        DOWN_KIND: tl.constexpr, SB_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, AHEAD: tl.constexpr = False):
        """`_gate_up_q_blocks` with the weights first (Q4_K, quarter steps): each step's (N, 32) decoded weights
        times the block's (32, M) token rows, so the products are (N, M), transposed back as h is stored.
        AHEAD: each step prefetches the next one's bytes (the last step its own again)."""
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, I, BLOCK_M, BLOCK_N)
        if expert >= 0:
            token, gate_at, up_at = _gate_up_rows(pair, ok, cols, slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes,
                                                  staging_offset, staging_bytes, TOP_K, H, I, SB_BYTES, BLOCK_M)
            w_ok = col_ok[:, None]
            gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            half = tl.arange(0, 32)  # x comes in order
            for k in range(0, H // 64):
                if AHEAD:
                    ahead = tl.minimum(k + 1, H // 64 - 1)
                    _ask_l1_quarter(gate_at, ahead, SB_BYTES)
                    _ask_l1_quarter(up_at, ahead, SB_BYTES)
                    _ask_l1(x_ptr + token * H + ahead * 64)  # the 64 columns of each token row: one 128-byte line
                at = token[None, :] * H + k * 64 + half[:, None]        # (32, M): the block's rows, transposed
                x_low = tl.load(x_ptr + at, mask=ok[None, :], other=0.0)
                x_high = tl.load(x_ptr + at + 32, mask=ok[None, :], other=0.0)
                low, high = _q4k_quarter_rows(gate_at + (k // 4) * SB_BYTES, w_ok, k % 4, BLOCK_N)
                gate = tl.dot(low.to(x_ptr.dtype.element_ty), x_low, gate)
                gate = tl.dot(high.to(x_ptr.dtype.element_ty), x_high, gate)
                low, high = _q4k_quarter_rows(up_at + (k // 4) * SB_BYTES, w_ok, k % 4, BLOCK_N)
                up = tl.dot(low.to(x_ptr.dtype.element_ty), x_low, up)
                up = tl.dot(high.to(x_ptr.dtype.element_ty), x_high, up)
            h = gate * tl.sigmoid(gate) * up
            # in the down format's tile order, which the second kernel reads as contiguous runs
            tl.store(h_ptr + pair[None, :].to(tl.int64) * I + _tile_position(cols, DOWN_KIND)[:, None],
                     h.to(h_ptr.dtype.element_ty), mask=ok[None, :] & col_ok[:, None])

    @triton.jit
    def _down_q_rows(h_ptr, expert_ptr, pairs_ptr, slots_ptr, land_ptr, y_ptr, pool_ptr, slab_bytes,
                     staging_offset, staging_bytes, PART_BYTES: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                     SB_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr = False):
        """`_down_q_blocks` with the weights first (Q4_K, quarter steps; h in order); AHEAD as `_gate_up_q_rows`."""
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, H, BLOCK_M, BLOCK_N)
        if expert >= 0:
            row, w_at = _down_rows(pair, ok, cols, slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset,
                                   staging_bytes, PART_BYTES, I, SB_BYTES, BLOCK_M)
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            half = tl.arange(0, 32)
            for k in range(0, I // 64):
                if AHEAD:
                    ahead = tl.minimum(k + 1, I // 64 - 1)
                    _ask_l1_quarter(w_at, ahead, SB_BYTES)
                    _ask_l1(h_ptr + row * I + ahead * 64)
                at = row[None, :] * I + k * 64 + half[:, None]          # (32, M)
                low, high = _q4k_quarter_rows(w_at + (k // 4) * SB_BYTES, col_ok[:, None], k % 4, BLOCK_N)
                acc = tl.dot(low.to(h_ptr.dtype.element_ty), tl.load(h_ptr + at, mask=ok[None, :], other=0.0), acc)
                acc = tl.dot(high.to(h_ptr.dtype.element_ty), tl.load(h_ptr + at + 32, mask=ok[None, :], other=0.0),
                             acc)
            tl.store(y_ptr + row[None, :] * H + cols[:, None], acc, mask=ok[None, :] & col_ok[:, None])

    @triton.jit
    def _stage_kernel(ids_ptr, slots_ptr, land_ptr, pool_ptr, staging_ptr, host_addr, block_words, pool_words,
                      staging_words, CHUNK: tl.constexpr):
        """stage_misses: program (pair, chunk of words)."""
        pair = tl.program_id(0)
        offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        slab = tl.load(land_ptr + pair)
        inside = (offsets < block_words) & (tl.load(slots_ptr + pair) < 0)
        src = (host_addr + tl.load(ids_ptr + pair).to(tl.int64) * block_words * 4).to(tl.pointer_type(tl.int32),
                                                                                       bitcast=True)
        dst = tl.where(slab >= 0, pool_ptr + slab * pool_words, staging_ptr + pair * staging_words)
        tl.store(dst + offsets, tl.load(src + offsets, mask=inside), mask=inside)

    @triton.jit
    def _expert_at(slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset, staging_bytes,
                   BLOCK_M: tl.constexpr):
        """A pointer to this program's block's expert, at its first pair: the slab holding it, the
        landing slab it was staged into, or that pair's staging row (`staging_offset` bytes from the pool)."""
        first = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M)
        slab = tl.load(slots_ptr + first)
        slab = tl.where(slab >= 0, slab, tl.load(land_ptr + first))
        return pool_ptr + tl.where(slab >= 0, slab * slab_bytes, staging_offset + first * staging_bytes)

    @triton.jit
    def _gate_up_q_blocks(x_ptr, expert_ptr, pairs_ptr, slots_ptr, land_ptr, h_ptr, pool_ptr, slab_bytes,
                          staging_offset, staging_bytes, TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                          KIND: tl.constexpr, DOWN_KIND: tl.constexpr, SB_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PIECE: tl.constexpr = 256):
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, I, BLOCK_M, BLOCK_N)
        if expert >= 0:
            token, gate_at, up_at = _gate_up_rows(pair, ok, cols, slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes,
                                                  staging_offset, staging_bytes, TOP_K, H, I, SB_BYTES, BLOCK_M)
            lanes = tl.arange(0, 256)  # x comes in KIND's tile order (in_tile_order)
            w_ok = col_ok[:, None]
            gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if KIND == 44 and PIECE == 64:  # a quarter super-block a step: a quarter of the registers
                half = tl.arange(0, 32)       # x comes in order (in_tile_order leaves it for quarter steps)
                for k in range(0, H // 64):
                    at = token[:, None] * H + k * 64 + half[None, :]
                    x_low = tl.load(x_ptr + at, mask=ok[:, None], other=0.0)
                    x_high = tl.load(x_ptr + at + 32, mask=ok[:, None], other=0.0)
                    low, high = _q4k_quarter(gate_at + (k // 4) * SB_BYTES, w_ok, k % 4, BLOCK_N)
                    gate = tl.dot(x_low, tl.trans(low.to(x_ptr.dtype.element_ty)), gate)
                    gate = tl.dot(x_high, tl.trans(high.to(x_ptr.dtype.element_ty)), gate)
                    low, high = _q4k_quarter(up_at + (k // 4) * SB_BYTES, w_ok, k % 4, BLOCK_N)
                    up = tl.dot(x_low, tl.trans(low.to(x_ptr.dtype.element_ty)), up)
                    up = tl.dot(x_high, tl.trans(high.to(x_ptr.dtype.element_ty)), up)
            else:
                for sb in range(0, H // 256):
                    x = tl.load(x_ptr + token[:, None] * H + sb * 256 + lanes[None, :], mask=ok[:, None], other=0.0)
                    w = _tile(gate_at + sb * SB_BYTES, w_ok, KIND, BLOCK_N).to(x_ptr.dtype.element_ty)
                    gate = tl.dot(x, tl.trans(w), gate)
                    w = _tile(up_at + sb * SB_BYTES, w_ok, KIND, BLOCK_N).to(x_ptr.dtype.element_ty)
                    up = tl.dot(x, tl.trans(w), up)
            h = gate * tl.sigmoid(gate) * up
            # in the down format's tile order, which the second kernel reads as contiguous runs
            tl.store(h_ptr + pair[:, None].to(tl.int64) * I + _tile_position(cols, DOWN_KIND)[None, :],
                     h.to(h_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_q_blocks(h_ptr, expert_ptr, pairs_ptr, slots_ptr, land_ptr, y_ptr, pool_ptr, slab_bytes,
                       staging_offset, staging_bytes, PART_BYTES: tl.constexpr, H: tl.constexpr, I: tl.constexpr, KIND: tl.constexpr,
                       SB_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PIECE: tl.constexpr = 256):
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, H, BLOCK_M, BLOCK_N)
        if expert >= 0:
            row, w_at = _down_rows(pair, ok, cols, slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset,
                                   staging_bytes, PART_BYTES, I, SB_BYTES, BLOCK_M)
            lanes = tl.arange(0, 256)  # h is in KIND's tile order (the first kernel stored it so)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if KIND == 44 and PIECE == 64:  # h in order (the first kernel stored it so)
                half = tl.arange(0, 32)
                for k in range(0, I // 64):
                    at = row[:, None] * I + k * 64 + half[None, :]
                    low, high = _q4k_quarter(w_at + (k // 4) * SB_BYTES, col_ok[:, None], k % 4, BLOCK_N)
                    acc = tl.dot(tl.load(h_ptr + at, mask=ok[:, None], other=0.0),
                                 tl.trans(low.to(h_ptr.dtype.element_ty)), acc)
                    acc = tl.dot(tl.load(h_ptr + at + 32, mask=ok[:, None], other=0.0),
                                 tl.trans(high.to(h_ptr.dtype.element_ty)), acc)
            else:
                for sb in range(0, I // 256):
                    hx = tl.load(h_ptr + row[:, None] * I + sb * 256 + lanes[None, :], mask=ok[:, None], other=0.0)
                    w = _tile(w_at + sb * SB_BYTES, col_ok[:, None], KIND, BLOCK_N).to(h_ptr.dtype.element_ty)
                    acc = tl.dot(hx, tl.trans(w), acc)
            tl.store(y_ptr + row[:, None] * H + cols[None, :], acc, mask=ok[:, None] & col_ok[None, :])
