"""A batched step's experts on quantized slabs, expert by expert (runtime/kernels/quantized_major.py), and the
table's lookup and publish for several tokens at once: the Triton kernels against the torch twins and a
dequantize-then-compute reference, in Triton's interpreter; the kernels compiled for Hopper at
Qwen3-VL-30B-A3B's shapes (kernel_cases.py: the fixtures, and the stores and the reference the script builds)."""

import pytest

from kernel_cases import assert_nibbles_by_exponent, hopper, interpreter  # noqa: F401 (fixtures)

SCRIPT = r"""
from vismmoe_kt.runtime.kernels import quantized_major as qm, table_ops
from vismmoe_kt.runtime.decode_table import DecodeTable
from kernel_cases import dequantized_reference, filled_store, q6k_rows

E, H, I = 6, 256, 512
# float16 activations: the interpreter's tl.dot misreads bfloat16 (numpy has none); the GPU runs bfloat16
for fmt, down_fmt in (("q4_k", None), ("q8_0", None), ("q4_0", None), ("q5_k", None), ("q4_k", "q6_k")):
    # a Q4_K_M file's layer: down experts in Q6_K (random bytes, each super-block's d finite)
    store = filled_store(E, H, I, torch.float16, fmt, (lambda: q6k_rows(E, H, I, 0.002, 0.0001)) if down_fmt else None)
    bb = store.block_bytes_of(0)
    # 5 tokens x 3 experts: expert 2 in four pairs, expert 5 in three, every block partly empty
    top_k_index = torch.tensor([[2, 5, 0], [5, 2, 1], [2, 3, 5], [4, 2, 0], [1, 3, 4]])
    ids = top_k_index.reshape(-1)
    pool = torch.zeros(8, bb + 64, dtype=torch.uint8)      # rows wider than a block: the row stride matters
    staging = torch.zeros(ids.numel(), bb + 64, dtype=torch.uint8)
    resident = {0: 3, 2: 1, 3: 6, 4: 0}                     # expert -> slab
    slots = torch.tensor([resident.get(int(e), -1) for e in ids])
    land = torch.full_like(slots, -1)
    land[1] = 7                                              # one of expert 5's misses claimed slab 7
    for e, slab in resident.items():
        pool[slab, :bb] = store.layers[0][e]
    # the misses' blocks staged from the "host" (here plain memory) in one launch: into slab 7, else staging rows
    qm.stage_misses(ids, slots, land, pool, staging, store.layers[0].data_ptr(), bb)
    assert torch.equal(pool[7, :bb], store.layers[0][5]) and not pool[7, bb:].any()
    for p in range(ids.numel()):
        want = store.layers[0][ids[p]] if slots[p] < 0 and land[p] < 0 else torch.zeros(bb, dtype=torch.uint8)
        assert torch.equal(staging[p, :bb], want), p
    for slab in (2, 4, 5):
        assert not pool[slab].any()
    x = (torch.randn(5, H) / 2).to(torch.float16)
    got = qm.experts_quantized_major(x, top_k_index, slots, land, pool, staging, fmt, down_fmt or fmt, I, E)
    twin = qm.experts_by_pair_blocks(x, top_k_index, slots, land, pool, staging, bb, E,
                                     lambda blocks: store.dequantized(blocks, 0), torch.nn.SiLU())
    ref = dequantized_reference(store, ids, x, 3)
    scale = ref.abs().max().item()
    assert scale > 0
    # float16 weights and intermediate: a few thousandths of the largest output
    torch.testing.assert_close(got, ref, rtol=0, atol=4e-3 * scale)
    torch.testing.assert_close(twin, ref, rtol=0, atol=4e-3 * scale)
    if fmt == "q4_k" and down_fmt is None:  # a prompt's blocks (filled prefill): every pair of an expert in one
        wide = qm.experts_quantized_major(x, top_k_index, slots, land, pool, staging, fmt, fmt, I, E, block_m=32)
        torch.testing.assert_close(wide, ref, rtol=0, atol=4e-3 * scale)
        # a quarter super-block a step (piece 64): the same weights decoded in four pieces
        quarters = qm.experts_quantized_major(x, top_k_index, slots, land, pool, staging, fmt, fmt, I, E,
                                              (32, 4, 1, 64), (64, 4, 1, 64), block_m=32)
        torch.testing.assert_close(quarters, wide, rtol=0, atol=1e-3 * scale)
    if fmt == "q4_k":  # the decoded weights first (quarter steps; a Q6_K down falls back to whole super-blocks)
        rows = qm.experts_quantized_major(x, top_k_index, slots, land, pool, staging, fmt, down_fmt or fmt, I, E,
                                          (64, 4, 1, 64, "weights"), (64, 4, 1, 64, "weights"), block_m=32)
        torch.testing.assert_close(rows, ref, rtol=0, atol=4e-3 * scale)
        torch.testing.assert_close(rows, got, rtol=0, atol=1e-3 * scale)

# the table's lookup of several tokens in one launch (a program per token) against the twin's token
# after token, then each token's landings published by the combine
K, L = 3, 2
results = []
y, weights = torch.randn(9, 8), torch.rand(3, K)
for use_kernel in (False, True):
    table = DecodeTable(L, E, K, torch.device("cpu"), landing_slots=4)
    table.enable_batch(4)
    table.slots[1, :E] = torch.tensor([-1, 2, -2, -1, -1, -1])  # expert 1 resident, 2 arriving
    table.landing[1] = torch.tensor([5, 6, 7, -1])
    table.count[1] = 3
    ids = torch.tensor([0, 1, 3, 3, 4, 2, 5, 0, 1])               # expert 0 and 3 missed by two tokens each
    slots, land = table.lookup(1, ids, use_kernel, offset=0)
    if use_kernel:
        out = table_ops.combine(y, weights, torch.float32, table, 1, ids, land)
    else:
        table.publish(1, ids, land)
        out = (y.view(3, K, 8) * weights[..., None]).sum(1)
    results.append((slots, land, table.slots[1].clone(), table.batch_routed[1, :9].clone(),
                    table.batch_read[1, :9].clone(), table.used[1].item(), out))
for a, b in zip(*results):
    assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)) if not torch.is_floating_point(torch.as_tensor(a)) \
        else torch.allclose(a, b, atol=1e-6), (a, b)
slots, land, entries, routed, recorded, used, _ = results[1]
# three misses claim the three landing slabs (0, 3, 4 in token order); the second asks for 0 and 3 read the host
assert land.tolist() == [5, -1, 6, -1, 7, -1, -1, -1, -1] and used == 4  # the undone claim (expert 5) counted too
assert entries[:E].tolist() == [5, 2, -2, 6, 7, -1] and routed.tolist() == ids.tolist()
assert recorded.tolist() == slots.tolist() == [-1, 2, -1, -2, -1, -2, -1, -2, 2]
"""


