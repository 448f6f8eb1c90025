"""A prompt's experts on Q4_K slabs with int8 activations: integer products on tensor cores (opt-in).

Shapes as in quantized_major.py: T tokens, K experts per token, P = T x K pairs, H hidden, I expert
intermediate size, M = BLOCK_M pairs per block, N = BLOCK_N output rows per program, C a row's columns.

quantized_major.py decodes each routed expert's weights to fp32 (scale, minimum, convert to BF16) once per
block of its tokens and multiplies BF16 on tensor cores: every weight of a tile costs a handful of float
operations before the product, and at a prompt's sizes that decoding, not the bytes, bounds the kernels
(an H200 takes some 640 us a layer at 236 tokens, against about 70 us to read the layer's bytes once).
Here the activations are quantized instead, so the weights need no decoding at all. Q4_K's weight i of a
32-weight sub-block j is step_j * q_i - offset_j (step = d * scale_j, offset = dmin * min_j, q_i in 0..15),
and an activation row's block j is about dx_j * xq_i (xq int8, dx = its largest magnitude / 127), so

    sum_i w_i x_i  ~  step_j * dx_j * (sum_i q_i xq_i)  -  offset_j * dx_j * (sum_i xq_i)

The inner sum is an int8 x int8 product with int32 accumulation (`tl.dot`'s integer MMA, twice the BF16
rate) of the raw nibbles; the float work moves from every weight to every (pair, row, sub-block) of the
output tile, once per 32 products. This is the idea of llama.cpp's MMQ (activations in 8-bit blocks of 32
with a scale and a sum). The sum (kept per block, not summed again per tile) is the quantized block's, so the
result is exactly the product with the activations as quantized: with the block's float sum instead (exact
for the minimum's term) the rounding errors stay multiplied
by the quants (mean 7.5) rather than the weights (mean about 0), and the outputs' error doubled (2.5% of
their norm against 1.2% on the CPU test's random Q4_K experts).

    quantize_rows   (R, C) float -> Int8Rows: int8 (R, C), fp32 scale and sum per 32 columns (R, C / 32)
    gate_up         h[p] = silu(gate) * up of the int8 rows of x, grid (blocks, I / N), H / 64 steps;
                    its epilogue quantizes h the same way, straight from fp32 (no BF16 rounding of h, no
                    launch or round trip through memory to quantize it; a program's N columns are whole
                    32-column blocks, so each block's scale and sum are the program's alone)
    down            y[p] = W_down[e] @ h[p] (fp32, the caller combines), grid (blocks, H / N), I / 64 steps

Each step reads a quarter super-block of N rows (the 32 quant bytes of two sub-blocks, `_q4k_quarter_codes`,
as the quarter steps of quantized_major.py read them): the low nibbles are sub-block 2 j's 32 weights, the
high nibbles 2 j + 1's, each a K = 32 integer product with the rows' int8 columns in order. Same block plan,
slab lookup and grid as quantized_major.py; rows past a block's pairs load zeros and store nothing.

Only Q4_K gate_up and down (`applies`); every other format, and a Q4_K_M layer's Q6_K down, keep
quantized_major.py. Rounding: half away from zero (x / dx + 0.5 toward zero, as the fp32 sum rounds it),
the twin identically. The torch twins (`*_twin`) compute what the kernels compute up to fp32 summation order
(the CPU tests); against the weights dequantized, the activations' 8 bits cost about 1% of an output's scale.
Chosen by tuning (quantized_prefill's int8_activations, its own tiles under int8): off until the GPU
measures it (benchmarks/prefill_kernel_bench.py's "int8 activations" rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import q4k
from . import tuning
from .expert_major import BLOCK_M, block_plan, expert_blocks
from .triton_support import tl, triton

SUB = 32         # columns per scale and sum: a Q4_K sub-block
QMAX = 127       # int8 range used: symmetric, so -128 never appears
SB_BYTES = 144   # a Q4_K super-block (256 weights)
QUANTIZE_ROWS, QUANTIZE_COLS = 16, 256  # rows and columns per program of quantize_rows


class Int8Rows(NamedTuple):
    """Rows quantized per 32 columns: q (R, C) int8, scale (R, C / 32) fp32 (q * scale ~ the row), sums
    (R, C / 32) fp32: each block's sum as quantized, scale * sum(q) (the int sum exact, one rounding)."""
    q: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor


