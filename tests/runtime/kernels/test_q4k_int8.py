"""A prompt's Q4_K experts on int8 activations (runtime/kernels/q4k_int8.py): the activations' quantization,
the kernels against the torch twin in Triton's interpreter, the twin against the weights dequantized, the
choice by tuning where filled prefill calls the kernels, and the kernels compiled for Hopper."""

from types import SimpleNamespace

import pytest
import torch

from kernel_cases import hopper, interpreter  # noqa: F401 (fixtures)
from vismmoe_kt.runtime.kernels import q4k_int8 as qi

SCRIPT = r"""
from vismmoe_kt.runtime.kernels import q4k_int8 as qi
from kernel_cases import dequantized_reference, filled_store, scattered_pairs

# the activations: 37 rows (the last program of 16 rows partly masked), a zero row and a zero block
for dtype in (torch.float16, torch.float32):
    x = torch.randn(37, 512).to(dtype)
    x[3] = 0
    x[5, 64:96] = 0
    got, want = qi.quantize_rows(x), qi.quantize_rows_twin(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b), dtype

E, H, I = 6, 256, 256
store = filled_store(E, H, I, torch.float16, "q4_k")
bb = store.block_bytes_of(0)
# 5 tokens x 3 experts: expert 2 in four pairs, 5 in three, the rest fewer: every block of 16 or 32 partly empty
top_k_index, ids, pool, staging, slots, land = scattered_pairs(store)
pool[7, :bb] = store.layers[0][5]                        # expert 5's first pair landed in slab 7
for p in torch.nonzero(slots < 0, as_tuple=True)[0].tolist():
    staging[p, :bb] = store.layers[0][ids[p]]            # every other miss staged in its row (expert 1)
x = (torch.randn(5, H) / 2).to(torch.float16)
ref = dequantized_reference(store, ids, x, 3)
scale = ref.abs().max().item()
assert scale > 0
for block_m, gate_up_tiles, down_tiles in ((16, (32, 4, 1), (64, 4, 1)), (32, (64, 4, 2), (32, 4, 1))):
    plan = qi.pair_plan(top_k_index, slots, land, pool, staging, E, block_m)
    x_rows = qi.quantize_rows(x)
    # gate_up: h as quantized by the kernel's epilogue against the twin's fp32 h quantized; an fp32 rounding
    # apart may move a value across a half step, nothing more
    h = qi.gate_up_int8(x_rows, plan, H, I, gate_up_tiles)
    h_twin = qi.quantize_rows_twin(qi.gate_up_twin(x_rows, plan, H, I))
    moved = (h.q.int() - h_twin.q.int()).abs()
    assert moved.max() <= 1 and (moved > 0).float().mean() < 0.01, (block_m, moved.sum())
    torch.testing.assert_close(h.scale, h_twin.scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(h.sums, h_twin.sums, rtol=1e-5, atol=1e-6)
    assert h_twin.q.abs().max() == 127
    # down, from the same quantized h: only the fp32 sums' order differs
    y = qi.down_int8(h, plan, H, I, down_tiles)
    torch.testing.assert_close(y, qi.down_twin(h, plan, H, I), rtol=0, atol=1e-5 * scale)
    # the whole path, and against the weights dequantized (8-bit activations: about 1% of the outputs' scale)
    whole = qi.experts_int8(x, top_k_index, slots, land, pool, staging, I, E, gate_up_tiles, down_tiles,
                            block_m=block_m)
    twin = qi.experts_int8_twin(x, top_k_index, slots, land, pool, staging, I, E, block_m=block_m)
    torch.testing.assert_close(whole, twin, rtol=0, atol=2e-3 * scale)
    torch.testing.assert_close(whole, ref, rtol=0, atol=2e-2 * scale)
try:
    qi.gate_up_int8(x_rows, plan, H, I, (48, 4, 1))
    raise AssertionError("a tile of 48 columns")
except ValueError:
    pass
"""


def test_kernels_match_the_twin_in_the_interpreter(interpreter):
    interpreter(SCRIPT, timeout=600)