def test_kernels_match_the_twin_and_the_reference_in_the_interpreter(interpreter):
    interpreter(SCRIPT, timeout=600)


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "q4_0", "q5_k", "q6_k"])
def test_kernels_compile_for_hopper(hopper, fmt):
    from vismmoe_kt.runtime.kernels import expert_major as em
    from vismmoe_kt.runtime.kernels import quantized_major as qm

    blocks = {"expert_ptr": "*i64", "pairs_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_ptr": "*u8",
              "slab_bytes": "i64", "staging_offset": "i64", "staging_bytes": "i64", "H": "constexpr", "I": "constexpr",
              "KIND": "constexpr", "SB_BYTES": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    shapes = {**hopper.shapes, "BLOCK_M": em.BLOCK_M, "KIND": qm.TILE_KINDS[fmt], "SB_BYTES": qm.TILE_BYTES[fmt]}
    tuned = hopper.tuned["quantized_major"]
    # each format at the tiles it runs (format_form: Q5_K and Q6_K at 8 warps and fewer rows)
    n, warps, stages, _, _ = qm.format_form(fmt, "gate_up", qm.tile_form(tuned["gate_up"]))
    hopper.compile(qm._gate_up_q_blocks, {"x_ptr": "*bf16", "h_ptr": "*bf16", "TOP_K": "constexpr",
                                          "DOWN_KIND": "constexpr", **blocks},
                   {**shapes, "TOP_K": 8, "BLOCK_N": n, "DOWN_KIND": shapes["KIND"]}, num_warps=warps, num_stages=stages)
    n, warps, stages, _, _ = qm.format_form(fmt, "down", qm.tile_form(tuned["down"]))
    hopper.compile(qm._down_q_blocks, {"h_ptr": "*bf16", "y_ptr": "*fp32", "PART_BYTES": "constexpr", **blocks},
                   {**shapes, "BLOCK_N": n, "PART_BYTES": 2 * hopper.shapes["I"] * 8 * qm.TILE_BYTES[fmt]},
                   num_warps=warps, num_stages=stages)
    hopper.compile(qm._stage_kernel, {"ids_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_ptr": "*i32",
                                      "staging_ptr": "*i32", "host_addr": "i64", "block_words": "i32",
                                      "pool_words": "i32", "staging_words": "i32", "CHUNK": "constexpr"},
                   {"CHUNK": qm.STAGE_CHUNK})


@pytest.mark.parametrize("block_m", [16, 64])
def test_the_q4_k_expert_major_kernels_read_their_slabs_in_16_byte_loads(hopper, block_m):
    """The slabs come in as the pool's pointer (the staging rows as an offset from it), so a launch knows
    their alignment: compiled as a launch specializes it, each super-block's Q4_K quant words are read in
    16-byte vector loads, none word by word (block M 16: a batched step; 64: a prompt on filled slabs)."""
    import re

    from vismmoe_kt.runtime.kernels import quantized_major as qm

    signature = {"x_ptr": "*bf16", "expert_ptr": "*i64", "pairs_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64",
                 "h_ptr": "*bf16", "pool_ptr": "*u8", "slab_bytes": "i64", "staging_offset": "i64",
                 "staging_bytes": "i64", "TOP_K": "constexpr", "H": "constexpr", "I": "constexpr", "KIND": "constexpr",
                 "DOWN_KIND": "constexpr", "SB_BYTES": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    n, warps, stages = hopper.tuned["quantized_prefill"]["gate_up"]
    constants = {**hopper.shapes, "TOP_K": 8, "KIND": qm.TILE_KINDS["q4_k"], "DOWN_KIND": qm.TILE_KINDS["q4_k"],
                 "SB_BYTES": qm.TILE_BYTES["q4_k"], "BLOCK_M": block_m, "BLOCK_N": n}
    compiled = hopper.compile(qm._gate_up_q_blocks, signature, constants, num_warps=warps, num_stages=stages,
                              aligned=("x_ptr", "h_ptr", "pool_ptr", "slab_bytes", "staging_offset", "staging_bytes"))
    loads = re.findall(r"ld\.global((?:\.v\d)?)\.b(\d+)", compiled.asm["ptx"])
    assert ("", "32") not in loads, "quant words loaded one by one"
    assert sum(1 for vector, bits in loads if vector == ".v4" and bits == "32") >= 8
    # the token rows come in the tile's order (in_tile_order): read in runs, not one BF16 element at a time
    assert sum(1 for vector, bits in loads if vector == "" and bits == "16") <= 4
    # every weight's nibble becomes a float without an int-to-float conversion (block_decode._nibble_float)
    assert_nibbles_by_exponent(compiled.asm["ptx"])


def test_the_token_rows_go_in_the_tiles_column_order():
    """in_tile_order reorders each 256 columns as the format's tiles unpack their weights (tile_columns),
    by a transpose (no index tensor: a captured step may call it); formats unpacked in order are left as
    they are."""
    import torch

    from vismmoe_kt.runtime.kernels import quantized_major as qm

    x = torch.randn(3, 512)
    for fmt in ("q4_k", "q4_0", "q8_0", "q5_k"):
        columns = qm.tile_columns(fmt)
        want = x if columns is None else x.view(3, 2, 256)[:, :, columns].reshape(3, 512)
        assert torch.equal(qm.in_tile_order(x, fmt), want), fmt
        if columns is not None:
            assert sorted(columns.tolist()) == list(range(256)) and not torch.equal(columns, torch.arange(256))


@pytest.mark.parametrize("stages", [1, 3])
def test_the_q4_k_quarter_step_kernels_compile_for_hopper_with_vector_loads(hopper, stages):
    """A quarter super-block a step (piece 64), pipelined or not: compiled for sm_90, each quarter's 32 quant
    bytes and the rows' inputs read in 16-byte loads (pipelined: 16-byte asynchronous copies), none word by
    word or element by element."""
    import re

    from vismmoe_kt.runtime.kernels import quantized_major as qm

    blocks = {"expert_ptr": "*i64", "pairs_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_ptr": "*u8",
              "slab_bytes": "i64", "staging_offset": "i64", "staging_bytes": "i64", "H": "constexpr", "I": "constexpr",
              "KIND": "constexpr", "SB_BYTES": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
              "PIECE": "constexpr"}
    shapes = {**hopper.shapes, "BLOCK_M": 32, "BLOCK_N": 64, "KIND": qm.TILE_KINDS["q4_k"],
              "SB_BYTES": qm.TILE_BYTES["q4_k"], "PIECE": 64}
    aligned = ("pool_ptr", "slab_bytes", "staging_offset", "staging_bytes")
    kernels = [hopper.compile(qm._gate_up_q_blocks, {"x_ptr": "*bf16", "h_ptr": "*bf16", "TOP_K": "constexpr",
                                                     "DOWN_KIND": "constexpr", **blocks},
                              {**shapes, "TOP_K": 8, "DOWN_KIND": shapes["KIND"]}, num_warps=4, num_stages=stages,
                              aligned=("x_ptr", "h_ptr", *aligned)),
               hopper.compile(qm._down_q_blocks, {"h_ptr": "*bf16", "y_ptr": "*fp32", "PART_BYTES": "constexpr", **blocks},
                              {**shapes, "PART_BYTES": 2 * hopper.shapes["I"] * 8 * qm.TILE_BYTES["q4_k"]},
                              num_warps=4, num_stages=stages, aligned=("h_ptr", "y_ptr", *aligned))]
    for compiled in kernels:
        ptx = compiled.asm["ptx"]
        loads = re.findall(r"ld\.global((?:\.v\d)?)\.b(\d+)", ptx)
        assert ("", "32") not in loads, "quant words loaded one by one"
        # d and dmin of each tile are 16-bit: a handful; the inputs element by element would be dozens
        assert loads.count(("", "16")) <= 4
        wide = loads.count((".v4", "32")) if stages == 1 else len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))
        assert wide >= 3
        assert_nibbles_by_exponent(ptx)


