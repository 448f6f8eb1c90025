"""A decode step's attention in four kernels, for attentions the adapter describes (DecodeAttentionParts);
its heads kernel serves a prompt's attention too (prompt_attention.py).

Shapes: R rows, H hidden, Hq query heads, Hkv key/value heads, G = Hq / Hkv, D head dim, span the
positions the step attends to.

At batch 1 a decode step's time is mostly launches: inside a CUDA graph each kernel costs a gap of
about a microsecond on top of its own run, and transformers' Qwen3 attention is about 19 kernels a
layer (three projections, two per-head norms, ten element-wise ops of the rotary embedding, two cache
writes, the attention, the output projection). Here it is four:
    qkv        one GEMV over the query, key and value weights stacked (the modules' weights become views
               of the stacked tensor, so prefill, which runs the modules, reads the same memory);
    heads      one kernel, a program per (row, head): each query and key head's RMSNorm, the rotary
               embedding, the query written out and the key and value written into the slot cache at
               the row's position;
    attention  grouped SDPA over the cache's rows (decode_attention.py's layout: G query rows per
               key/value head, no repeated keys);
    output     the output projection.
In BF16 and FP16 on the GPU, heads and attention are one kernel (split_attention.py): three launches.
The heads kernel has a prompt form too (`prompt_heads_triton`, for prompt_attention.py): a prompt's rows of
one sequence, its keys and values at consecutive positions of the slot.
The values are transformers': the norm's statistics in fp32 and its result rounded to the input dtype
before the weight, each product of the rotary embedding rounded to the dtype before the sum, as torch
rounds each element-wise op. Without Triton, or off the GPU, the torch twin computes the same ops.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from kernel_launch import launch

from ..models.base import DecodeAttentionParts
from .fused_ops import rms_norm
from .slot_cache import SlotKVCache
from .split_attention import attend_triton, workspace

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch twin
    triton = tl = None

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the one-kernel attention's tensor-core dots would round fp32 to tf32: fp32 models keep heads + SDPA (exact)
SPLIT_DTYPES = (torch.bfloat16, torch.float16)

# a query projection -> the stacked ((Hq + 2 Hkv) D, H) weight whose views are its, the key's and the value's weights
_STACKED: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


def stacked_qkv_weight(parts: DecodeAttentionParts) -> torch.Tensor:
    """One weight for the three projections (made once per attention): the modules' weights are
    replaced by views of it, so nothing is held twice."""
    q, k, v = parts.query, parts.key, parts.value
    stacked = _STACKED.get(q)
    if stacked is not None and q.weight.data_ptr() == stacked.data_ptr() and \
            v.weight.data_ptr() + v.weight.nbytes == stacked.data_ptr() + stacked.nbytes:
        return stacked
    with torch.no_grad():
        stacked = torch.cat([q.weight, k.weight, v.weight]).contiguous()
        for module, view in zip((q, k, v), stacked.split([q.out_features, k.out_features, v.out_features])):
            module.weight = nn.Parameter(view, requires_grad=False)
    _STACKED[q] = stacked
    return stacked


def fusable(parts: DecodeAttentionParts | None) -> bool:
    """Whether these parts run here: one dtype and device for weights and norms, whole heads."""
    if parts is None:
        return False
    tensors = [parts.query.weight, parts.key.weight, parts.value.weight, parts.output.weight,
               parts.query_norm[0], parts.key_norm[0]]
    dtype, device = tensors[0].dtype, tensors[0].device
    return (all(t.dtype == dtype and t.device == device for t in tensors) and parts.heads % parts.kv_heads == 0
            and parts.head_dim % 2 == 0 and parts.query.out_features == parts.heads * parts.head_dim
            and parts.key.out_features == parts.value.out_features == parts.kv_heads * parts.head_dim
            and parts.query_norm[0].numel() == parts.key_norm[0].numel() == parts.head_dim)


class FusedDecodeAttention:
    """`attention(hidden (R, 1, H), cos, sin (R, 1, D), mask (R, 1, 1, span))` -> (R, 1, H), writing the
    rows' new key and value into `cache` (a decode step under way, `begin_decode` called)."""

    def __init__(self, parts: DecodeAttentionParts, cache: SlotKVCache):
        if not fusable(parts) or cache.values[parts.layer_index].shape[-1] != parts.head_dim:
            raise ValueError("these attention parts do not fit the fused decode attention (fusable() says why not)")
        self.parts, self.cache = parts, cache
        # the kernel's program reads a head as one power-of-two vector (Qwen3's 128); other widths: the twin
        self.kernel_width = parts.head_dim & (parts.head_dim - 1) == 0
        self.qkv_weight = stacked_qkv_weight(parts)
        self.o_weight = parts.output.weight
        # heads + attention in one kernel (split_attention.py) where it serves: its workspace is made now,
        # before any graph is captured
        self.space = workspace(cache, parts.heads, parts.kv_heads, parts.head_dim) \
            if self.kernel_width and cache.device.type == "cuda" and tl is not None and cache.dtype in SPLIT_DTYPES \
            and self.qkv_weight.dtype == cache.dtype else None

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        p, cache = self.parts, self.cache
        rows = hidden.shape[0]
        qkv = F.linear(hidden.view(rows, -1), self.qkv_weight)                      # (R, (Hq + 2 Hkv) D)
        cos, sin = cos.reshape(rows, p.head_dim), sin.reshape(rows, p.head_dim)
        if self.space is not None and qkv.is_cuda:
            out = attend_triton(qkv, cos, sin, p, cache, self.space)
            return F.linear(out, self.o_weight).view(rows, 1, -1)
        if self.kernel_width and kernel_serves(qkv):
            query = heads_triton(qkv, cos, sin, p, cache)
            keys, values = cache.decode_view(p.layer_index)
        else:
            query, key, value = heads_torch(qkv, cos, sin, p)
            keys, values = cache.update(key[:, :, None], value[:, :, None], p.layer_index)
        grouped = query.view(rows, p.kv_heads, p.heads // p.kv_heads, p.head_dim)   # head h reads key/value h // G
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=p.scaling)
        return F.linear(out.reshape(rows, -1), self.o_weight).view(rows, 1, -1)