def test_quantized_rows_hold_their_blocks_sums_and_round_half_away_from_zero():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=generator) * torch.tensor([1.0, 0.0, 1e-3, 30.0])[:, None]
    x[0, 32:64] = 0
    # a block whose largest value makes the scale 1: its halves land between two steps
    x[3, :6] = torch.tensor([127.0, 0.5, 1.5, -0.5, -2.5, 2.49])
    x[3, 6:32] = 0
    rows = qi.quantize_rows_twin(x)
    assert rows.q.dtype == torch.int8 and rows.scale.shape == rows.sums.shape == (4, 8)
    assert rows.q[3, :6].tolist() == [127, 1, 2, -1, -3, 2] and rows.scale[3, 0] == 1
    assert not rows.q[1].any() and not rows.scale[1].any() and not rows.sums[1].any()   # a zero row
    assert not rows.q[0, 32:64].any() and rows.scale[0, 1] == 0 and rows.sums[0, 1] == 0
    blocks = rows.q.float().view(4, 8, 32)
    # each nonzero block reaches 127; its sum is the quantized block's, exactly; each value within half a step
    assert torch.equal(blocks.abs().amax(-1) == 127, rows.scale > 0)
    assert torch.equal(rows.sums, blocks.sum(-1) * rows.scale)
    error = (blocks * rows.scale[..., None] - x.view(4, 8, 32)).abs()
    assert (error <= rows.scale[..., None] * 0.5 * (1 + 1e-5)).all()


def test_the_twin_stays_near_the_dequantized_weights():
    """8-bit activations against the Q4_K weights dequantized and computed in fp32: within 2% of the outputs'
    largest (and their norm); the activations left in fp32 (a scale of 0 would be a bug) do no better."""
    from kernel_cases import dequantized_reference, filled_store

    torch.manual_seed(2)
    experts, hidden, inter, top_k = 4, 512, 256, 2
    store = filled_store(experts, hidden, inter, torch.float32, "q4_k")
    top_k_index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(9)])
    ids = top_k_index.reshape(-1)
    pool = store.layers[0].clone()
    slots = torch.arange(experts)[ids]
    x = torch.randn(9, hidden)
    got = qi.experts_int8_twin(x, top_k_index, slots, torch.full_like(slots, -1), pool, pool, inter, experts, 32)
    want = dequantized_reference(store, ids, x, top_k)
    assert (got - want).abs().max() < 2e-2 * want.abs().max()
    assert 1e-4 < (got - want).norm() / want.norm() < 2e-2


def test_filled_prefill_takes_the_int8_path_only_as_tuned_and_for_q4_k(monkeypatch):
    """experts_from_slabs: a prompt (several rows) on Q4_K slabs takes the int8 kernels where tuning's
    quantized_prefill sets int8_activations, with its int8 tiles; Q6_K down, the switch off, or a batched
    step's single row keep quantized_major's kernels."""
    from vismmoe_kt.runtime.executors import filled_prefill
    from vismmoe_kt.runtime.kernels import quantized_major, tuning

    calls = []
    monkeypatch.setattr(qi, "experts_int8", lambda *a, **k: calls.append(("int8", a[8:], k)) or torch.zeros(6, 4))
    monkeypatch.setattr(quantized_major, "experts_quantized_major",
                        lambda *a, **k: calls.append(("major", a[6:8], k)) or torch.zeros(6, 4))
    monkeypatch.setattr(filled_prefill, "combine", lambda y, *rest: y)
    store = SimpleNamespace(fmt="q4_k", down_format=lambda layer: "q6_k" if layer == 1 else "q4_k")
    res = SimpleNamespace(pool=[torch.zeros(4, 8, dtype=torch.uint8)], store=store, row_map=[torch.arange(4)] * 2,
                          index={0: 0, 1: 1}, inter=256, num_experts=4)
    top_k_index = torch.tensor([[0, 1], [2, 3], [1, 2]])

    def run(layer, tokens=3):
        calls.clear()
        filled_prefill.experts_from_slabs(res, True, layer, torch.zeros(tokens, 4), top_k_index[:tokens],
                                          torch.ones(tokens, 2), None)
        return calls[0]

    prefill = tuning.get("quantized_prefill")
    int8 = {"block_m": 64, "gate_up": (96, 8, 3), "down": (32, 4, 1)}
    with tuning.overridden(quantized_prefill={**prefill, "int8_activations": True, "int8": int8}):
        assert run(0) == ("int8", ((96, 8, 3), (32, 4, 1)), {"block_m": 64})
        assert run(1)[0] == "major"                 # down in Q6_K: not the int8 path's
        assert run(0, tokens=1)[0] == "major"       # a batched step's row: the decode tiles
    assert run(0) == ("major", ("q4_k", "q4_k"), {"block_m": prefill["block_m"]})   # off by default
    assert tuning.get("quantized_prefill")["int8_activations"] is False


