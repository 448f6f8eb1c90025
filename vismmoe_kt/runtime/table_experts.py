"""A decode step's routed experts from the slab table: each pair's weights read where they lie.

Shapes: T tokens, K experts per token, P = T * K pairs, H hidden, I intermediate, S slabs.

`slots[p]` is the slab holding pair p's expert, or -1 (not resident: read the host store), or -3
(CPU_PAIR: the hybrid mode's CPU computes it; its output here is zero);
`land[p]` is the slab a missing expert's weights are also written to as they are read (-1: none).
On CUDA this is the Triton kernel pair of vismmoe_kt.runtime.kernels.bf16_gemv (zero-copy reads of
the mapped host store; quantized slabs: kernels.quantized_gemv); elsewhere `experts_twin`, the same
arithmetic in torch (fp32 accumulation, the same landing writes), which the CPU tests run.

`combine` weights the P outputs and sums each token's K of them in a fixed order (no atomics), so
the result is the same on every run: the graphed step can be checked bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from .decode_table import CPU_PAIR
from .kernels import bf16_gemv, block_staging, dequantize, expert_major, quantized_gemv, quantized_major, table_ops, \
    tuning
from .store import block_views


def combine(y: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype, use_kernel: bool = False) -> torch.Tensor:
    """(P, H) per-pair outputs -> (T, H): weighted, summed over each token's K pairs in order."""
    if use_kernel:
        return table_ops.combine(y, top_k_weights, dtype)
    tokens, k = top_k_weights.shape
    weighted = y.view(tokens, k, -1) * top_k_weights.to(y.dtype).unsqueeze(-1)
    return weighted.sum(dim=1).to(dtype)


def kernel_usable(device: torch.device, dtype: torch.dtype, act: Any) -> bool:
    """Whether the Triton kernels serve this layer: CUDA, a supported dtype, SiLU gating."""
    return device.type == "cuda" and bf16_gemv.available(dtype) and is_silu(act)


def is_silu(act: Any) -> bool:
    """Whether the activation computes SiLU (the kernels' gating), judged by what it returns: no
    library's class names here."""
    probe = torch.linspace(-4, 4, 17)
    try:
        return torch.allclose(act(probe), torch.nn.functional.silu(probe))
    except Exception:  # an activation that cannot take a plain CPU tensor
        return False


