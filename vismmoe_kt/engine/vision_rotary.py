"""The vision encoder's rotary embedding of the query and key, one kernel a block on the GPU.

Shapes: S patches, H heads, D head dim (even), qkv (S, 3, H, D) a block's projection output.

transformers' apply_rotary_pos_emb_vision casts the query and key to fp32, multiplies by cos, rotates by halves
(a negation and a concatenation), multiplies by sin, adds and casts back: even taken together for the query and
key (`rotate`, the torch form) that is seven kernels a block, each reading or writing the (2, S, H, D) tensor in
fp32. Profiled in a replayed 448 px tower on an H100 they took 1.1 of its 4.2 ms of kernels (the 27 blocks'
fp32 products alone 0.37 ms, launched element by element because cos broadcasts over the heads). On a CUDA
device the kernel below reads each query and key element once in the projection's dtype and writes the rotated
value once: the same fp32 operations in the same order (products rounded, then summed, no fused multiply-add),
so the same bits as the torch form.
"""

from __future__ import annotations

import torch
from kernel_launch import launch, next_power_of_2

from .fused_attention import rotate_half

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch form
    triton = tl = None


def rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(2, S, H, D) contiguous in qkv's dtype: the query and key of `qkv` (S, 3, H, D) rotated by `cos`, `sin`
    (S, D), in fp32 as transformers' apply_rotary_pos_emb_vision computes them."""
    if qkv.is_cuda and tl is not None:
        return _rotate_triton(qkv, cos, sin)
    return rotate_torch(qkv, cos, sin)


def rotate_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch form: the query and key together, cast once, rotated by halves, cast back."""
    x = qkv[:, :2].transpose(0, 1)
    dtype, x = x.dtype, x.to(torch.float32, memory_format=torch.contiguous_format)
    shape = (1, cos.shape[0], 1, cos.shape[-1])
    cos, sin = cos.reshape(shape).float(), sin.reshape(shape).float()
    return ((x * cos) + (rotate_half(x) * sin)).to(dtype).contiguous()


def _rotate_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    patches, _, heads, head_dim = qkv.shape
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or head_dim % 2:
        return rotate_torch(qkv, cos, sin)
    out = torch.empty(2, patches, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    # products and sums rounded apart, as torch's separate kernels round them (no FMA): the same bits
    launch(_rotary_kernel, (patches, 2), qkv, cos, sin, out, qkv.stride(0), qkv.stride(1), qkv.stride(2),
           cos.stride(0), sin.stride(0), patches, H=heads, HALF=half, BLOCK_H=next_power_of_2(heads),
           BLOCK_HALF=next_power_of_2(half), num_warps=2, enable_fp_fusion=False)
    return out


if tl is not None:
    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, row_stride, which_stride, head_stride, cos_stride,
                       sin_stride, S, H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_HALF: tl.constexpr):
        """Program (s, c): patch s's every head of the query (c 0) or the key (c 1)."""
        s = tl.program_id(0)
        c = tl.program_id(1)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        d_ok = d < HALF
        ok = (h < H) & d_ok
        at = x_ptr + s.to(tl.int64) * row_stride + c * which_stride + h * head_stride + d
        first = tl.load(at, mask=ok, other=0.0).to(tl.float32)           # (BLOCK_H, BLOCK_HALF): x[:D/2]
        second = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)   # x[D/2:]
        cos_at = cos_ptr + s.to(tl.int64) * cos_stride + d
        sin_at = sin_ptr + s.to(tl.int64) * sin_stride + d
        cos_first = tl.load(cos_at, mask=d_ok, other=0.0).to(tl.float32)
        cos_second = tl.load(cos_at + HALF, mask=d_ok, other=0.0).to(tl.float32)
        sin_first = tl.load(sin_at, mask=d_ok, other=0.0).to(tl.float32)
        sin_second = tl.load(sin_at + HALF, mask=d_ok, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2])
        out_first = first * cos_first + (-second) * sin_first
        out_second = second * cos_second + first * sin_second
        to = out_ptr + ((c * S + s).to(tl.int64) * H + h) * (2 * HALF) + d
        tl.store(to, out_first.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(to + HALF, out_second.to(out_ptr.dtype.element_ty), mask=ok)