def kernel_serves(qkv: torch.Tensor) -> bool:
    return qkv.is_cuda and tl is not None and qkv.dtype in KERNEL_DTYPES


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def heads_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                p: DecodeAttentionParts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heads kernel's twin: (query (R, Hq, D), key (R, Hkv, D), value (R, Hkv, D)), normed and rotated."""
    rows, d = qkv.shape[0], p.head_dim
    query, key, value = qkv.split([p.heads * d, p.kv_heads * d, p.kv_heads * d], dim=-1)
    query = rms_norm(p.query_norm[0], p.query_norm[1], query.reshape(rows, p.heads, d))
    key = rms_norm(p.key_norm[0], p.key_norm[1], key.reshape(rows, p.kv_heads, d))
    cos, sin = cos[:, None], sin[:, None]
    query = query * cos + rotate_half(query) * sin
    key = key * cos + rotate_half(key) * sin
    return query, key, value.reshape(rows, p.kv_heads, d)


def heads_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: DecodeAttentionParts,
                 cache: SlotKVCache) -> torch.Tensor:
    """The heads kernel: the query (R, Hq, D) out, the key and value into the cache at each row's position."""
    rows = qkv.shape[0]
    keys, values = cache.keys[p.layer_index], cache.values[p.layer_index]
    query = torch.empty(rows, p.heads, p.head_dim, dtype=qkv.dtype, device=qkv.device)
    launch(_heads_kernel, (rows, p.heads + 2 * p.kv_heads),
           qkv, qkv.stride(0), cos.contiguous(), sin.contiguous(), p.query_norm[0], p.key_norm[0],
           p.query_norm[1], p.key_norm[1],
           query, p.heads * p.head_dim, p.head_dim, keys, values, keys.stride(0), keys.stride(1), keys.stride(2),
           cache.active, cache.lengths[p.layer_index], 0, HQ=p.heads, HKV=p.kv_heads, D=p.head_dim, PROMPT=False,
           num_warps=1)
    return query