def test_the_int8_kernels_compile_for_hopper_with_integer_mma(hopper):
    """sm_90 at Qwen3-VL-30B-A3B's shapes and the H200's int8 tiles: each product an s8 x s8 -> s32 MMA
    (mma.sync's m16n8k32 or wgmma), none in BF16; the quant words read in 16-byte loads as launched."""
    import re

    blocks = {"expert_ptr": "*i64", "pairs_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64"}
    slabs = {"pool_ptr": "*u8", "slab_bytes": "i64", "staging_offset": "i64", "staging_bytes": "i64"}
    rows = lambda name: {f"{name}q_ptr": "*i8", f"{name}s_ptr": "*fp32", f"{name}sum_ptr": "*fp32"}  # noqa: E731
    sizes = {"H": "constexpr", "I": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    aligned = ("pool_ptr", "slab_bytes", "staging_offset", "staging_bytes")
    tuned = hopper.tuned["quantized_prefill"]["int8"]
    n, warps, stages = tuned["gate_up"]
    gate_up = hopper.compile(qi._gate_up_int8_blocks, {**rows("x"), **blocks, **rows("h"), **slabs, "TOP_K": "constexpr",
                                                       **sizes},
                             {**hopper.shapes, "TOP_K": 8, "BLOCK_M": tuned["block_m"], "BLOCK_N": n},
                             num_warps=warps, num_stages=stages, aligned=("xq_ptr", "hq_ptr", *aligned))
    n, warps, stages = tuned["down"]
    down = hopper.compile(qi._down_int8_blocks, {**rows("h"), **blocks, "y_ptr": "*fp32", **slabs,
                                                 "PART_BYTES": "constexpr", **sizes},
                          {**hopper.shapes, "PART_BYTES": 2 * hopper.shapes["I"] * 8 * qi.SB_BYTES,
                           "BLOCK_M": tuned["block_m"], "BLOCK_N": n},
                          num_warps=warps, num_stages=stages, aligned=("hq_ptr", "y_ptr", *aligned))
    for compiled in (gate_up, down):
        ptx = compiled.asm["ptx"]
        assert re.search(r"mma\.sync\.aligned\.m16n8k32\.row\.col(\.satfinite)?\.s32\.s8\.s8\.s32|wgmma\.mma_async"
                         r"[\w.]*\.s32\.s8\.s8", ptx), "no integer MMA"
        assert not re.search(r"mma[\w.]*bf16", ptx), "a BF16 product"
        # pipelined (2 stages): the quant words and int8 rows in 16-byte asynchronous copies
        assert len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)) >= 2
    hopper.compile(qi._quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32",
                                              "sums_ptr": "*fp32", "rows": "i32", "C": "constexpr",
                                              "ROWS": "constexpr", "COLS": "constexpr"},
                   {"C": hopper.shapes["H"], "ROWS": qi.QUANTIZE_ROWS, "COLS": qi.QUANTIZE_COLS}, num_warps=4)


def test_only_q4_k_throughout_takes_the_int8_path():
    assert qi.applies("q4_k", "q4_k")
    assert not qi.applies("q4_k", "q6_k") and not qi.applies("q5_k", "q5_k") and not qi.applies("q8_0", "q8_0")
