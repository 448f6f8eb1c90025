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
y with the routing weights in a fixed order (table_ops.combine). Addresses travel as 64-bit integers
(pool and host bases) and become pointers in the kernel, so one launch covers both memories. The
tiles are tuned per device (tuning.py, key bf16_gemv).

Only SiLU-gated experts (Qwen3-MoE and its relatives) are compiled; other activations take the
torch path (vismmoe_kt.runtime.table_experts).
"""

from __future__ import annotations

import torch
from kernel_launch import cdiv

from . import triton_support, tuning
from .triton_support import TL_DTYPES, tl, triton

if tl is not None:
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


def available(dtype: torch.dtype) -> bool:
    """Whether the GEMVs run for weights of `dtype` (Triton present)."""
    return triton_support.available(dtype)


def experts_where_they_lie(x: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                           pools: tuple[torch.Tensor, torch.Tensor], host_addr: int, block_elems: int,
                           top_k: int, gate_up_config: tuple[int, int, int] | None = None,
                           down_config: tuple[int, int, int] | None = None, parts: str = "both") -> torch.Tensor:
    """(P, H) fp32 expert outputs, unweighted. x (T, H); ids, slots, land (P,) with P = T * top_k
    (land: the slab a missing pair's weights are written to as they are read, or -1); pools: gate_up
    (S, 2I, H) and down (S, H, I) on the device; host_addr: the device address of the layer's host
    blocks (E, block_elems), mapped page-locked memory (0 when every slot is resident).
    The configs (default: the device's tuned ones) and `parts` (both | gate_up | down) are for the
    tuning benchmark."""
    gate_up, down = pools
    pairs, hidden, inter = ids.numel(), gate_up.shape[2], gate_up.shape[1] // 2
    h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    common = dict(H=hidden, I=inter, W_DTYPE=TL_DTYPES[gate_up.dtype], ELEM_BYTES=gate_up.element_size())
    tuned = tuning.get("bf16_gemv", x.device)
    rows, cols, warps = gate_up_config or tuned["gate_up"]
    if parts != "down":
        _gate_up_kernel[(pairs, cdiv(inter, rows))](
            x.contiguous(), ids, slots, land, h, gate_up.data_ptr(), host_addr, gate_up[0].numel(), block_elems,
            TOP_K=top_k, BLOCK_ROWS=rows, BLOCK_COLS=cols, num_warps=warps, **common)
    rows, cols, warps = down_config or tuned["down"]
    if parts != "gate_up":
        _down_kernel[(pairs, cdiv(hidden, rows))](
            h, ids, slots, land, y, down.data_ptr(), host_addr, down[0].numel(), block_elems,
            BLOCK_ROWS=rows, BLOCK_COLS=cols, num_warps=warps, **common)
    return y
