"""A decode step's per-head work and its attention in one kernel: split over the context, merged in place.

Shapes: R rows, Hq query heads, Hkv key/value heads, G = Hq / Hkv query heads per key/value head,
D head dim, n a row's cached positions (the new token is position n), S splits of the context.

After the stacked query/key/value GEMV (fused_attention.py) a decode step used to run two kernels
for the attention: one for the heads' RMSNorms, rotary and cache write, then SDPA, whose kernel for
one query row keeps a few programs busy for the whole context (about 10 us a layer on an H200 for
300 positions, where the keys and values are 0.3 MB: at bandwidth, well under a microsecond).
Here one launch does both, as flash-decoding does: a program per (row, key/value head, split)
    1. normalises and rotates its head group's G queries and its key head (the heads kernel's values,
       kept in registers), split 0 writing the new key and value into the slot cache;
    2. attends over its split of the row's cached positions (the G queries at once, on tensor cores:
       scores = Q K^T, an online softmax, P V), the split holding position n also the new token from
       registers, so no program reads a cache entry another program writes in the same launch;
    3. writes its partial result (the running max, the softmax's sum, the unnormalised output) and
       counts itself done on the (row, head) counter; the last of the S programs merges the S partials
       into the output and resets the counter for the next launch (or graph replay).
The merge reads other programs' partials: each program's stores are ordered before its count (a
barrier, then the counter's acquire-release atomic), and the merge reads past the SM's own cache.

The values follow SDPA's: fp32 scores of the dtype's query and keys, probabilities rounded to the
dtype before P V, fp32 accumulation, the output rounded once. The splits come from the step's shape
(rows, span): enough programs to fill the GPU, none past the span.
"""

from __future__ import annotations

import functools
import weakref

import torch
from kernel_launch import cdiv, next_power_of_2

from ..models.base import DecodeAttentionParts
from .slot_cache import SlotKVCache

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fused_attention.py's torch twin
    triton = tl = None

BLOCK_N = 64          # cached positions a program scores at a time
MAX_SPLITS = 32      # the merge unrolls over the splits
MIN_GROUP_ROWS = 16   # tl.dot's smallest M: a head group of G < 16 queries is padded to it