def experts_twin(x: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                 pools: tuple[torch.Tensor, torch.Tensor], host_blocks: torch.Tensor | None, act: Any,
                 top_k: int) -> torch.Tensor:
    """The kernels' function in torch: (P, H) fp32, and the landing writes into the pools."""
    gate_up_pool, down_pool = pools
    inter, hidden = gate_up_pool.shape[1] // 2, gate_up_pool.shape[2]
    hit = slots >= 0
    resident = slots.clamp(min=0)
    gate_up, down = gate_up_pool[resident], down_pool[resident]  # (P, 2I, H), (P, H, I): gathered copies
    if host_blocks is not None:  # branch-free, like the kernels: no host read of the device's values
        host_gate_up, host_down = block_views(host_blocks, inter, hidden)
        gate_up = torch.where(hit[:, None, None], gate_up, host_gate_up[ids].to(gate_up.device))
        down = torch.where(hit[:, None, None], down, host_down[ids].to(down.device))
        # pairs without a landing slab write to the pool's last row, a scratch slab nothing reads
        target = torch.where(land >= 0, land, gate_up_pool.shape[0] - 1)
        gate_up_pool.index_copy_(0, target, gate_up)
        down_pool.index_copy_(0, target, down)
    x_pairs = x.float()[torch.arange(ids.numel(), device=x.device) // top_k]
    gate, up = torch.bmm(gate_up.float(), x_pairs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(down.float(), (act(gate) * up).unsqueeze(-1)).squeeze(-1)
    return y * (slots != CPU_PAIR).unsqueeze(-1)  # the CPU computes those pairs (the kernels read nothing)


def fetch_dequantized(ids: torch.Tensor, slots: torch.Tensor, land: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor],
                      host_blocks: torch.Tensor, store: Any, scratch: int, use_kernel: bool, layer: int) -> torch.Tensor:
    """A quantized store's decode misses: each pair read from the host (slot -1 or -2, not the CPU's -3) is
    fetched and dequantized into its landing slab, or the pair's scratch slab (`scratch + pair`) when it
    has none; returns the slots the experts then read, every one a slab (the host is not read again).
    Branch-free (no host read of the device's values): pairs that need nothing write the pool's last
    slab, a dump nothing reads."""
    need = (slots < 0) & (slots != CPU_PAIR)
    pairs = torch.arange(ids.numel(), device=ids.device)
    target = torch.where(land >= 0, land, scratch + pairs)
    if use_kernel:
        dequantize.fetch_q8(ids, need, target, pools, host_blocks.data_ptr(), store.block_bytes_of(layer),
                            store.inter, store.hidden, fmt=store.fmt, down_fmt=store.down_format(layer))
    else:
        gate_up, down = store.dequantized(host_blocks[ids.to(host_blocks.device)], layer)
        where = torch.where(need, target, pools[0].shape[0] - 1)
        pools[0].index_copy_(0, where, gate_up.to(pools[0].device))
        pools[1].index_copy_(0, where, down.to(pools[1].device))
    return torch.where(need, target, slots)


def quantized_slab_outputs(hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                           pool: torch.Tensor, host_blocks: torch.Tensor, store: Any, layer: int, scratch: int,
                           act: Any, top_k: int, use_kernel: bool) -> torch.Tensor:
    """(P, H) fp32 unweighted outputs from quantized slabs (`pool`: uint8 (S, slab bytes), the store's
    blocks as they are): each miss's block is copied as it is into its landing slab (or the pair's
    scratch slab) over PCIe, then every pair's weights are decoded from its slab as the GEMVs read
    them. Branch-free like `fetch_dequantized`: pairs that need nothing write the pool's last row."""
    need, target, read = block_staging.staging_plan(slots, land, scratch, use_kernel)
    fmt, down_fmt = store.fmt, store.down_format(layer)
    block_bytes = store.block_bytes_of(layer)
    if use_kernel:
        block_staging.stage_blocks(ids, need, target, pool, host_blocks.data_ptr(), block_bytes)
        return quantized_gemv.quantized_experts(hidden, read, pool, fmt, down_fmt, store.inter, store.hidden, top_k)
    where = torch.where(need, target, pool.shape[0] - 1)
    pool[:, :block_bytes].index_copy_(0, where, host_blocks[ids.to(host_blocks.device)].to(pool.device))
    return _decoded_pairs(hidden, *store.dequantized(pool[read, :block_bytes], layer), act, top_k)


def block_bank_outputs(hidden: torch.Tensor, ids: torch.Tensor, bank: torch.Tensor, store: Any, layer: int, act: Any,
                       top_k: int, use_kernel: bool) -> torch.Tensor:
    """(P, H) fp32 unweighted outputs of a pinned layer held as blocks (`bank`: uint8 (E, block bytes), each
    expert's blocks at its own index): the quantized slabs' GEMVs with the experts as the slots, or their twin."""
    if use_kernel:
        return quantized_gemv.quantized_experts(hidden, ids, bank, store.fmt, store.down_format(layer), store.inter,
                                                store.hidden, top_k)
    return _decoded_pairs(hidden, *store.dequantized(bank[ids], layer), act, top_k)


def block_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, act: Any,
                  blocks: torch.Tensor, row_map: torch.Tensor | None, store: Any, layer: int, num_experts: int,
                  use_kernels: bool, prompt: bool) -> torch.Tensor:
    """(T, H) routed-expert output of T tokens from rows of quantized blocks (`blocks`: uint8 (rows, block bytes or
    more); `row_map`: each expert's row, on the device; every routed expert must have one): the slab pool with a
    layer's row map, or a pinned layer's bank, whose row e is expert e (`row_map` None). The expert-major kernels
    (each routed expert decoded once per block of its tokens), else the same blocks from the store's
    dequantization. `prompt`: a prompt's many tokens per expert take the prompt's tiles (tuning.prefill_tiles);
    else a batched step's."""
    if use_kernels:
        # each pair's row (a bank's are the experts' own ids: no gather launch in a host-paced prompt's layer)
        slots = row_map[top_k_index].reshape(-1) if row_map is not None else top_k_index.reshape(-1).long()
        tuned = tuning.prefill_tiles(hidden.device, top_k_index.numel() / num_experts) if prompt else \
            {"gate_up": None, "down": None, "block_m": expert_major.BLOCK_M}
        # every pair has a row, so no landing slab or staging row is ever taken: the slots and the blocks
        # stand in for both
        y = quantized_major.experts_quantized_major(
            hidden, top_k_index, slots, slots, blocks, blocks, store.fmt, store.down_format(layer), store.inter,
            num_experts, tuned["gate_up"], tuned["down"], block_m=tuned["block_m"])
    else:  # the same blocks, each expert's weights from its row by the store's dequantization
        rows = blocks[row_map] if row_map is not None else blocks[:num_experts]
        gate_up, down = store.dequantized(rows[:, :store.block_bytes_of(layer)], layer)
        block_expert, block_pairs = expert_major.expert_blocks(top_k_index.reshape(-1), num_experts)
        x = hidden.to(gate_up.dtype)
        y = expert_major.experts_by_block(x, top_k_index.shape[1], block_expert, block_pairs, gate_up, down, act)
    return combine(y, top_k_weights, hidden.dtype, use_kernels)


