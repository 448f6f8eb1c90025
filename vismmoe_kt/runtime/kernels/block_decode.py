"""The quantized block formats' weights decoded in Triton: jit helpers the dequantizing fetch
(dequantize.py), the quantized GEMVs (quantized_gemv.py, q4k_dp4a.py) and the quantized expert-major
kernels (quantized_major.py) share. Each decodes a row tile's weights from the bytes of its blocks as the
store's codecs lay them out (runtime/q4k.py, q5k.py, q6k.py); the torch codecs are their twins.
"""

from __future__ import annotations

from .triton_support import tl, triton

# each format's bytes per 256 weights of a row (eight 32-weight blocks for Q8_0 and Q4_0)
TILE_BYTES = {"q8_0": 8 * 34, "q4_0": 8 * 18, "q4_k": 144, "q5_k": 176, "q6_k": 210}

if tl is not None:
    @triton.jit
    def _nibble_float(v):
        """v & 0xF as fp32, exactly, without an int-to-float conversion: on sm_90 a conversion runs at an
        eighth of the FP32 rate (16 a clock an SM against 128), and the weight decoders convert every weight;
        2^23 (0x4B000000) with the nibble in its mantissa, less 2^23, is two full-rate instructions."""
        return ((v & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

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
    def _pair_slab(slots_ptr, table_ptr, pair, BY_EXPERT: tl.constexpr):
        """Where a GEMV's pair reads its blocks: the slab `slots_ptr` holds for it, or with BY_EXPERT the
        pair's expert, whose slab the layer's table row at `table_ptr` holds (a settled table: no lookup
        launch before the GEMVs)."""
        slot = tl.load(slots_ptr + pair).to(tl.int64)
        if BY_EXPERT:
            slot = tl.load(table_ptr + slot).to(tl.int64)
        return slot

    @triton.jit
    def _q4k_byte(word, k):
        """Byte k (a tensor of 0..3, broadcast against `word`) of little-endian 32-bit words."""
        return (word >> (8 * k)) & 0xFF

    @triton.jit
    def _q4k_scale_min(w0, w1, w2, s):
        """Sub-blocks `s`' 6-bit scales and minimums from the 12 scale bytes as 3 words: s < 4 reads bytes
        s and s + 4, else the values split between bytes s + 4 and s - 4 (q4k.py's `_scales_and_mins`)."""
        k = s % 4
        a, b, c = _q4k_byte(w0, k), _q4k_byte(w1, k), _q4k_byte(w2, k)
        scale = tl.where(s < 4, a & 63, (c & 0xF) | ((a >> 6) << 4))
        minimum = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
        return scale.to(tl.float32), minimum.to(tl.float32)

    @triton.jit
    def _q4k_header(head, k):
        """A tile of Q4_K super-blocks' headers, each read as its first 4 words `head` (R, S, 4) (`k`: 0..3):
        d and dmin (R, S), and the scales and minimums of sub-blocks 2j and 2j + 1, j = 0..3, as four (R, S, 4)."""
        d_bits = tl.sum(tl.where(k == 0, head, 0), axis=2)                             # (R, S)
        w0 = tl.sum(tl.where(k == 1, head, 0), axis=2)[:, :, None]                     # scale bytes 0-3
        w1 = tl.sum(tl.where(k == 2, head, 0), axis=2)[:, :, None]                     # 4-7
        w2 = tl.sum(tl.where(k == 3, head, 0), axis=2)[:, :, None]                     # 8-11
        d = (d_bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((d_bits >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        scale_even, min_even = _q4k_scale_min(w0, w1, w2, 2 * k[None, None, :])
        scale_odd, min_odd = _q4k_scale_min(w0, w1, w2, 2 * k[None, None, :] + 1)
        return d, dmin, scale_even, min_even, scale_odd, min_odd

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
