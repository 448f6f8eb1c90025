"""A batched step's experts on quantized slabs, expert by expert (runtime/kernels/quantized_major.py), and the
table's lookup and publish for several tokens at once: the Triton kernels against the torch twins and a
dequantize-then-compute reference, in Triton's interpreter; the kernels compiled for Hopper at
Qwen3-VL-30B-A3B's shapes (kernel_cases.py: the fixtures, and the stores and the reference the script builds)."""

import pytest

from kernel_cases import hopper, interpreter  # noqa: F401 (fixtures)

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

    blocks = {"expert_ptr": "*i64", "pairs_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_addr": "i64",
              "slab_bytes": "i64",
              "staging_addr": "i64", "staging_bytes": "i64", "H": "constexpr", "I": "constexpr", "KIND": "constexpr",
              "SB_BYTES": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    shapes = {**hopper.shapes, "BLOCK_M": em.BLOCK_M, "KIND": qm.TILE_KINDS[fmt], "SB_BYTES": qm.TILE_BYTES[fmt]}
    tuned = hopper.tuned["quantized_major"]
    n, warps, stages = tuned["gate_up"]
    hopper.compile(qm._gate_up_q_blocks, {"x_ptr": "*bf16", "h_ptr": "*bf16", "TOP_K": "constexpr", **blocks},
                   {**shapes, "TOP_K": 8, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
    n, warps, stages = tuned["down"]
    hopper.compile(qm._down_q_blocks, {"h_ptr": "*bf16", "y_ptr": "*fp32", "PART_BYTES": "constexpr", **blocks},
                   {**shapes, "BLOCK_N": n, "PART_BYTES": 2 * hopper.shapes["I"] * 8 * qm.TILE_BYTES[fmt]},
                   num_warps=warps, num_stages=stages)
    hopper.compile(qm._stage_kernel, {"ids_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_ptr": "*i32",
                                      "staging_ptr": "*i32", "host_addr": "i64", "block_words": "i32",
                                      "pool_words": "i32", "staging_words": "i32", "CHUNK": "constexpr"},
                   {"CHUNK": qm.STAGE_CHUNK})
