"""The decode step's routed experts as two Triton GEMV kernels that read each expert where it lies.

Shapes: P token-expert pairs (T tokens x K experts, T = 1 in lean decode), H hidden, I expert
intermediate size.

Every pair carries a slab (>= 0: the expert's copy in the GPU pool) or -1 (not resident). The kernel
reads the weights from the slab, or else straight from the page-locked host store through the
device's mapping of it (zero-copy reads over PCIe), so a miss costs the bytes of one copy and no host
work at all: the whole step stays one CUDA graph. Hits and misses run the same code on the same
bytes, so the result does not depend on what was resident (graphed and eager steps agree to the bit).

    gate_up:  h[p] = silu(W_gate[e_p] @ x[t_p]) * (W_up[e_p] @ x[t_p])     grid (P, I / BLOCK_ROWS)
    down:     y[p] = W_down[e_p] @ h[p]                                       grid (P, H / BLOCK_ROWS)

Accumulation is fp32, one program per output tile, no atomics: deterministic. The caller combines
y with the routing weights in a fixed order. Addresses travel as 64-bit integers (pool and host
bases) and become pointers in the kernel, so one launch covers both memories.

Only SiLU-gated experts (Qwen3-MoE and its relatives) are compiled; other activations take the
torch path (vismmoe_kt.runtime.table_experts).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch twin runs instead
    triton = tl = None

# (output rows per program, input elements per loaded tile, warps) for each kernel; `decode_kernel_bench
# --tune` measures the alternatives on the GPU (BENCHMARKS.md has the figures these come from)
GATE_UP_CONFIG = (4, 512, 2)
DOWN_CONFIG = (16, 256, 2)
# lookahead prefetch copies: programs (few, so the layers computing meanwhile keep the GPU) and the
# elements each moves per iteration (16 KiB of BF16: enough bytes in flight to keep PCIe busy)
PREFETCH_PROGRAMS = 32
PREFETCH_CHUNK = 8192
STAGE_CHUNK = 4096  # 4-byte words per program of a Q8_0 miss's staging copy (16 KiB in flight each)
# quantized slabs: each format's kernel code (`_dot`) and its bytes per 256 weights of a row
TILE_KINDS = {"q8_0": 8, "q4_0": 40, "q4_k": 4, "q5_k": 5, "q6_k": 6}
# Q4_K's GEMVs read the quant bytes as 32-bit words (kind 44) where this is set; `decode_kernel_bench`
# times both readings
Q4K_WORD_LOADS = True
TILE_BYTES = {"q8_0": 8 * 34, "q4_0": 8 * 18, "q4_k": 144, "q5_k": 176, "q6_k": 210}
# (rows per program, warps) of the quantized GEMVs per format, from `decode_kernel_bench --tune` on an H200
# (us per layer, 8 pairs: q8_0 42.6 at (4, 1) vs 83.9 at (16, 4); q4_k 66.6, 53.7 read by words; q5_k 68.1). q4_0 shares q8_0's
# 32-weight blocks and q6_k q5_k's super-blocks: untuned, they take their neighbour's
QUANTIZED_CONFIGS = {"q8_0": (4, 1), "q4_0": (4, 1), "q4_k": (8, 2), "q5_k": (8, 1), "q6_k": (8, 1)}

_DTYPES = {}
if tl is not None:
    _DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _gate_up_kernel(x_ptr, ids_ptr, slots_ptr, land_ptr, h_ptr, pool_addr, host_addr, slab_elems, block_elems,
                        TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, W_DTYPE: tl.constexpr,
                        ELEM_BYTES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        slot = tl.load(slots_ptr + pair).to(tl.int64)
        land = tl.load(land_ptr + pair).to(tl.int64)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        addr = tl.where(slot >= 0, pool_addr + slot * slab_elems * ELEM_BYTES,
                        host_addr + expert * block_elems * ELEM_BYTES)
        weights = addr.to(tl.pointer_type(W_DTYPE), bitcast=True)  # (2I, H) row-major: gate rows, then up rows
        # a miss with a landing slab also writes what it read there (read-through: one PCIe read fills the cache)
        target = (pool_addr + tl.maximum(land, 0) * slab_elems * ELEM_BYTES).to(tl.pointer_type(W_DTYPE), bitcast=True)
        token = pair // TOP_K
        row_ok = rows < I
        gate = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        up = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, H, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_ok = cols < H
            x = tl.load(x_ptr + token * H + cols, mask=col_ok, other=0.0).to(tl.float32)
            tile_ok = row_ok[:, None] & col_ok[None, :] & (slot != -3)  # a CPU pair reads nothing: h = 0
            gate_at = rows[:, None].to(tl.int64) * H + cols[None, :]
            up_at = (rows[:, None].to(tl.int64) + I) * H + cols[None, :]
            w_gate = tl.load(weights + gate_at, mask=tile_ok, other=0.0)
            w_up = tl.load(weights + up_at, mask=tile_ok, other=0.0)
            landing = tile_ok & (land >= 0)
            tl.store(target + gate_at, w_gate, mask=landing)
            tl.store(target + up_at, w_up, mask=landing)
            gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
            up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + pair * I + rows, h, mask=row_ok)

    @triton.jit
    def _down_kernel(h_ptr, ids_ptr, slots_ptr, land_ptr, y_ptr, pool_addr, host_addr, slab_elems, block_elems,
                     H: tl.constexpr, I: tl.constexpr, W_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        slot = tl.load(slots_ptr + pair).to(tl.int64)
        land = tl.load(land_ptr + pair).to(tl.int64)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        # the host block is [gate_up (2I x H) | down (H x I)]: down starts 2IH elements in
        addr = tl.where(slot >= 0, pool_addr + slot * slab_elems * ELEM_BYTES,
                        host_addr + (expert * block_elems + 2 * I * H) * ELEM_BYTES)
        weights = addr.to(tl.pointer_type(W_DTYPE), bitcast=True)  # (H, I) row-major
        target = (pool_addr + tl.maximum(land, 0) * slab_elems * ELEM_BYTES).to(tl.pointer_type(W_DTYPE), bitcast=True)
        row_ok = rows < H
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, I, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_ok = cols < I
            h = tl.load(h_ptr + pair * I + cols, mask=col_ok, other=0.0)
            tile_ok = row_ok[:, None] & col_ok[None, :] & (slot != -3)  # a CPU pair reads nothing: y = 0
            at = rows[:, None].to(tl.int64) * I + cols[None, :]
            w = tl.load(weights + at, mask=tile_ok, other=0.0)
            tl.store(target + at, w, mask=tile_ok & (land >= 0))
            acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
        tl.store(y_ptr + pair * H + rows, acc, mask=row_ok)


    @triton.jit
    def _fetch_q8_kernel(ids_ptr, need_ptr, target_ptr, pool_ptr, host_addr, block_bytes, part_bytes, slab_elems,
                         part_elems, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         QBLOCKS: tl.constexpr, Q4: tl.constexpr = False):
        """One part (gate_up or down) of the needed pairs' Q8_0 blocks, read at `host_addr` (the staging
        rows: `ids` index them) and written dequantized into their slabs: program (pair, tile of rows,
        QBLOCKS blocks of columns). One step per program, no loop: a miss is on the critical path, and
        many short programs finish sooner than a few that walk a row's blocks one after another."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        need = tl.load(need_ptr + pair) != 0
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        target = tl.load(target_ptr + pair).to(tl.int64)
        QB_BYTES: tl.constexpr = 18 if Q4 else 34  # Q4_0: scale + 16 bytes of two nibbles; Q8_0: scale + 32 int8
        row_bytes: tl.constexpr = COLS // 32 * QB_BYTES
        base = host_addr + expert * block_bytes + part_bytes
        lane = tl.arange(0, 32)
        row_ok = (rows < ROWS) & need
        qb = tl.program_id(2) * QBLOCKS + tl.arange(0, QBLOCKS)
        ok = row_ok[:, None] & (qb < COLS // 32)[None, :]                          # (R, Q)
        at = rows[:, None].to(tl.int64) * row_bytes + qb[None, :].to(tl.int64) * QB_BYTES  # each block's first byte
        scale = tl.load((base + at).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0)
        if Q4:  # weight j: the low nibble of byte j (j < 16), else the high nibble of byte j - 16
            packed = tl.load((base + at[:, :, None] + 2 + (lane % 16)[None, None, :]).to(
                tl.pointer_type(tl.uint8), bitcast=True), mask=ok[:, :, None], other=0)
            nibble = (packed.to(tl.int32) >> (4 * (lane // 16))[None, None, :]) & 0xF
            weights = (nibble - 8).to(tl.float32) * scale.to(tl.float32)[:, :, None]
        else:
            values = tl.load((base + at[:, :, None] + 2 + lane[None, None, :]).to(
                tl.pointer_type(tl.int8), bitcast=True), mask=ok[:, :, None], other=0)
            weights = values.to(tl.float32) * scale.to(tl.float32)[:, :, None]
        cols = qb[None, :, None].to(tl.int64) * 32 + lane[None, None, :]
        out = pool_ptr + target * slab_elems + part_elems + rows[:, None, None].to(tl.int64) * COLS + cols
        tl.store(out, weights.to(pool_ptr.dtype.element_ty), mask=ok[:, :, None])

    @triton.jit
    def _kquant_weights(at, at8, w, ok, FIFTH_BIT: tl.constexpr):
        """Q4_K (q4k.py) or, with FIFTH_BIT, Q5_K (q5k.py): the 256 weights of the super-blocks at `at`
        (R, 1). Weight w's sub-block s = w // 32 takes its 6-bit scale and minimum from the packed 12
        bytes; its low 4 bits are a nibble of byte 32 * (w // 64) + w % 32 of the quants (low for the
        first 32 of each 64, high for the next), Q5_K's fifth bit is bit s of qh[w % 32]."""
        s = w // 32
        d = tl.load(at.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        dmin = tl.load((at + 2).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        scale, minimum = _scales_mins(at8, s, ok)                                # (R, 256): each weight's sub-block's
        QS: tl.constexpr = 48 if FIFTH_BIT else 16                              # Q5_K's qh[32] come first
        q_byte = QS + 32 * (w // 64) + w % 32
        q = (tl.load(at8 + q_byte[None, :], mask=ok, other=0).to(tl.int32) >> (4 * (s % 2))[None, :]) & 0xF
        if FIFTH_BIT:
            q = q | (((tl.load(at8 + (16 + w % 32)[None, :], mask=ok, other=0).to(tl.int32) >> s[None, :]) & 1) << 4)
        return d * scale * q.to(tl.float32) - dmin * minimum

    @triton.jit
    def _q6k_weights(at, at8, w, ok):
        """Q6_K (q6k.py; a Q4_K_M file's down experts in some layers): weight w is, in its half
        h = w // 128 at r = w % 128 (quarter q = r // 32, l = r % 32), nibble q // 2 of
        ql[64 h + 32 (q % 2) + l] with bits 2q of qh[32 h + l] above it, minus 32, times the int8
        scales[8 h + l // 16 + 2 q] and d."""
        h = w // 128
        q = (w % 128) // 32
        lane = w % 32
        d = tl.load((at + 208).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        low = (tl.load(at8 + (64 * h + 32 * (q % 2) + lane)[None, :], mask=ok, other=0).to(tl.int32)
               >> (4 * (q // 2))[None, :]) & 0xF
        high = (tl.load(at8 + (128 + 32 * h + lane)[None, :], mask=ok, other=0).to(tl.int32) >> (2 * q)[None, :]) & 3
        scale = tl.load((at + (192 + 8 * h + lane // 16 + 2 * q)[None, :]).to(tl.pointer_type(tl.int8), bitcast=True),
                        mask=ok, other=0)
        return d * scale.to(tl.float32) * ((low | (high << 4)) - 32).to(tl.float32)

    @triton.jit
    def _fetch_kquant_kernel(ids_ptr, need_ptr, target_ptr, pool_ptr, host_addr, block_bytes, part_bytes, slab_elems,
                             part_elems, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                             KIND: tl.constexpr = 4):
        """`_fetch_q8_kernel` for the k-quants' 256-weight super-blocks, KIND 4 (Q4_K, 144 bytes), 5 (Q5_K,
        176) or 6 (Q6_K, 210): program (pair, tile of rows, super-block column), its 256 weights decoded
        at once."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        need = tl.load(need_ptr + pair) != 0
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        target = tl.load(target_ptr + pair).to(tl.int64)
        SB_BYTES: tl.constexpr = 210 if KIND == 6 else (176 if KIND == 5 else 144)
        row_bytes: tl.constexpr = COLS // 256 * SB_BYTES
        base = host_addr + expert * block_bytes + part_bytes
        w = tl.arange(0, 256)
        row_ok = (rows < ROWS) & need
        out_rows = pool_ptr + target * slab_elems + part_elems + rows[:, None].to(tl.int64) * COLS
        sb = tl.program_id(2)
        at = base + rows[:, None].to(tl.int64) * row_bytes + sb * SB_BYTES   # (R, 1): the super-block's first byte
        ok = row_ok[:, None]
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        if KIND == 6:
            weights = _q6k_weights(at, at8, w, ok)
        else:
            weights = _kquant_weights(at, at8, w, ok, KIND == 5)
        tl.store(out_rows + sb * 256 + w[None, :], weights.to(pool_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _stage_kernel(ids_ptr, need_ptr, target_ptr, staging_ptr, host_addr, block_words, row_words,
                      CHUNK: tl.constexpr):
        """The needed pairs' whole blocks (as 4-byte words) from the mapped host store into device rows
        (`target`: each pair's row of `staging`, rows `row_words` apart): contiguous, wide reads, so
        PCIe moves the blocks' bytes once and at speed (a dequantizing read of 34-byte blocks in place
        would issue many small, strided reads). The rows are a staging area, or quantized slabs."""
        pair = tl.program_id(0)
        start = tl.program_id(1) * CHUNK
        need = tl.load(need_ptr + pair) != 0
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        row = tl.load(target_ptr + pair).to(tl.int64)
        offsets = start + tl.arange(0, CHUNK)
        inside = (offsets < block_words) & need
        src = (host_addr + expert * block_words * 4).to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(staging_ptr + row * row_words + offsets, tl.load(src + offsets, mask=inside), mask=inside)

    @triton.jit
    def _scales_mins(at8, s, ok):
        """The k-quants' 6-bit scales and minimums of sub-blocks `s` (S,) from the 12 packed bytes after d
        and dmin, as (R, S) floats (q4k.py's `_scales_and_mins`)."""
        low = s < 4
        a = tl.load(at8 + 4 + s[None, :], mask=ok, other=0).to(tl.int32)                      # scales[s]
        b = tl.load(at8 + 8 + s[None, :], mask=ok, other=0).to(tl.int32)                      # scales[s + 4]
        c = tl.load(at8 + 4 + tl.where(low, 0, s - 4)[None, :], mask=ok, other=0).to(tl.int32)  # scales[s - 4]
        scale = tl.where(low[None, :], a & 63, (b & 0xF) | ((c >> 6) << 4))
        minimum = tl.where(low[None, :], b & 63, (b >> 4) | ((a >> 6) << 4))
        return scale.to(tl.float32), minimum.to(tl.float32)

    @triton.jit
    def _kquant_dot(at, xs, ok, FIFTH_BIT: tl.constexpr):
        """Q4_K (or, with FIFTH_BIT, Q5_K) super-blocks at `at` (R, 1) dotted with the 256 values at `xs`:
        (R,) floats. Sub-blocks 2j and 2j + 1 share the 32 quant bytes 32j.. (low and high nibbles), so
        each is summed against its 32 inputs first and scaled once (d * scale, dmin * min times the
        inputs' sum): whole bytes loaded, no per-weight scale."""
        j = tl.arange(0, 4)
        lane = tl.arange(0, 32)
        x_even = tl.load(xs + (2 * j)[:, None] * 32 + lane[None, :]).to(tl.float32)     # (4, 32): sub-blocks 0, 2, ..
        x_odd = tl.load(xs + (2 * j + 1)[:, None] * 32 + lane[None, :]).to(tl.float32)  # 1, 3, ..
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
        dot_even = tl.sum(low.to(tl.float32) * x_even[None, :, :], axis=2)               # (R, 4)
        dot_odd = tl.sum(high.to(tl.float32) * x_odd[None, :, :], axis=2)
        sum_even, sum_odd = tl.sum(x_even, axis=1), tl.sum(x_odd, axis=1)                 # (4,)
        terms = d * (scale_even * dot_even + scale_odd * dot_odd) - dmin * (min_even * sum_even[None, :]
                                                                            + min_odd * sum_odd[None, :])
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
        x_even = tl.load(xs + (2 * j)[:, None, None] * 32 + lanes).to(tl.float32)        # (4, 8, 4)
        x_odd = tl.load(xs + (2 * j + 1)[:, None, None] * 32 + lanes).to(tl.float32)
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        d = tl.load(at.to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)      # (R, 1)
        dmin = tl.load((at + 2).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0).to(tl.float32)
        scale_even, min_even = _scales_mins(at8, 2 * j, ok)                              # (R, 4)
        scale_odd, min_odd = _scales_mins(at8, 2 * j + 1, ok)
        words = tl.load((at + 16).to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]
                        + (j[:, None] * 8 + w[None, :])[None, :, :], mask=ok[:, :, None], other=0)  # (R, 4, 8)
        shifted = words[:, :, :, None] >> (8 * b)[None, None, None, :]                  # (R, 4, 8, 4)
        low = (shifted & 0xF).to(tl.float32)
        high = ((shifted >> 4) & 0xF).to(tl.float32)
        dot_even = tl.sum(tl.sum(low * x_even[None, :, :, :], axis=3), axis=2)          # (R, 4)
        dot_odd = tl.sum(tl.sum(high * x_odd[None, :, :, :], axis=3), axis=2)
        sum_even = tl.sum(tl.sum(x_even, axis=2), axis=1)                                # (4,)
        sum_odd = tl.sum(tl.sum(x_odd, axis=2), axis=1)
        terms = d * (scale_even * dot_even + scale_odd * dot_odd) - dmin * (min_even * sum_even[None, :]
                                                                            + min_odd * sum_odd[None, :])
        return tl.sum(terms, axis=1)

    @triton.jit
    def _q8_dot(at, xs, ok, Q4: tl.constexpr):
        """Eight Q8_0 blocks (34 bytes: an fp16 scale, 32 int8) or, with Q4, Q4_0 blocks (18: the scale, 16
        bytes of nibbles, weight l the low nibble of byte l < 16, else the high nibble of byte l - 16,
        minus 8) at `at` (R, 1) dotted with the 256 values at `xs`: (R,) floats, one scale per block."""
        QB: tl.constexpr = 18 if Q4 else 34
        blocks = tl.arange(0, 8)
        lane = tl.arange(0, 32)
        x = tl.load(xs + blocks[:, None] * 32 + lane[None, :]).to(tl.float32)           # (8, 32)
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
        return tl.sum(scale * tl.sum(q.to(tl.float32) * x[None, :, :], axis=2), axis=1)

    @triton.jit
    def _dot(at, xs, ok, KIND: tl.constexpr):
        """256 weights per row, from the blocks at `at` (R, 1) in the format `KIND` (TILE_KINDS), dotted
        with the 256 values at `xs`: (R,) floats."""
        if KIND == 6:  # Q6_K (a Q4_K_M file's down experts in some layers): decoded weight by weight
            w = tl.arange(0, 256)
            x = tl.load(xs + w).to(tl.float32)
            result = tl.sum(_q6k_weights(at, at.to(tl.pointer_type(tl.uint8), bitcast=True), w, ok) * x[None, :], axis=1)
        elif KIND == 8 or KIND == 40:
            result = _q8_dot(at, xs, ok, KIND == 40)
        elif KIND == 44:
            result = _q4k_words_dot(at, xs, ok)
        else:
            result = _kquant_dot(at, xs, ok, KIND == 5)
        return result

    @triton.jit
    def _gate_up_q_kernel(x_ptr, slots_ptr, h_ptr, pool_addr, slab_bytes, TOP_K: tl.constexpr, H: tl.constexpr,
                          I: tl.constexpr, KIND: tl.constexpr, SB_BYTES: tl.constexpr, BLOCK_ROWS: tl.constexpr):
        """`_gate_up_kernel` for quantized slabs: each pair's weights decoded from its slab's blocks as
        they are read, one 256-weight super-block (or eight 32-weight blocks) of each row a step (every
        pair reads a slab: misses were staged into theirs)."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        slot = tl.load(slots_ptr + pair).to(tl.int64)
        base = pool_addr + tl.maximum(slot, 0) * slab_bytes
        ROW_BYTES: tl.constexpr = H // 256 * SB_BYTES
        token = pair // TOP_K
        row_ok = rows < I
        ok = row_ok[:, None] & (slot >= 0)
        gate = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        up = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for sb in range(0, H // 256):
            xs = x_ptr + token * H + sb * 256
            gate_at = base + rows[:, None].to(tl.int64) * ROW_BYTES + sb * SB_BYTES
            up_at = base + (rows[:, None].to(tl.int64) + I) * ROW_BYTES + sb * SB_BYTES
            gate += _dot(gate_at, xs, ok, KIND)
            up += _dot(up_at, xs, ok, KIND)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + pair * I + rows, h, mask=row_ok)

    @triton.jit
    def _down_q_kernel(h_ptr, slots_ptr, y_ptr, pool_addr, slab_bytes, part_bytes, H: tl.constexpr,
                       I: tl.constexpr, KIND: tl.constexpr, SB_BYTES: tl.constexpr, BLOCK_ROWS: tl.constexpr):
        """`_down_kernel` for quantized slabs (the down part starts `part_bytes` into the slab)."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        slot = tl.load(slots_ptr + pair).to(tl.int64)
        base = pool_addr + tl.maximum(slot, 0) * slab_bytes + part_bytes
        ROW_BYTES: tl.constexpr = I // 256 * SB_BYTES
        row_ok = rows < H
        ok = row_ok[:, None] & (slot >= 0)
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for sb in range(0, I // 256):
            at = base + rows[:, None].to(tl.int64) * ROW_BYTES + sb * SB_BYTES
            acc += _dot(at, h_ptr + pair * I + sb * 256, ok, KIND)
        tl.store(y_ptr + pair * H + rows, acc, mask=row_ok)

    @triton.jit
    def _claim(table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, rows, ids, wanted, owners,
               E1: tl.constexpr, R: tl.constexpr, LANES: tl.constexpr):
        """DecodeTable._claim: each wanted pair's entry NOT_RESIDENT -> ARRIVING (compare-and-swap:
        a layer's own miss and a prefetch of the same expert race for it), then its row's next
        landing slot (atomic add); a claim that finds no slot left is undone. Returns the slabs."""
        entry = table_ptr + rows * E1 + ids
        # lanes not wanted compare against a value no entry holds, so their swap never happens
        old = tl.atomic_cas(entry, tl.where(wanted, -1, -7).to(tl.int64), tl.full([LANES], -2, tl.int64))
        got = wanted & (old == -1)
        rank = tl.atomic_add(used_ptr + rows, got.to(tl.int64), mask=got)
        lands = got & (rank < tl.load(count_ptr + rows, mask=got, other=0))
        tl.store(entry, tl.full([LANES], -1, tl.int64), mask=got & (lands == 0))  # undo: nothing will land
        slab = tl.load(landing_ptr + rows * R + rank, mask=lands, other=-1)
        tl.store(owner_ptr + rows * (R + 1) + rank, owners, mask=lands)
        return tl.where(lands, slab, -1)

    @triton.jit
    def _plan_kernel(ids_ptr, table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, routed_ptr, read_ptr, slots_ptr,
                     land_ptr, quota_ptr, row, E1: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr,
                     STRIDE: tl.constexpr):
        """DecodeTable.lookup for one token per program (program t: pairs t K..): slots, claimed landing
        slabs, the step's records; the last quota[m] of a token's m misses go to the CPU (slot -3: no
        claim, no host read). Tokens of one step claim through the same atomics, so of two tokens
        missing one expert, one lands it and the other reads it from the host."""
        k = tl.arange(0, KP)
        ok = k < K
        first = tl.program_id(0) * K
        ids = tl.load(ids_ptr + first + k, mask=ok, other=0).to(tl.int64)
        slots = tl.load(table_ptr + row * E1 + ids, mask=ok, other=0, volatile=True)  # a prefetch may publish
        miss = ok & (slots == -1)
        rank = tl.cumsum(miss.to(tl.int64), 0) - 1
        misses = tl.sum(miss.to(tl.int64), 0)
        on_cpu = miss & (rank >= misses - tl.load(quota_ptr + misses))  # the last quota[m] misses
        slots = tl.where(on_cpu, -3, slots)
        rows = tl.zeros([KP], tl.int64) + row
        land = _claim(table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, rows, ids, miss & (on_cpu == 0), ids,
                      E1, R, KP)
        tl.store(slots_ptr + first + k, slots, mask=ok)
        tl.store(land_ptr + first + k, land, mask=ok)
        tl.store(routed_ptr + row * STRIDE + first + k, ids, mask=ok)  # the records' rows: STRIDE apart
        tl.store(read_ptr + row * STRIDE + first + k, slots, mask=ok)

    @triton.jit
    def _combine_kernel(y_ptr, w_ptr, out_ptr, ids_ptr, land_ptr, table_ptr, row, H,
                        E1: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, PUBLISH: tl.constexpr,
                        BLOCK: tl.constexpr):
        """out[t] = sum over k in order of w[t, k] * y[t K + k] (deterministic); with PUBLISH, the first
        program also points the table at what landed (DecodeTable.publish)."""
        token = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            w = tl.load(w_ptr + token * K + k).to(tl.float32)
            acc += w * tl.load(y_ptr + (token * K + k) * H + cols, mask=ok, other=0.0)
        tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
        if PUBLISH:  # each token's first program publishes that token's landings
            if tl.program_id(0) == 0:
                lane = tl.arange(0, KP)
                valid = lane < K
                ids = tl.load(ids_ptr + token * K + lane, mask=valid, other=0).to(tl.int64)
                land = tl.load(land_ptr + token * K + lane, mask=valid, other=-1)
                tl.store(table_ptr + row * E1 + ids, land, mask=valid & (land >= 0))

    @triton.jit
    def _prefetch_claim_kernel(rows_ptr, ids_ptr, table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, slab_ptr, B,
                               E: tl.constexpr, R: tl.constexpr, BP: tl.constexpr):
        """Lookahead candidates (row, expert; -1: none) claim entries and landing slots, in their order."""
        lane = tl.arange(0, BP)
        ok = lane < B
        ids = tl.load(ids_ptr + lane, mask=ok, other=-1).to(tl.int64)
        rows = tl.load(rows_ptr + lane, mask=ok, other=0).to(tl.int64)
        valid = ok & (ids >= 0)
        ids = tl.maximum(ids, 0)
        slots = tl.load(table_ptr + rows * (E + 1) + ids, mask=valid, other=0, volatile=True)
        slab = _claim(table_ptr, landing_ptr, count_ptr, used_ptr, owner_ptr, rows, ids, valid & (slots == -1),
                      ids + E, E + 1, R, BP)
        tl.store(slab_ptr + lane, slab, mask=ok)

    @triton.jit
    def _prefetch_copy_kernel(rows_ptr, ids_ptr, slab_ptr, host_ptr, gate_up_addr, down_addr, B, block_elems,
                              ROUNDS: tl.constexpr, W_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, GATE_UP: tl.constexpr,
                              CHUNK: tl.constexpr, PROGRAMS: tl.constexpr):
        """Copy each claimed candidate's host block into its slab: a few programs, each looping over
        CHUNK-element pieces, so the copy leaves most of the GPU to the layers computing meanwhile."""
        chunks = (block_elems + CHUNK - 1) // CHUNK
        offsets = tl.arange(0, CHUNK)
        for round in range(ROUNDS):  # constant per model and candidate count
            work = tl.program_id(0) + round * PROGRAMS
            pair = tl.minimum(work // chunks, B - 1)
            slab = tl.load(slab_ptr + pair).to(tl.int64)
            if (slab >= 0) & (work < B * chunks):
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                row = tl.load(rows_ptr + pair).to(tl.int64)
                start = (work % chunks) * CHUNK  # chunks never straddle gate_up | down: CHUNK divides both
                src = (tl.load(host_ptr + row) + (expert * block_elems + start) * ELEM_BYTES).to(
                    tl.pointer_type(W_DTYPE), bitcast=True)
                dst = tl.where(start < GATE_UP, gate_up_addr + (slab * GATE_UP + start) * ELEM_BYTES,
                               down_addr + (slab * (block_elems - GATE_UP) + start - GATE_UP) * ELEM_BYTES)
                dst = dst.to(tl.pointer_type(W_DTYPE), bitcast=True)
                inside = start + offsets < block_elems
                tl.store(dst + offsets, tl.load(src + offsets, mask=inside), mask=inside)

    @triton.jit
    def _prefetch_publish_kernel(rows_ptr, ids_ptr, slab_ptr, table_ptr, B, E: tl.constexpr, BP: tl.constexpr):
        """After the copies (stream order): point the table at the prefetched slabs."""
        lane = tl.arange(0, BP)
        slab = tl.load(slab_ptr + lane, mask=lane < B, other=-1)
        ids = tl.load(ids_ptr + lane, mask=slab >= 0, other=0).to(tl.int64)
        rows = tl.load(rows_ptr + lane, mask=slab >= 0, other=0).to(tl.int64)
        tl.store(table_ptr + rows * (E + 1) + ids, slab, mask=slab >= 0)


def plan(table, row: int, ids: torch.Tensor, offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, land) for the T x K experts `ids` of T decode tokens (K = table.top_k) of one offloaded
    layer, in one launch; their records where DecodeTable.records(offset) says, token t's at t K on."""
    pairs, k = ids.numel(), table.top_k
    slots = torch.empty(pairs, dtype=torch.long, device=ids.device)
    land = torch.empty(pairs, dtype=torch.long, device=ids.device)
    if pairs % k or (pairs > k and offset is None):
        raise ValueError(f"plan of {pairs} pairs: whole tokens of {k}, and several only into a batched step's records")
    routed, read = table.records(offset)  # views: row r at r * stride
    _plan_kernel[(pairs // k,)](ids, table.slots, table.landing, table.count, table.used, table.owner, routed, read,
                                slots, land, table.cpu_quota, row, E1=table.slots.shape[1], K=k,
                                KP=triton.next_power_of_2(k), R=table.landing_slots, STRIDE=routed.stride(0))
    return slots, land


def combine(y: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype, table=None, row: int = 0,
            ids: torch.Tensor | None = None, land: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H) in `dtype` from the (P, H) pair outputs; with `table`, also its publish step."""
    tokens, k = top_k_weights.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=y.device)
    publish = table is not None
    block = 1024
    _combine_kernel[(triton.cdiv(hidden, block), tokens)](
        y, top_k_weights.contiguous(), out, ids if publish else y, land if publish else y,
        table.slots if publish else y, row, hidden, E1=table.slots.shape[1] if publish else 1, K=k,
        KP=triton.next_power_of_2(k), PUBLISH=publish, BLOCK=block)
    return out


def fetch_q8(ids: torch.Tensor, need: torch.Tensor, target: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor],
             host_address: int, block_bytes: int, inter: int, hidden: int, block_rows: int = 16,
             qblocks: int = 8, fmt: str = "q8_0", down_fmt: str | None = None, staged: bool = False) -> None:
    """TableExperts.fetch_dequantized in three launches: the needed pairs' blocks (Q8_0, Q4_0 or Q4_K:
    `fmt`) copied from the mapped host store to device staging, then dequantized into their target slabs
    (gate_up, down); `down_fmt`: the down part's own format where it differs (Q6_K in a Q4_K_M file).
    `staged`: the blocks are on the device already (quantized slabs: `ids` are rows of `host_address`,
    `block_bytes` apart), and are only dequantized."""
    from .store import PART_CODECS

    down_fmt = down_fmt or fmt
    p = ids.numel()
    gate_up, down = pools
    need = need.to(torch.int8)
    if block_bytes % 4:
        raise ValueError(f"a {fmt} block of {block_bytes} bytes is not whole 4-byte words")
    # first the blocks' bytes over PCIe into device memory, then dequantized from there
    if staged:
        rows_of_staging, staging_address = ids, host_address
    else:
        words = block_bytes // 4
        staging = torch.empty(p, words, dtype=torch.int32, device=ids.device)
        rows_of_staging = torch.arange(p, device=ids.device)  # pair i's block is staging row i
        _stage_kernel[(p, triton.cdiv(words, STAGE_CHUNK))](ids, need, rows_of_staging, staging, host_address, words,
                                                            words, CHUNK=STAGE_CHUNK)
        staging_address = staging.data_ptr()
    for pool, rows, cols, part_bytes, part_fmt in (
            (gate_up, 2 * inter, hidden, 0, fmt),
            (down, hidden, inter, 2 * inter * PART_CODECS[fmt].row_bytes(hidden), down_fmt)):
        args = (rows_of_staging, need, target, pool, staging_address, block_bytes, part_bytes, pool[0].numel(), 0)
        if part_fmt in ("q4_k", "q5_k", "q6_k"):  # 256-weight super-blocks
            _fetch_kquant_kernel[(p, triton.cdiv(rows, block_rows), cols // 256)](
                *args, ROWS=rows, COLS=cols, BLOCK_ROWS=block_rows, KIND=int(part_fmt[1]))
        else:
            _fetch_q8_kernel[(p, triton.cdiv(rows, block_rows), triton.cdiv(cols // 32, qblocks))](
                *args, ROWS=rows, COLS=cols, BLOCK_ROWS=block_rows, QBLOCKS=qblocks, Q4=part_fmt == "q4_0")


def stage_blocks(ids: torch.Tensor, need: torch.Tensor, target: torch.Tensor, rows: torch.Tensor, host_address: int,
                 block_bytes: int) -> None:
    """The needed pairs' blocks (`block_bytes` each, at `host_address` + expert * block_bytes in mapped
    host memory) copied as they are into rows `target` of `rows` (uint8, (N, row bytes)): quantized
    slabs, which the `_q` kernels read in place."""
    if block_bytes % 4 or rows.shape[1] % 4:
        raise ValueError(f"blocks of {block_bytes} bytes into rows of {rows.shape[1]}: not whole 4-byte words")
    words = block_bytes // 4
    _stage_kernel[(ids.numel(), triton.cdiv(words, STAGE_CHUNK))](
        ids, need.to(torch.int8), target, rows.view(torch.int32), host_address, words, rows.shape[1] // 4,
        CHUNK=STAGE_CHUNK)


def quantized_experts(x: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, fmt: str, down_fmt: str, inter: int,
                      hidden: int, top_k: int, config: tuple[int, int] | None = None) -> torch.Tensor:
    """(P, H) fp32 expert outputs, unweighted, each pair's weights decoded from its quantized slab (a row
    of `pool`, uint8 (S, slab bytes): gate and up rows, then down rows, in `fmt` / `down_fmt` blocks;
    every slot >= 0). H and I must be multiples of 256 (whole 256-weight tiles in every format)."""
    rows_up, warps_up = config or QUANTIZED_CONFIGS[fmt]
    rows_down, warps_down = config or QUANTIZED_CONFIGS[down_fmt]
    pairs = slots.numel()
    h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    part_bytes = 2 * inter * (hidden // 256) * TILE_BYTES[fmt]
    _gate_up_q_kernel[(pairs, triton.cdiv(inter, rows_up))](
        x.contiguous(), slots, h, pool.data_ptr(), pool.shape[1], TOP_K=top_k, H=hidden, I=inter,
        KIND=_kind(fmt), SB_BYTES=TILE_BYTES[fmt], BLOCK_ROWS=rows_up, num_warps=warps_up)
    _down_q_kernel[(pairs, triton.cdiv(hidden, rows_down))](
        h, slots, y, pool.data_ptr(), pool.shape[1], part_bytes, H=hidden, I=inter, KIND=_kind(down_fmt),
        SB_BYTES=TILE_BYTES[down_fmt], BLOCK_ROWS=rows_down, num_warps=warps_down)
    return y


def _kind(fmt: str) -> int:
    """The GEMVs' code path for a format: Q4_K by 32-bit words where Q4K_WORD_LOADS is set."""
    return 44 if fmt == "q4_k" and Q4K_WORD_LOADS else TILE_KINDS[fmt]


def copy_chunk(gate_up_elems: int, down_elems: int, largest: int = PREFETCH_CHUNK) -> int:
    """The largest power of two up to `largest` that divides both parts of a block (a chunk never
    straddles the two pools)."""
    chunk = 1
    while chunk * 2 <= largest and gate_up_elems % (chunk * 2) == 0 and down_elems % (chunk * 2) == 0:
        chunk *= 2
    return chunk


def prefetch(table, rows: torch.Tensor, ids: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor],
             host_addresses: torch.Tensor, programs: int = PREFETCH_PROGRAMS) -> torch.Tensor:
    """DecodeTable.prefetch in three launches: claim, copy (zero-copy reads of the mapped host store
    by `programs` programs), publish. Returns each candidate's slab (-1: not copied)."""
    b = ids.numel()
    gate_up, down = pools
    slab = torch.empty(b, dtype=torch.long, device=ids.device)
    bp = triton.next_power_of_2(max(b, 2))
    experts = table.num_experts
    _prefetch_claim_kernel[(1,)](rows, ids, table.slots, table.landing, table.count, table.used, table.owner, slab, b,
                                 E=experts, R=table.landing_slots, BP=bp)
    gate_up_elems, down_elems = gate_up[0].numel(), down[0].numel()
    chunk = copy_chunk(gate_up_elems, down_elems)
    rounds = triton.cdiv(b * triton.cdiv(gate_up_elems + down_elems, chunk), programs)
    _prefetch_copy_kernel[(programs,)](
        rows, ids, slab, host_addresses, gate_up.data_ptr(), down.data_ptr(), b, gate_up_elems + down_elems, ROUNDS=rounds,
        W_DTYPE=_DTYPES[gate_up.dtype], ELEM_BYTES=gate_up.element_size(), GATE_UP=gate_up_elems,
        CHUNK=chunk, PROGRAMS=programs, num_warps=4)
    _prefetch_publish_kernel[(1,)](rows, ids, slab, table.slots, b, E=experts, BP=bp)
    return slab


def available(dtype: torch.dtype) -> bool:
    return triton is not None and dtype in _DTYPES


def experts_where_they_lie(x: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                           pools: tuple[torch.Tensor, torch.Tensor], host_addr: int, block_elems: int,
                           top_k: int, gate_up_config: tuple[int, int, int] | None = None,
                           down_config: tuple[int, int, int] | None = None, parts: str = "both") -> torch.Tensor:
    """(P, H) fp32 expert outputs, unweighted. x (T, H); ids, slots, land (P,) with P = T * top_k
    (land: the slab a missing pair's weights are written to as they are read, or -1); pools: gate_up
    (S, 2I, H) and down (S, H, I) on the device; host_addr: the device address of the layer's host
    blocks (E, block_elems), mapped page-locked memory (0 when every slot is resident).
    The configs and `parts` (both | gate_up | down) are for the tuning benchmark."""
    gate_up, down = pools
    pairs, hidden, inter = ids.numel(), gate_up.shape[2], gate_up.shape[1] // 2
    h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    common = dict(H=hidden, I=inter, W_DTYPE=_DTYPES[gate_up.dtype], ELEM_BYTES=gate_up.element_size())
    rows, cols, warps = gate_up_config or GATE_UP_CONFIG
    if parts != "down":
        _gate_up_kernel[(pairs, triton.cdiv(inter, rows))](
            x.contiguous(), ids, slots, land, h, gate_up.data_ptr(), host_addr, gate_up[0].numel(), block_elems,
            TOP_K=top_k, BLOCK_ROWS=rows, BLOCK_COLS=cols, num_warps=warps, **common)
    rows, cols, warps = down_config or DOWN_CONFIG
    if parts != "gate_up":
        _down_kernel[(pairs, triton.cdiv(hidden, rows))](
            h, ids, slots, land, y, down.data_ptr(), host_addr, down[0].numel(), block_elems,
            BLOCK_ROWS=rows, BLOCK_COLS=cols, num_warps=warps, **common)
    return y