@functools.cache
def _processors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_count(rows: int, kv_heads: int, span: int, device: torch.device) -> int:
    """Splits of the context per (row, key/value head): about two programs per SM, a power of two,
    no split shorter than a block of positions."""
    processors = _processors(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8
    wanted = max(1, (2 * processors) // max(1, rows * kv_heads))
    splits = 1 << (wanted.bit_length() - 1)
    return max(1, min(splits, MAX_SPLITS, next_power_of_2(max(1, span // BLOCK_N))))


class SplitWorkspace:
    """The partial results and counters the kernel's programs share: made once per slot cache (a
    CUDA graph replays the same memory), sized for the cache's most rows and MAX_SPLITS."""

    def __init__(self, cache: SlotKVCache, heads: int, kv_heads: int, head_dim: int):
        rows, device = cache.max_rows, cache.device
        self.partials = torch.empty(rows, kv_heads, MAX_SPLITS, heads // kv_heads, head_dim, dtype=torch.float32,
                                    device=device)
        self.stats = torch.empty(rows, kv_heads, MAX_SPLITS, 2, heads // kv_heads, dtype=torch.float32, device=device)
        self.counters = torch.zeros(rows, kv_heads, dtype=torch.int32, device=device)  # back to 0 after each merge


_WORKSPACES: "weakref.WeakKeyDictionary[SlotKVCache, dict]" = weakref.WeakKeyDictionary()


def workspace(cache: SlotKVCache, heads: int, kv_heads: int, head_dim: int) -> SplitWorkspace:
    """One workspace per (cache, head shape): the layers run one after another, so they share it."""
    spaces = _WORKSPACES.setdefault(cache, {})
    key = (heads, kv_heads, head_dim)
    if key not in spaces:
        spaces[key] = SplitWorkspace(cache, heads, kv_heads, head_dim)
    return spaces[key]


def attend_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: DecodeAttentionParts,
                  cache: SlotKVCache, space: SplitWorkspace, splits: int | None = None) -> torch.Tensor:
    """(R, Hq D) attention outputs of the step's rows (`cache.active`), the new keys and values written
    into the cache at each row's position; `splits` (default: split_count) for tests."""
    rows = qkv.shape[0]
    group = p.heads // p.kv_heads
    splits = splits or split_count(rows, p.kv_heads, cache.span, qkv.device)
    if splits > MAX_SPLITS or rows > space.counters.shape[0]:
        raise ValueError(f"{rows} rows in {splits} splits do not fit the workspace")
    keys, values = cache.keys[p.layer_index], cache.values[p.layer_index]
    out = torch.empty(rows, p.heads * p.head_dim, dtype=qkv.dtype, device=qkv.device)
    _attend_kernel[(rows, p.kv_heads, splits)](
        qkv, qkv.stride(0), cos.contiguous(), sin.contiguous(), p.query_norm[0], p.key_norm[0],
        p.query_norm[1], p.key_norm[1], keys, values, keys.stride(0), keys.stride(1), keys.stride(2),
        cache.active, cache.lengths[p.layer_index], space.partials, space.stats, space.counters, out, p.scaling,
        HQ=p.heads, HKV=p.kv_heads, D=p.head_dim, G=group, GP=max(MIN_GROUP_ROWS, next_power_of_2(group)),
        SPLITS=splits, MAXS=MAX_SPLITS, BLOCK_N=BLOCK_N, ITERS=cdiv(cache.span, splits * BLOCK_N), num_warps=4)
    return out


if tl is not None:
    @triton.jit
    def _normed_rotated(x, x_partner, w, w_partner, rstd, cos, sin, first_half):
        """transformers' RMSNorm (statistics given: rstd) then the rotary embedding, rounding as torch
        rounds each element-wise op; `partner` values are those rotate_half brings to each place."""
        normed = (w.to(tl.float32) * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
        rotated = (w_partner.to(tl.float32) * (x_partner.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
        rotated = tl.where(first_half, -rotated.to(tl.float32), rotated.to(tl.float32))
        return ((normed.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
                + (rotated * sin).to(x.dtype).to(tl.float32)).to(x.dtype)

    @triton.jit
    def _attend_kernel(qkv_ptr, row_stride, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps_q, eps_k, k_cache, v_cache,
                       slot_stride, head_stride, pos_stride, slots_ptr, lengths_ptr, part_ptr, stat_ptr, count_ptr,
                       out_ptr, scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                       GP: tl.constexpr, SPLITS: tl.constexpr, MAXS: tl.constexpr, BLOCK_N: tl.constexpr,
                       ITERS: tl.constexpr):
        row = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        d = tl.arange(0, D)
        g = tl.arange(0, GP)
        g_ok = g < G
        partner = (d + D // 2) % D
        first_half = d < D // 2
        slot = tl.load(slots_ptr + row)
        n = tl.load(lengths_ptr + slot)                                   # cached positions; the new one is n
        base = qkv_ptr + row * row_stride
        cos = tl.load(cos_ptr + row * D + d).to(tl.float32)
        sin = tl.load(sin_ptr + row * D + d).to(tl.float32)

        # 1. the group's queries (GP, D) and its new key and value (D,), normed and rotated
        q_at = base + (kv * G + g)[:, None] * D
        x = tl.load(q_at + d[None, :], mask=g_ok[:, None], other=0.0)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps_q)[:, None]
        query = _normed_rotated(x, tl.load(q_at + partner[None, :], mask=g_ok[:, None], other=0.0),
                                tl.load(qn_ptr + d)[None, :], tl.load(qn_ptr + partner)[None, :], rstd,
                                cos[None, :], sin[None, :], first_half[None, :])
        k_at = base + (HQ + kv) * D
        kx = tl.load(k_at + d)
        kf = kx.to(tl.float32)
        key = _normed_rotated(kx, tl.load(k_at + partner), tl.load(kn_ptr + d), tl.load(kn_ptr + partner),
                              tl.rsqrt(tl.sum(kf * kf, axis=0) / D + eps_k), cos, sin, first_half)
        value = tl.load(base + (HQ + HKV + kv) * D + d)
        cache_at = slot * slot_stride + kv * head_stride
        if split == 0:
            tl.store(k_cache + cache_at + n * pos_stride + d, key)
            tl.store(v_cache + cache_at + n * pos_stride + d, value)

        # 2. this split's positions: [lo, hi) of the n + 1, cached ones from the cache, n from registers
        chunk = ((n + SPLITS) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = split * chunk
        hi = lo + chunk
        hi = tl.where(hi < n + 1, hi, n + 1)
        m_i = tl.full([GP], -1.0e30, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for step in range(ITERS):  # a fixed trip count (the span's): blocks past this split's end do nothing
            start = lo + step * BLOCK_N
            if start < hi:
                pos = start + tl.arange(0, BLOCK_N)
                cached = pos < tl.minimum(hi, n)
                at = cache_at + pos[:, None] * pos_stride + d[None, :]
                keys = tl.load(k_cache + at, mask=cached[:, None], other=0.0)
                scores = tl.dot(query, tl.trans(keys)) * scale             # (GP, BLOCK_N) fp32
                scores = tl.where(cached[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                alpha = tl.exp(m_i - m_new)
                probs = tl.exp(scores - m_new[:, None])
                l_i = l_i * alpha + tl.sum(probs, axis=1)
                vals = tl.load(v_cache + at, mask=cached[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(probs.to(vals.dtype), vals)
                m_i = m_new
        if (lo <= n) & (n < hi):
            score = tl.sum(query.to(tl.float32) * key.to(tl.float32)[None, :], axis=1) * scale
            m_new = tl.maximum(m_i, score)
            alpha = tl.exp(m_i - m_new)
            prob = tl.exp(score - m_new)
            l_i = l_i * alpha + prob
            acc = acc * alpha[:, None] + prob.to(value.dtype).to(tl.float32)[:, None] * value.to(tl.float32)[None, :]
            m_i = m_new

        # 3. one split: the output; else the partial, the count, and the last program's merge
        out_at = out_ptr + row * (HQ * D) + (kv * G + g)[:, None] * D + d[None, :]
        if SPLITS == 1:
            tl.store(out_at, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            part = (row * HKV + kv) * MAXS
            tl.store(part_ptr + (part + split) * (G * D) + g[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
            tl.store(stat_ptr + (part + split) * (2 * G) + g, m_i, mask=g_ok)
            tl.store(stat_ptr + (part + split) * (2 * G) + G + g, l_i, mask=g_ok)
            tl.debug_barrier()                                             # every thread's stores, then the count
            done = tl.atomic_add(count_ptr + row * HKV + kv, 1, sem="acq_rel")
            if done == SPLITS - 1:
                # every split's statistics in one load, then the partials unrolled: their loads overlap
                # (a loop of dependent loads cost about a microsecond a split on an H200)
                splits = tl.arange(0, SPLITS)
                stat_at = stat_ptr + (part + splits)[:, None] * (2 * G) + g[None, :]
                m_s = tl.load(stat_at, mask=g_ok[None, :], other=-1.0e30, cache_modifier=".cg")      # (S, GP)
                l_s = tl.load(stat_at + G, mask=g_ok[None, :], other=0.0, cache_modifier=".cg")
                m_all = tl.max(m_s, axis=0)
                weight = tl.exp(m_s - m_all[None, :])
                l_all = tl.sum(l_s * weight, axis=0)
                merged = tl.zeros([GP, D], tl.float32)
                for s in tl.static_range(SPLITS):
                    w_s = tl.sum(tl.where(splits[:, None] == s, weight, 0.0), axis=0)
                    a_s = tl.load(part_ptr + (part + s) * (G * D) + g[:, None] * D + d[None, :], mask=g_ok[:, None],
                                  other=0.0, cache_modifier=".cg")
                    merged += a_s * w_s[:, None]
                l_all = tl.where(g_ok, l_all, 1.0)
                tl.store(out_at, (merged / l_all[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
                tl.atomic_xchg(count_ptr + row * HKV + kv, 0)               # ready for the next launch