@pytest.mark.parametrize("block_m, ahead", [(16, False), (32, False), (32, True)])
def test_the_weights_first_kernels_decode_in_the_tensor_cores_registers(hopper, block_m, ahead):
    """With the decoded weights first (order "weights"), compiled for sm_90 as a launch specializes it: Hopper's
    warp-group products read the weights from registers. The only values passing through shared memory into that
    operand are the quant bytes (int8, two weights a byte, read from the slab in 16-byte loads) and each row's
    constants, never a tile of decoded weights; each nibble becomes a float by an OR into 1.0's mantissa, not an
    int-to-float conversion. `ahead` ("weights-ahead"): the same with each step prefetching the next one's bytes
    into L1, which must leave all of that as it is."""
    import re

    from vismmoe_kt.runtime.kernels import quantized_major as qm

    blocks = {"expert_ptr": "*i64", "pairs_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_ptr": "*u8",
              "slab_bytes": "i64", "staging_offset": "i64", "staging_bytes": "i64", "H": "constexpr", "I": "constexpr",
              "SB_BYTES": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    shapes = {**hopper.shapes, "BLOCK_M": block_m, "BLOCK_N": 128, "SB_BYTES": qm.TILE_BYTES["q4_k"], "AHEAD": ahead}
    blocks["AHEAD"] = "constexpr"
    aligned = ("pool_ptr", "slab_bytes", "staging_offset", "staging_bytes")
    kernels = [hopper.compile(qm._gate_up_q_rows, {"x_ptr": "*bf16", "h_ptr": "*bf16", "TOP_K": "constexpr",
                                                   "DOWN_KIND": "constexpr", **blocks},
                              {**shapes, "TOP_K": 8, "DOWN_KIND": qm.IN_ORDER}, num_warps=4, num_stages=1,
                              aligned=("x_ptr", "h_ptr", *aligned)),
               hopper.compile(qm._down_q_rows, {"h_ptr": "*bf16", "y_ptr": "*fp32", "PART_BYTES": "constexpr", **blocks},
                              {**shapes, "PART_BYTES": 2 * hopper.shapes["I"] * 8 * qm.TILE_BYTES["q4_k"]},
                              num_warps=4, num_stages=1, aligned=("h_ptr", "y_ptr", *aligned))]
    for compiled in kernels:
        ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
        assert "wgmma.mma_async" in ptx
        # each step's quant bytes in 16-byte loads, whatever the byte-wise decoding does after them
        assert re.findall(r"ld\.global\.v4\.b32", ptx) and not re.findall(r"ld\.global\.b32", ptx)
        # what shared memory hands the products' first operand: (rows, 32) int8 quant bytes or (rows, 1) constants
        operands = re.findall(r"-> tensor<(\d+)x(\d+)x(\w+), #ttg\.dot_op<\{opIdx = 0", ttgir)
        loaded = re.findall(r"ttg\.local_load [^\n]*-> tensor<(\d+)x(\d+)x(\w+), #ttg\.dot_op<\{opIdx = 0", ttgir)
        assert operands and ("128", "32", "i8") in loaded
        assert all(kind == "i8" or cols == "1" for _, cols, kind in loaded), loaded
        ones = re.findall(r"or\.b32\s+%r\d+, %r\d+, 1065353216;", ptx)   # | 0x3F800000
        conversions = re.findall(r"cvt\.rn\.f32\.[su]32", ptx)    # the scales' few, not one a weight
        assert ones and len(ones) >= 4 * len(conversions), (len(ones), len(conversions))
        prefetches = re.findall(r"prefetch\.global\.L1", ptx)
        assert bool(prefetches) == ahead


def test_a_tiles_order_is_checked_and_reaches_only_q4_k_quarter_steps():
    """tile_form reads (N, warps, stages[, piece[, order]]); the weights-first order needs quarter steps, and any
    other format keeps whole super-blocks with the tokens first (weights_first is false for it)."""
    from vismmoe_kt.runtime.kernels import quantized_major as qm
    from vismmoe_kt.runtime.kernels import tuning

    assert qm.tile_form((64, 4, 1)) == (64, 4, 1, 256, "tokens")
    form = qm.tile_form((128, 4, 1, 64, "weights"))
    assert form == (128, 4, 1, 64, "weights")
    assert qm.weights_first("q4_k", form) and qm.quarter_steps("q4_k", form)
    assert not qm.weights_first("q6_k", form) and not qm.weights_first("q4_k", qm.tile_form((128, 4, 1, 64)))
    # another format keeps the default entry's tokens-first prompt tiles, not 128 rows of whole super-blocks
    assert qm.format_form("q4_k", "down", form) == form
    assert qm.format_form("q8_0", "down", form) == qm.tile_form(tuning.entry(tuning.DEFAULT)["quantized_prefill"]["down"])
    assert qm.format_form("q8_0", "gate_up", qm.tile_form((128, 4, 3, 64))) == (128, 4, 3, 64, "tokens")
    # Q5_K and Q6_K: 8 warps, at most 32 rows of gate_up and 64 of down (their whole super-blocks stay in registers)
    assert qm.format_form("q6_k", "down", form) == (64, 8, 1, 256, "tokens")
    assert qm.format_form("q5_k", "gate_up", qm.tile_form((64, 4, 1))) == (32, 8, 1, 256, "tokens")
    assert qm.format_form("q6_k", "down", qm.tile_form((16, 2, 1))) == (16, 8, 1, 256, "tokens")
    with pytest.raises(ValueError, match="quarter super-block"):
        qm.tile_form((128, 4, 1, 256, "weights"))
    # the weights first, prefetching a step ahead: the same rules
    ahead = qm.tile_form((128, 4, 1, 64, "weights-ahead"))
    assert qm.weights_first("q4_k", ahead) and not qm.weights_first("q6_k", ahead)
    assert qm.format_form("q6_k", "down", ahead) == (64, 8, 1, 256, "tokens")
    with pytest.raises(ValueError, match="quarter super-block"):
        qm.tile_form((128, 4, 1, 256, "weights-ahead"))
    with pytest.raises(ValueError, match="order 'columns'"):
        qm.tile_form((128, 4, 1, 64, "columns"))


@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_q6_k_tiles_keep_their_decoding_in_registers_on_hopper(hopper, part):
    """Q6_K (a Q4_K_M file's down experts) at the tiles format_form gives it from the prompt's and a batched step's
    tuned ones: compiled for sm_90 (ptxas), a few words of local memory at most, where the tuned tiles themselves
    spilled thousands of loads and stores (the prompt's down (128, 4, 1): 8601). Read with Triton's nvdisasm."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    from vismmoe_kt.runtime.kernels import quantized_major as qm
    from vismmoe_kt.runtime.kernels import tuning

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip("no nvdisasm in this Triton")
    blocks = {"expert_ptr": "*i64", "pairs_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_ptr": "*u8",
              "slab_bytes": "i64", "staging_offset": "i64", "staging_bytes": "i64", "H": "constexpr", "I": "constexpr",
              "KIND": "constexpr", "SB_BYTES": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
              "PIECE": "constexpr"}
    entry = tuning.entry("NVIDIA H200")
    for tiles, block_m in ((entry["quantized_prefill"][part], 32), (entry["quantized_major"][part], 16)):
        n, warps, stages, piece, _ = qm.format_form("q6_k", part, qm.tile_form(tiles))
        shapes = {**hopper.shapes, "BLOCK_M": block_m, "BLOCK_N": n, "KIND": qm.TILE_KINDS["q6_k"],
                  "SB_BYTES": qm.TILE_BYTES["q6_k"], "PIECE": piece}
        if part == "gate_up":
            compiled = hopper.compile(qm._gate_up_q_blocks, {"x_ptr": "*bf16", "h_ptr": "*bf16", "TOP_K": "constexpr",
                                                             "DOWN_KIND": "constexpr", **blocks},
                                      {**shapes, "TOP_K": 8, "DOWN_KIND": shapes["KIND"]}, num_warps=warps,
                                      num_stages=stages)
        else:
            compiled = hopper.compile(qm._down_q_blocks, {"h_ptr": "*bf16", "y_ptr": "*fp32", "PART_BYTES": "constexpr",
                                                          **blocks},
                                      {**shapes, "PART_BYTES": 2 * hopper.shapes["I"] * 8 * qm.TILE_BYTES["q4_k"]},
                                      num_warps=warps, num_stages=stages)
        cubin = Path(tempfile.mkdtemp()) / "q6k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, timeout=60).stdout
        assert sass.count("HMMA") > 0                                      # the kernel's code, read
        assert len(re.findall(r"\b(?:LDL|STL)\b", sass)) <= 32, (tiles, block_m, (n, warps))