def _decoded_pairs(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Any,
                   top_k: int) -> torch.Tensor:
    """(P, H) fp32: each pair's token through its expert's decoded weights ((P, 2I, H), (P, H, I))."""
    x_pairs = hidden.float()[torch.arange(gate_up.shape[0], device=hidden.device) // top_k]
    gate, up = torch.bmm(gate_up.float(), x_pairs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    return torch.bmm(down.float(), (act(gate) * up).unsqueeze(-1)).squeeze(-1)


def quantized_batch_outputs(hidden: torch.Tensor, top_k_index: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                            pool: torch.Tensor, staging: torch.Tensor, host_blocks: torch.Tensor, store: Any, layer: int,
                            num_experts: int, act: Any, use_kernel: bool) -> torch.Tensor:
    """(P, H) fp32 unweighted outputs of a batched step's T tokens (`top_k_index` (T, K)) on quantized
    slabs, all at once: each miss's block is copied as it is into its landing slab, or, where it
    claimed none, into the pair's row of `staging` (uint8 (>= P, slab bytes)); then each routed expert
    is decoded once per block of its tokens and multiplied on tensor cores (kernels/quantized_major.py).
    Branch-free like `quantized_slab_outputs`."""
    ids = top_k_index.reshape(-1)
    block_bytes = store.block_bytes_of(layer)
    if use_kernel:
        quantized_major.stage_misses(ids, slots, land, pool, staging, host_blocks.data_ptr(), block_bytes)
        return quantized_major.experts_quantized_major(hidden, top_k_index, slots, land, pool, staging, store.fmt,
                                                       store.down_format(layer), store.inter, num_experts)
    need, lands = slots < 0, land >= 0
    host = host_blocks[ids.to(host_blocks.device)].to(pool.device)
    pool[:, :block_bytes].index_copy_(0, torch.where(need & lands, land, pool.shape[0] - 1), host)
    rows = staging[:ids.numel(), :block_bytes]
    rows.copy_(torch.where((need & ~lands)[:, None], host, rows))
    return quantized_major.experts_by_pair_blocks(hidden, top_k_index, slots, land, pool, staging, block_bytes,
                                                  num_experts, lambda blocks: store.dequantized(blocks, layer), act)


def pair_outputs(hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, land: torch.Tensor,
                 pools: tuple[torch.Tensor, torch.Tensor], host_blocks: torch.Tensor | None, act: Any,
                 top_k: int, use_kernel: bool) -> torch.Tensor:
    """(P, H) fp32 unweighted expert outputs, each pair's weights read where they lie (host_blocks:
    the layer's page-locked store, None where every slot is resident)."""
    if use_kernel:
        address, block_elems = (host_blocks.data_ptr(), host_blocks.shape[1]) if host_blocks is not None else (0, 0)
        return bf16_gemv.experts_where_they_lie(hidden, ids, slots, land, pools, address, block_elems, top_k)
    return experts_twin(hidden, ids, slots, land, pools, host_blocks, act, top_k)


def table_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  slots: torch.Tensor, land: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor],
                  host_blocks: torch.Tensor | None, act: Any, use_kernel: bool) -> torch.Tensor:
    """(T, H) routed-expert output of one layer's decode tokens, combined deterministically."""
    y = pair_outputs(hidden, top_k_index.reshape(-1), slots, land, pools, host_blocks, act, top_k_index.shape[1],
                     use_kernel)
    return combine(y, top_k_weights, hidden.dtype, use_kernel)