def prompt_heads_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: DecodeAttentionParts,
                        keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """The heads kernel over a prompt's T rows of one sequence: the query (1, Hq, T, D) out, in the layout
    sdpa reads, and row t's key and value written at position start + t of `keys` / `values` (one slot's
    (Hkv, C, D) buffers)."""
    rows = qkv.shape[0]
    query = torch.empty(1, p.heads, rows, p.head_dim, dtype=qkv.dtype, device=qkv.device)
    launch(_heads_kernel, (rows, p.heads + 2 * p.kv_heads),
           qkv, qkv.stride(0), cos.contiguous(), sin.contiguous(), p.query_norm[0], p.key_norm[0],
           p.query_norm[1], p.key_norm[1],
           query, p.head_dim, rows * p.head_dim, keys, values, 0, keys.stride(0), keys.stride(1),
           qkv, qkv, start, HQ=p.heads, HKV=p.kv_heads, D=p.head_dim, PROMPT=True, num_warps=1)
    return query


if tl is not None:
    @triton.jit
    def _normed(x, w, rstd):
        """transformers' RMSNorm of one head's values, given the head's 1 / rms: rounded, then the weight."""
        return (w.to(tl.float32) * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)

    @triton.jit(do_not_specialize=["first_position"])
    def _heads_kernel(qkv_ptr, row_stride, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps_q, eps_k, q_ptr, q_row_stride,
                      q_head_stride, k_cache, v_cache, slot_stride, head_stride, pos_stride, slots_ptr, lengths_ptr,
                      first_position, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PROMPT: tl.constexpr):
        """A program per (row, head): heads 0..Hq-1 of the stacked projection are queries, then Hkv keys,
        then Hkv values. Queries and keys: RMSNorm, then x * cos + rotate_half(x) * sin; the query is
        written to q_ptr (at the row's and head's strides), the key (and the value as it is) into the cache:
        a decode step's row at its slot's length (slots_ptr, lengths_ptr), a PROMPT's row t (one sequence,
        the caches its slot's buffers) at first_position + t."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, D)
        at = qkv_ptr + row * row_stride + head * D
        x = tl.load(at + d)
        if PROMPT:
            slot = 0
            position = first_position + row
        else:
            slot = tl.load(slots_ptr + row)
            position = tl.load(lengths_ptr + slot)
        if head < HQ + HKV:
            is_query = head < HQ
            partner = (d + D // 2) % D                                   # rotate_half reads the other half
            w = tl.where(is_query, tl.load(qn_ptr + d), tl.load(kn_ptr + d))
            w_partner = tl.where(is_query, tl.load(qn_ptr + partner), tl.load(kn_ptr + partner))
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + tl.where(is_query, eps_q, eps_k))
            normed = _normed(x, w, rstd)
            rotated = _normed(tl.load(at + partner), w_partner, rstd).to(tl.float32)
            rotated = tl.where(d < D // 2, -rotated, rotated)
            cos = tl.load(cos_ptr + row * D + d).to(tl.float32)
            sin = tl.load(sin_ptr + row * D + d).to(tl.float32)
            out = ((normed.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
                   + (rotated * sin).to(x.dtype).to(tl.float32)).to(x.dtype)
            if is_query:
                tl.store(q_ptr + row * q_row_stride + head * q_head_stride + d, out)
            else:
                tl.store(k_cache + slot * slot_stride + (head - HQ) * head_stride + position * pos_stride + d, out)
        else:
            tl.store(v_cache + slot * slot_stride + (head - HQ - HKV) * head_stride + position * pos_stride + d, x)