class PairPlan(NamedTuple):
    """A layer call's pairs in blocks of one expert (expert_major's plan) and where each block's expert lies:
    slab slots[p] of pool, else landing slab land[p], else staging row p (quantized_major's lookup)."""
    top_k: int
    block_m: int
    block_expert: torch.Tensor   # (P,) -1: unused
    block_pairs: torch.Tensor    # (P, block_m) -1: an empty lane
    launched: int                # the blocks launched: those in use come first
    slots: torch.Tensor
    land: torch.Tensor
    pool: torch.Tensor
    staging: torch.Tensor


def applies(fmt: str, down_fmt: str) -> bool:
    """Whether the int8 path computes experts in these formats: Q4_K gate_up and down only."""
    return fmt == down_fmt == "q4_k"


def pair_plan(top_k_index: torch.Tensor, slots: torch.Tensor, land: torch.Tensor, pool: torch.Tensor,
              staging: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, on_device: bool = True) -> PairPlan:
    """The plan of `top_k_index` (T, K): planned by the Triton program (`on_device`) or by torch (the twin's)."""
    ids = top_k_index.reshape(-1)
    pairs = ids.numel()
    block_expert, block_pairs = (block_plan if on_device else expert_blocks)(ids, num_experts, block_m)
    # an expert of c pairs takes ceil(c / M) <= c / M + 1 blocks
    return PairPlan(top_k_index.shape[1], block_m, block_expert, block_pairs,
                    min(pairs, pairs // block_m + num_experts), slots, land, pool, staging)


def experts_int8(hidden: torch.Tensor, top_k_index: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                 pool: torch.Tensor, staging: torch.Tensor, inter: int, num_experts: int,
                 gate_up_tiles: tuple[int, int, int] | None = None, down_tiles: tuple[int, int, int] | None = None,
                 block_m: int = BLOCK_M) -> torch.Tensor:
    """`quantized_major.experts_quantized_major` for Q4_K gate_up and down, on int8 activations: (P, H) fp32
    unweighted pair outputs, SiLU-gated. Tiles: (BLOCK_N, warps, stages) per kernel, BLOCK_N a multiple of
    32 (default: the device's tuned ones, quantized_prefill's int8)."""
    tuned = _tuned(hidden.device)
    plan = pair_plan(top_k_index, slots, land, pool, staging, num_experts, block_m)
    h = gate_up_int8(quantize_rows(hidden), plan, hidden.shape[1], inter, gate_up_tiles or tuned["gate_up"])
    return down_int8(h, plan, hidden.shape[1], inter, down_tiles or tuned["down"])


def experts_int8_twin(hidden: torch.Tensor, top_k_index: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                      pool: torch.Tensor, staging: torch.Tensor, inter: int, num_experts: int,
                      block_m: int = BLOCK_M) -> torch.Tensor:
    """The kernels' torch twin, stage for stage (any device, no Triton)."""
    plan = pair_plan(top_k_index, slots, land, pool, staging, num_experts, block_m, on_device=False)
    hidden_size = hidden.shape[1]
    h = quantize_rows_twin(gate_up_twin(quantize_rows_twin(hidden), plan, hidden_size, inter))
    return down_twin(h, plan, hidden_size, inter)


def _tuned(device: torch.device) -> dict:
    return tuning.get("quantized_prefill", device)["int8"]


# --- activations -----------------------------------------------------------------------------------
def quantize_rows(x: torch.Tensor) -> Int8Rows:
    """(R, C) float rows -> Int8Rows, C a multiple of 256: one program per 16 rows x 256 columns."""
    rows, cols = x.shape
    out = _empty_rows(rows, cols, x.device)
    _quantize_rows_kernel[(triton.cdiv(rows, QUANTIZE_ROWS), cols // QUANTIZE_COLS)](
        x.contiguous(), *out, rows, C=cols, ROWS=QUANTIZE_ROWS, COLS=QUANTIZE_COLS)
    return out


def quantize_rows_twin(x: torch.Tensor) -> Int8Rows:
    """`quantize_rows` in torch: per 32 columns scale = max |x| / 127 (0 for a zero block), q = x / scale
    rounded half away from zero (x / scale + 0.5 rounded in fp32, then toward zero, as the kernel does),
    sums = sum(q) * scale. True divisions, as the kernel's (torch's `t / 127` may multiply by a reciprocal)."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // SUB, SUB)
    amax = blocks.abs().amax(-1)
    scale = torch.div(amax, torch.full_like(amax, QMAX))
    scaled = torch.div(blocks, torch.where(scale > 0, scale, 1.0)[..., None])
    q = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5)).clamp(-QMAX, QMAX)
    return Int8Rows(q.to(torch.int8).reshape(rows, cols), scale, q.sum(-1) * scale)


def _empty_rows(rows: int, cols: int, device: torch.device) -> Int8Rows:
    return Int8Rows(torch.empty(rows, cols, dtype=torch.int8, device=device),
                    torch.empty(rows, cols // SUB, dtype=torch.float32, device=device),
                    torch.empty(rows, cols // SUB, dtype=torch.float32, device=device))


# --- the kernels' launches ---------------------------------------------------------------------------
def _slab_args(plan: PairPlan) -> tuple:
    # staging as an offset from the pool: the kernels read both through the pool's pointer (quantized_major)
    return (plan.pool, plan.pool.shape[1], plan.staging.data_ptr() - plan.pool.data_ptr(), plan.staging.shape[1])


def _checked(tiles: tuple[int, ...]) -> tuple[int, int, int]:
    n, warps, stages = tiles
    if n % SUB:
        raise ValueError(f"a tile of {n} columns: the int8 kernels quantize whole {SUB}-column blocks")
    return n, warps, stages


def gate_up_int8(x: Int8Rows, plan: PairPlan, hidden: int, inter: int, tiles: tuple[int, ...]) -> Int8Rows:
    """h (P, I) of every pair, SiLU-gated, quantized as `quantize_rows` would quantize it in fp32."""
    pairs = plan.block_pairs.shape[0]
    h = _empty_rows(pairs, inter, x.q.device)
    n, warps, stages = _checked(tiles)
    _gate_up_int8_blocks[(plan.launched, triton.cdiv(inter, n))](
        *x, plan.block_expert, plan.block_pairs, plan.slots, plan.land, *h, *_slab_args(plan), TOP_K=plan.top_k,
        H=hidden, I=inter, BLOCK_M=plan.block_m, BLOCK_N=n, num_warps=warps, num_stages=stages)
    return h


def down_int8(h: Int8Rows, plan: PairPlan, hidden: int, inter: int, tiles: tuple[int, ...]) -> torch.Tensor:
    """y (P, H) fp32 of every pair from its quantized h."""
    y = torch.empty(plan.block_pairs.shape[0], hidden, dtype=torch.float32, device=h.q.device)
    n, warps, stages = _checked(tiles)
    _down_int8_blocks[(plan.launched, triton.cdiv(hidden, n))](
        *h, plan.block_expert, plan.block_pairs, plan.slots, plan.land, y, *_slab_args(plan),
        PART_BYTES=2 * inter * (hidden // 256) * SB_BYTES, H=hidden, I=inter, BLOCK_M=plan.block_m, BLOCK_N=n,
        num_warps=warps, num_stages=stages)
    return y


# --- the twins' products -----------------------------------------------------------------------------
def _block_weights(plan: PairPlan, block: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up (2I, H / 256 * 144), down (H, I / 256 * 144)) uint8: the Q4_K rows of the block's expert, read
    where its first pair's lookup finds them (as `_expert_at` does)."""
    first = int(plan.block_pairs[block, 0])
    slab = int(plan.slots[first]) if int(plan.slots[first]) >= 0 else int(plan.land[first])
    row = plan.pool[slab] if slab >= 0 else plan.staging[first]
    split, down_bytes = 2 * inter * q4k.row_bytes(hidden), hidden * q4k.row_bytes(inter)
    return (row[:split].view(2 * inter, q4k.row_bytes(hidden)),
            row[split:split + down_bytes].view(hidden, q4k.row_bytes(inter)))


def _products_twin(x: Int8Rows, weights: torch.Tensor, cols: int) -> torch.Tensor:
    """(M, N) fp32: M int8 rows of `cols` columns times N Q4_K weight rows `weights` (N, row bytes), sub-block
    by sub-block as the kernels' epilogue: (scale * integer dot) * step - sums * offset, summed in fp32."""
    step, offset, q = q4k.kquant_codes(weights, cols)             # (N, nb, 8), (N, nb, 8), (N, nb, 8, 32)
    n, blocks = weights.shape[0], cols // SUB
    xq = x.q.reshape(-1, blocks, SUB).double()
    dots = torch.einsum("mjk,njk->mnj", xq, q.reshape(n, blocks, SUB).double()).float()  # exact integers
    terms = (x.scale[:, None, :] * dots) * step.reshape(n, blocks)[None] \
        - x.sums[:, None, :] * offset.reshape(n, blocks)[None]
    return terms.sum(-1)


def _used_blocks(plan: PairPlan) -> list[tuple[int, torch.Tensor]]:
    return [(b, plan.block_pairs[b][plan.block_pairs[b] >= 0])
            for b in torch.nonzero(plan.block_expert >= 0, as_tuple=True)[0].tolist()]


def gate_up_twin(x: Int8Rows, plan: PairPlan, hidden: int, inter: int) -> torch.Tensor:
    """h (P, I) fp32 before quantizing (pairs in no block: zeros)."""
    h = torch.zeros(plan.block_pairs.shape[0], inter, dtype=torch.float32, device=x.q.device)
    for block, lanes in _used_blocks(plan):
        tokens = lanes // plan.top_k
        rows = Int8Rows(x.q[tokens], x.scale[tokens], x.sums[tokens])
        gate, up = _products_twin(rows, _block_weights(plan, block, hidden, inter)[0], hidden).split(inter, dim=-1)
        h[lanes] = gate * torch.sigmoid(gate) * up
    return h


def down_twin(h: Int8Rows, plan: PairPlan, hidden: int, inter: int) -> torch.Tensor:
    """y (P, H) fp32 from the quantized h (pairs in no block: zeros)."""
    y = torch.zeros(plan.block_pairs.shape[0], hidden, dtype=torch.float32, device=h.q.device)
    for block, lanes in _used_blocks(plan):
        rows = Int8Rows(h.q[lanes], h.scale[lanes], h.sums[lanes])
        y[lanes] = _products_twin(rows, _block_weights(plan, block, hidden, inter)[1], inter)
    return y


if tl is not None:
    from .expert_major import _block
    from .quantized_major import _expert_at, _q4k_quarter_codes

    @triton.jit
    def _quantized_blocks(v, R: tl.constexpr, C: tl.constexpr):
        """(R, C) fp32 -> (R, C) int8, scales and sums (R, C / 32): `quantize_rows_twin` (true divisions:
        a division is never fused with the half that rounds it, so the GPU rounds as the twin does)."""
        blocks = tl.reshape(v, [R, C // 32, 32])
        amax = tl.max(tl.abs(blocks), axis=2)
        scale = tl.math.div_rn(amax, 127.0)
        scaled = tl.math.div_rn(blocks, tl.where(scale > 0, scale, 1.0)[:, :, None])
        q = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)   # toward zero: half away from zero
        q = tl.minimum(tl.maximum(q, -127), 127)
        return tl.reshape(q, [R, C]).to(tl.int8), scale, tl.sum(q.to(tl.float32), axis=2) * scale

    @triton.jit
    def _store_rows(q_ptr, scale_ptr, sums_ptr, v, rows, ok, cols, col_ok, C: tl.constexpr, R: tl.constexpr,
                    N: tl.constexpr):
        """Rows `rows` (R,) x columns `cols` (N,: whole 32-column blocks) of an Int8Rows of C columns, from v."""
        q, scale, sums = _quantized_blocks(v, R, N)
        rows = rows.to(tl.int64)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=ok[:, None] & col_ok[None, :])
        blocks = tl.program_id(1) * (N // 32) + tl.arange(0, N // 32)
        at = rows[:, None] * (C // 32) + blocks[None, :]
        inside = ok[:, None] & (blocks < C // 32)[None, :]
        tl.store(scale_ptr + at, scale, mask=inside)
        tl.store(sums_ptr + at, sums, mask=inside)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, sums_ptr, rows, C: tl.constexpr, ROWS: tl.constexpr,
                              COLS: tl.constexpr):
        """quantize_rows: program (16 rows, 256 columns)."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        ok = row < rows
        v = tl.load(x_ptr + row[:, None].to(tl.int64) * C + cols[None, :], mask=ok[:, None], other=0.0)
        _store_rows(q_ptr, scale_ptr, sums_ptr, v.to(tl.float32), row, ok, cols, cols < C, C, ROWS, COLS)

    @triton.jit
    def _rows_quarter(q_ptr, scale_ptr, sums_ptr, row, ok, k, C: tl.constexpr):
        """Quarter k of the rows `row` (M,) of an Int8Rows of C columns: the int8 columns 64 k .. 64 k + 31 and
        the next 32 (M, 32) each, then their two blocks' scales and sums (M,) each (masked rows: zeros)."""
        at = row[:, None] * C + k * 64 + tl.arange(0, 32)[None, :]
        low = tl.load(q_ptr + at, mask=ok[:, None], other=0)
        high = tl.load(q_ptr + at + 32, mask=ok[:, None], other=0)
        block = row * (C // 32) + 2 * k
        return (low, high, tl.load(scale_ptr + block, mask=ok, other=0.0),
                tl.load(scale_ptr + block + 1, mask=ok, other=0.0), tl.load(sums_ptr + block, mask=ok, other=0.0),
                tl.load(sums_ptr + block + 1, mask=ok, other=0.0))

    @triton.jit
    def _sub_block(acc, dots, scale, sums, step, offset, N: tl.constexpr):
        """acc + one sub-block's products (M, N): (activation scale x integer dot) x weight step, minus the
        activations' sum x the weight offset; step and offset come per weight row (N, 1)."""
        step = tl.reshape(step, [1, N])
        offset = tl.reshape(offset, [1, N])
        return acc + (scale[:, None] * dots.to(tl.float32)) * step - sums[:, None] * offset

    @triton.jit
    def _quarter_products(acc, x_low, x_high, scale_low, scale_high, sums_low, sums_high, at, ok, j,
                          N: tl.constexpr):
        """acc (M, N) + the products of a quarter super-block j of N weight rows' Q4_K super-blocks at `at` (N, 1)
        with M int8 rows: two K = 32 integer MMAs (the low nibbles, then the high), each with its epilogue."""
        step_low, step_high, offset_low, offset_high, quants = _q4k_quarter_codes(at, ok, j, N)
        low = (quants & 0xF).to(tl.int8)
        high = (quants >> 4).to(tl.int8)
        acc = _sub_block(acc, tl.dot(x_low, tl.trans(low), out_dtype=tl.int32), scale_low, sums_low, step_low,
                         offset_low, N)
        return _sub_block(acc, tl.dot(x_high, tl.trans(high), out_dtype=tl.int32), scale_high, sums_high,
                          step_high, offset_high, N)

    @triton.jit
    def _gate_up_int8_blocks(xq_ptr, xs_ptr, xsum_ptr, expert_ptr, pairs_ptr, slots_ptr, land_ptr, hq_ptr, hs_ptr,
                             hsum_ptr, pool_ptr, slab_bytes, staging_offset, staging_bytes, TOP_K: tl.constexpr,
                             H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, I, BLOCK_M, BLOCK_N)
        if expert >= 0:
            base = _expert_at(slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset, staging_bytes,
                              BLOCK_M)
            ROW_BYTES: tl.constexpr = H // 256 * 144
            token = tl.where(ok, pair // TOP_K, 0).to(tl.int64)
            w_ok = col_ok[:, None]
            gate_at = base + cols[:, None].to(tl.int64) * ROW_BYTES     # (N, 1): gate rows, then up rows I on
            up_at = gate_at + I * ROW_BYTES
            gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(0, H // 64):
                x_low, x_high, s_low, s_high, sum_low, sum_high = _rows_quarter(xq_ptr, xs_ptr, xsum_ptr, token, ok,
                                                                                k, H)
                gate = _quarter_products(gate, x_low, x_high, s_low, s_high, sum_low, sum_high,
                                         gate_at + (k // 4) * 144, w_ok, k % 4, BLOCK_N)
                up = _quarter_products(up, x_low, x_high, s_low, s_high, sum_low, sum_high,
                                       up_at + (k // 4) * 144, w_ok, k % 4, BLOCK_N)
            h = gate * tl.sigmoid(gate) * up
            _store_rows(hq_ptr, hs_ptr, hsum_ptr, h, pair, ok, cols, col_ok, I, BLOCK_M, BLOCK_N)

    @triton.jit
    def _down_int8_blocks(hq_ptr, hs_ptr, hsum_ptr, expert_ptr, pairs_ptr, slots_ptr, land_ptr, y_ptr, pool_ptr,
                          slab_bytes, staging_offset, staging_bytes, PART_BYTES: tl.constexpr, H: tl.constexpr,
                          I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, H, BLOCK_M, BLOCK_N)
        if expert >= 0:
            base = _expert_at(slots_ptr, land_ptr, pairs_ptr, pool_ptr, slab_bytes, staging_offset, staging_bytes,
                              BLOCK_M)
            ROW_BYTES: tl.constexpr = I // 256 * 144
            row = tl.where(ok, pair, 0).to(tl.int64)
            w_at = base + PART_BYTES + cols[:, None].to(tl.int64) * ROW_BYTES
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(0, I // 64):
                h_low, h_high, s_low, s_high, sum_low, sum_high = _rows_quarter(hq_ptr, hs_ptr, hsum_ptr, row, ok, k,
                                                                                I)
                acc = _quarter_products(acc, h_low, h_high, s_low, s_high, sum_low, sum_high,
                                        w_at + (k // 4) * 144, col_ok[:, None], k % 4, BLOCK_N)
            tl.store(y_ptr + row[:, None] * H + cols[None, :], acc, mask=ok[:, None] & col_ok[None, :])
