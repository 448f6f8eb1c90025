"""The decode experts' Triton kernels against their torch twin, in Triton's interpreter (no GPU).

The kernels read each pair's weights from its slab or from the host store by address and write a
missing expert into its landing slab; the twin does the same in torch. The plan and combine kernels
do DecodeTable's lookup and publish in one launch each; they must leave the same table behind. Run in a subprocess because
the interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 at import).
"""

import pytest

from conftest import UNDER_INTERPRETER, compile_for_hopper, run_in_triton_interpreter

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from vismmoe_kt.runtime import decode_kernel
from vismmoe_kt.runtime.table_experts import experts_twin, combine

torch.manual_seed(0)
E, H, I, K, T, S = 6, 160, 40, 3, 2, 5   # H, I not multiples of the tiles: the masks matter
for dtype in (torch.float32, torch.bfloat16):
    host = (torch.randn(E, 3 * I * H) / 8).to(dtype)
    pools = [torch.randn(S + 1, 2 * I, H).to(dtype), torch.randn(S + 1, H, I).to(dtype)]
    gu, dn = host[:, :2 * I * H].view(E, 2 * I, H), host[:, 2 * I * H:].view(E, H, I)
    pools[0][1], pools[1][1] = gu[4], dn[4]   # expert 4 resident in slab 1, expert 2 in slab 3
    pools[0][3], pools[1][3] = gu[2], dn[2]
    ids = torch.tensor([4, 0, 2, 5, 4, 1])
    slots = torch.tensor([1, -1, 3, -1, 1, -2])
    land = torch.tensor([-1, 0, -1, 4, -1, -1])  # experts 0 and 5 land in slabs 0 and 4; 1 only read
    x = torch.randn(T, H).to(dtype)
    twin_pools = [p.clone() for p in pools]
    kernel_pools = [p.clone() for p in pools]
    want = experts_twin(x, ids, slots, land, twin_pools, host, torch.nn.SiLU(), K)
    got = decode_kernel.experts_where_they_lie(x, ids, slots, land, kernel_pools, host.data_ptr(), host.shape[1], K)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(kernel_pools[0][0], gu[0]) and torch.equal(kernel_pools[1][0], dn[0])
    assert torch.equal(kernel_pools[0][4], gu[5]) and torch.equal(kernel_pools[1][4], dn[5])
    for slab in (1, 2, 3):  # nothing else written
        assert torch.equal(kernel_pools[0][slab], pools[0][slab]) and torch.equal(kernel_pools[1][slab], pools[1][slab])
    weights = torch.rand(T, K)
    again = decode_kernel.experts_where_they_lie(x, ids, slots, land, kernel_pools, host.data_ptr(), host.shape[1], K)
    assert torch.equal(combine(got, weights, dtype), combine(again, weights, dtype))  # deterministic

# the plan and combine-with-publish kernels against DecodeTable's torch lookup and publish
from vismmoe_kt.runtime.decode_table import DecodeTable
tables = [DecodeTable(2, 6, 3, torch.device("cpu")) for _ in range(2)]
for table in tables:
    table.slots[1, :6] = torch.tensor([4, -1, -2, -1, -1, 0])
    table.landing[1] = torch.tensor([2, 3, -1])
    table.count[1], table.used[1] = 2, 1           # one slot already taken by an earlier run of the step
ids = torch.tensor([3, 0, 1])
y, w = torch.randn(3, H), torch.rand(1, 3)
slots, land = tables[0].lookup(1, ids)
want = combine(y, w, torch.float32)
tables[0].publish(1, ids, land)
k_slots, k_land = decode_kernel.plan(tables[1], 1, ids)
assert k_slots.tolist() == slots.tolist() == [-1, 4, -1] and k_land.tolist() == land.tolist() == [3, -1, -1]
got = decode_kernel.combine(y, w, torch.float32, tables[1], 1, ids, k_land)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
for name in ("slots", "owner", "used", "routed", "read"):
    assert torch.equal(getattr(tables[0], name), getattr(tables[1], name)), name
# expert 3 took the second slot (slab 3); expert 1 found none left: its claim was undone
assert tables[1].slots[1, 3] == 3 and tables[1].slots[1, 1] == -1 and tables[1].owner[1, 1] == 3
assert tables[1].used[1] == 3

# hybrid: the last cpu_quota[m] of m misses go to the CPU (slot -3): no claim, and the experts read nothing
tables = [DecodeTable(2, 6, 3, torch.device("cpu")) for _ in range(2)]
for table in tables:
    table.slots[1, :6] = torch.tensor([4, -1, -1, -1, 2, 0])
    table.landing[1] = torch.tensor([1, 3, 5])
    table.count[1] = 3
    table.set_cpu_quota([0, 1, 1, 2])             # 3 misses: the last 2 to the CPU, the first lands
ids = torch.tensor([3, 1, 2])                      # all three miss
slots, land = tables[0].lookup(1, ids)
k_slots, k_land = decode_kernel.plan(tables[1], 1, ids)
assert k_slots.tolist() == slots.tolist() == [-1, -3, -3] and k_land.tolist() == land.tolist() == [1, -1, -1]
assert torch.equal(tables[0].slots[:, :6], tables[1].slots[:, :6])  # column 6 is the twin's scatter dump
for name in ("owner", "used", "routed", "read"):
    assert torch.equal(getattr(tables[0], name), getattr(tables[1], name)), name
assert tables[1].slots[1, 3] == -2 and tables[1].slots[1, 1] == -1 and tables[1].read[1].tolist() == [-1, -3, -3]
host = (torch.randn(E, 3 * I * H) / 8).float()
pools = [torch.randn(S + 1, 2 * I, H), torch.randn(S + 1, H, I)]
x, cpu_slots = torch.randn(1, H), torch.tensor([-3, 1, -1])
ids, land = torch.tensor([3, 4, 0]), torch.tensor([-1, -1, 2])
want = experts_twin(x, ids, cpu_slots, land, [p.clone() for p in pools], host, torch.nn.SiLU(), 3)
got = decode_kernel.experts_where_they_lie(x, ids, cpu_slots, land, [p.clone() for p in pools], host.data_ptr(),
                                           host.shape[1], 3)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
assert torch.equal(got[0], torch.zeros(H)) and got[1].abs().sum() > 0 and got[2].abs().sum() > 0

# a quantized store's misses: fetched and dequantized into their landing or scratch slabs, kernel = twin
from vismmoe_kt.runtime.store import ExpertStore
from vismmoe_kt.runtime.table_experts import fetch_dequantized
from vismmoe_kt.runtime.decode_table import CPU_PAIR
from vismmoe_kt.runtime import q4k
QE = 5
gen = torch.Generator().manual_seed(0)
q6k_down = torch.randint(0, 256, (QE, 256, 2 * 210), dtype=torch.uint8, generator=gen)  # Q6_K rows of 512
for d_at in (208, 418):  # each super-block's own finite d (a kernel reading another block's would differ)
    d = (torch.rand(QE, 256, 1, generator=gen) * 0.02 + 0.001).to(torch.float16)
    q6k_down[..., d_at:d_at + 2] = d.view(torch.uint8)
for dtype, fmt, (QH, QI), down_fmt in ((torch.float32, "q8_0", (96, 64), None), (torch.bfloat16, "q8_0", (96, 64), None),
                                       (torch.float32, "q4_0", (96, 64), None), (torch.float32, "q4_k", (256, 512), None),
                                       (torch.bfloat16, "q4_k", (256, 512), None),
                                       (torch.float32, "q5_k", (256, 512), None),
                                       (torch.float32, "q4_k", (256, 512), "q6_k")):
    store = ExpertStore(QE, QH, QI, dtype, pin_memory=False, fmt=fmt)
    if down_fmt is None:
        store.fill_layer(0, torch.randn(QE, 2 * QI, QH) / 8, torch.randn(QE, QH, QI) / 8)
    else:  # a Q4_K_M file's layer: gate and up in Q4_K, down in Q6_K, as stored
        gate, up = (q4k.quantize(torch.randn(QE, QI, QH) / 8) for _ in range(2))
        store.fill_layer_raw(0, gate, up, q6k_down, down_format=down_fmt)
        assert store.down_format(0) == "q6_k" and store.block_bytes_of(0) > store.block_bytes
    ids, q_slots, q_land = torch.tensor([1, 3, 4, 0]), torch.tensor([-1, 2, -2, CPU_PAIR]), torch.tensor([1, -1, -1, -1])
    results = []
    for use_kernel in (False, True):
        pools = [torch.zeros(9, 2 * QI, QH, dtype=dtype), torch.zeros(9, QH, QI, dtype=dtype)]  # 4 slabs, 4 scratch, dump
        read = fetch_dequantized(ids, q_slots, q_land, pools, store.layers[0], store, 4, use_kernel, 0)
        results.append((read, pools))
    (read, twin), (k_read, kern) = results
    assert read.tolist() == k_read.tolist() == [1, 2, 6, CPU_PAIR]  # landed in slab 1; expert 4 in scratch 4 + 2
    want_gu, want_dn = store.dequantized(store.layers[0][torch.tensor([1, 4])], 0)
    # exact in fp32; in bf16 the interpreter's cast from fp32 may round the last bit differently
    close = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    for slab, i in ((1, 0), (6, 1)):
        torch.testing.assert_close(kern[0][slab], want_gu[i], **close)
        torch.testing.assert_close(kern[1][slab], want_dn[i], **close)
        assert torch.equal(twin[0][slab], want_gu[i]) and torch.equal(twin[1][slab], want_dn[i])
    for slab in (0, 2, 3, 4, 5, 7):  # nothing else written (the twin's dump is row 8)
        assert not kern[0][slab].any() and not kern[1][slab].any()

# quantized slabs: misses copied as they are into their landing or scratch slab, every pair decoded by the GEMVs
from vismmoe_kt.runtime.table_experts import quantized_slab_outputs
QH, QI, QK = 256, 512, 2
for dtype, fmt, down_fmt in ((torch.float32, "q8_0", None), (torch.float32, "q4_0", None), (torch.float32, "q4_k", None),
                             (torch.bfloat16, "q4_k", None), (torch.float32, "q5_k", None),
                             (torch.float32, "q4_k", "q6_k"),  # a Q4_K_M file's layer, down in Q6_K
                             (torch.float32, "q4_k:bytes", None)):  # Q4_K's quant bytes read one by one, not as words
    decode_kernel.Q4K_WORD_LOADS = not fmt.endswith(":bytes")
    fmt = fmt.split(":")[0]
    store = ExpertStore(QE, QH, QI, dtype, pin_memory=False, fmt=fmt)
    if down_fmt is None:
        store.fill_layer(0, torch.randn(QE, 2 * QI, QH) / 8, torch.randn(QE, QH, QI) / 8)
    else:
        gate, up = (q4k.quantize(torch.randn(QE, QI, QH) / 8) for _ in range(2))
        store.fill_layer_raw(0, gate, up, q6k_down, down_format=down_fmt)
    bb = store.block_bytes_of(0)
    ids = torch.tensor([1, 3, 4, 0])                    # tokens 0 and 1, two experts each
    slots, land = torch.tensor([-1, 2, -2, -1]), torch.tensor([1, -1, -1, -1])
    x = torch.randn(2, QH).to(dtype)
    outs = []
    for use_kernel in (False, True):
        pool = torch.zeros(9, bb + 64, dtype=torch.uint8)  # rows wider than a block: the row stride matters
        pool[2, :bb] = store.layers[0][3]                    # expert 3 resident in slab 2
        y = quantized_slab_outputs(x, ids, slots, land, pool, store.layers[0], store, 0, 4, torch.nn.SiLU(), QK,
                                   use_kernel)
        outs.append((y, pool))
    (want, twin_pool), (got, kern_pool) = outs
    # the kernels decode into fp32; the twin (and the reference below) round the weights to the model's dtype first
    close = dict(rtol=2e-4, atol=2e-4) if dtype == torch.float32 else dict(rtol=0, atol=1e-2 * want.abs().max().item())
    torch.testing.assert_close(got, want, **close)
    # expert 1 landed in slab 1; experts 4 and 0 (no landing slab) in scratch slabs 4 + 2 and 4 + 3
    for slab, expert in ((1, 1), (6, 4), (7, 0)):
        assert torch.equal(kern_pool[slab, :bb], store.layers[0][expert]), (fmt, slab)
        assert torch.equal(twin_pool[slab, :bb], store.layers[0][expert]), (fmt, slab)
    for slab in (0, 3, 4, 5):
        assert not kern_pool[slab].any(), (fmt, slab)
    gu, dn = store.dequantized(store.layers[0][ids], 0)  # the reference: dequantize, then compute in fp32
    xs = x.float()[torch.arange(4) // QK]
    gate, up = torch.bmm(gu.float(), xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    ref = torch.bmm(dn.float(), (torch.nn.functional.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, ref, **close)
    # a prefill's bank decoded from the slabs (fetch_q8 on blocks already on the device, `staged`)
    bank = [torch.zeros(QE, 2 * QI, QH, dtype=dtype), torch.zeros(QE, QH, QI, dtype=dtype)]
    slabs_of, experts_of = torch.tensor([1, 6, 2]), torch.tensor([1, 4, 3])
    decode_kernel.fetch_q8(slabs_of, torch.ones(3, dtype=torch.int8), experts_of, bank, kern_pool.data_ptr(),
                           kern_pool.shape[1], QI, QH, fmt=fmt, down_fmt=down_fmt, staged=True)
    want_gu, want_dn = store.dequantized(store.layers[0][experts_of], 0)
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(bank[0][experts_of], want_gu, **exact)
    torch.testing.assert_close(bank[1][experts_of], want_dn, **exact)
    assert not bank[0][0].any() and not bank[0][2].any()

# lookahead prefetch: claim, copy from the host, publish, against the twin
L, R = 3, 4
host_rows = [None] + [(torch.randn(E, 3 * I * H) / 8).to(torch.bfloat16) for _ in range(L - 1)]  # row 0 pinned
addresses = torch.tensor([0] + [b.data_ptr() for b in host_rows[1:]])
results = []
for use_kernel in (False, True):
    table = DecodeTable(L, E, K, torch.device("cpu"), landing_slots=R)
    table.slots[0, :E] = torch.arange(E)                       # pinned: everything resident
    table.slots[1, :E] = torch.tensor([-1, 2, -2, -1, -1, -1])  # expert 1 resident, 2 arriving
    table.slots[2, :E] = torch.tensor([-1, -1, -1, -1, -1, -1])
    table.landing[1], table.landing[2] = torch.tensor([5, 6, -1, -1]), torch.tensor([7, 8, 9, -1])
    table.count[1], table.count[2], table.used[2] = 2, 3, 1
    pools = [torch.zeros(11, 2 * I, H, dtype=torch.bfloat16), torch.zeros(11, H, I, dtype=torch.bfloat16)]
    # candidates: pinned (nothing), resident, arriving, three misses of row 1 (two slots), two of row 2, a blank
    rows = torch.tensor([0, 1, 1, 1, 2, 1, 2, 1, 0])
    experts = torch.tensor([3, 1, 2, 0, 4, 3, 0, 5, -1])
    table.prefetch(rows, experts, pools, host_rows, use_kernel, addresses)
    results.append((table, pools))
(twin, twin_pools), (kern, kern_pools) = results
for name in ("slots", "owner", "used"):
    assert torch.equal(getattr(twin, name), getattr(kern, name)), (name, getattr(twin, name), getattr(kern, name))
assert twin.slots[1, :E].tolist() == [5, 2, -2, 6, -1, -1] and twin.slots[2, :E].tolist() == [9, -1, -1, -1, 8, -1]
assert twin.owner[1, :2].tolist() == [E + 0, E + 3] and twin.owner[2, 1:3].tolist() == [E + 4, E + 0]
for slab, (row, expert) in {5: (1, 0), 6: (1, 3), 8: (2, 4), 9: (2, 0)}.items():
    gu = host_rows[row][expert, :2 * I * H].view(2 * I, H)
    dn = host_rows[row][expert, 2 * I * H:].view(H, I)
    assert torch.equal(kern_pools[0][slab], gu) and torch.equal(kern_pools[1][slab], dn), slab
    assert torch.equal(twin_pools[0][slab], gu) and torch.equal(twin_pools[1][slab], dn), slab
for slab in (0, 1, 2, 3, 4, 7):
    assert not kern_pools[0][slab].any() and not kern_pools[1][slab].any(), slab
print("OK")
"""


def test_kernels_match_the_twin_in_the_interpreter():
    run_in_triton_interpreter(SCRIPT)


@pytest.mark.skipif(UNDER_INTERPRETER, reason="the interpreter replaces the compiler")
def test_kernels_compile_for_hopper():
    """Triton's compiler front end and ptxas accept every kernel for sm_90 (what the interpreter does
    not check: e.g. a name given two types), with the shapes and tiles of Qwen3-VL-30B-A3B."""
    import triton.language as tl

    from vismmoe_kt.runtime import decode_kernel as dk

    weights = {"ids_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_addr": "i64", "host_addr": "i64",
               "slab_elems": "i32", "block_elems": "i32", "H": "constexpr", "I": "constexpr", "W_DTYPE": "constexpr",
               "ELEM_BYTES": "constexpr", "BLOCK_ROWS": "constexpr", "BLOCK_COLS": "constexpr"}
    shapes = {"H": 2048, "I": 768, "W_DTYPE": tl.bfloat16, "ELEM_BYTES": 2}
    rows, cols, _ = dk.GATE_UP_CONFIG
    compile_for_hopper(dk._gate_up_kernel, {"x_ptr": "*bf16", "h_ptr": "*fp32", "TOP_K": "constexpr", **weights},
                       {**shapes, "TOP_K": 8, "BLOCK_ROWS": rows, "BLOCK_COLS": cols})
    rows, cols, _ = dk.DOWN_CONFIG
    compile_for_hopper(dk._down_kernel, {"h_ptr": "*fp32", "y_ptr": "*fp32", **weights},
                       {**shapes, "BLOCK_ROWS": rows, "BLOCK_COLS": cols})
    table = {name: "*i64" for name in ("ids_ptr", "table_ptr", "landing_ptr", "count_ptr", "used_ptr", "owner_ptr",
                                       "routed_ptr", "read_ptr", "slots_ptr", "land_ptr", "quota_ptr")}
    small = {"E1": 129, "K": 8, "KP": 8, "R": 12}
    for stride in (8, 64):  # a single step's records, and a batched step's
        compile_for_hopper(dk._plan_kernel, {**table, "row": "i32", "E1": "constexpr", "K": "constexpr",
                                             "KP": "constexpr", "R": "constexpr", "STRIDE": "constexpr"},
                           {**small, "STRIDE": stride})
    q8 = {"ids_ptr": "*i64", "need_ptr": "*i8", "target_ptr": "*i64", "pool_ptr": "*bf16", "host_addr": "i64",
          "block_bytes": "i64", "part_bytes": "i64", "slab_elems": "i64", "part_elems": "i64", "ROWS": "constexpr",
          "COLS": "constexpr", "BLOCK_ROWS": "constexpr", "QBLOCKS": "constexpr"}
    for q4 in (False, True):
        compile_for_hopper(dk._fetch_q8_kernel, {**q8, "Q4": "constexpr"},
                           {"ROWS": 1536, "COLS": 2048, "BLOCK_ROWS": 16, "QBLOCKS": 8, "Q4": q4})
    kquant = {**{name: kind for name, kind in q8.items() if name != "QBLOCKS"}, "KIND": "constexpr"}
    for rows, cols, kind in ((1536, 2048, 4), (2048, 768, 4), (1536, 2048, 5), (2048, 768, 6)):  # Qwen3-VL-30B-A3B's
        compile_for_hopper(dk._fetch_kquant_kernel, kquant, {"ROWS": rows, "COLS": cols, "BLOCK_ROWS": 16, "KIND": kind})
    compile_for_hopper(dk._stage_kernel, {"ids_ptr": "*i64", "need_ptr": "*i8", "target_ptr": "*i64", "staging_ptr": "*i32",
                                          "host_addr": "i64", "block_words": "i64", "row_words": "i64",
                                          "CHUNK": "constexpr"}, {"CHUNK": dk.STAGE_CHUNK})
    quantized = {"slots_ptr": "*i64", "pool_addr": "i64", "slab_bytes": "i64", "H": "constexpr", "I": "constexpr",
                 "KIND": "constexpr", "SB_BYTES": "constexpr", "BLOCK_ROWS": "constexpr"}
    for fmt in [*dk.TILE_KINDS, "q4_k words"]:  # every format the quantized slabs hold, at Qwen3-VL-30B-A3B's shapes
        kind = 44 if fmt == "q4_k words" else dk.TILE_KINDS[fmt]
        tile = {"H": 2048, "I": 768, "KIND": kind, "SB_BYTES": dk.TILE_BYTES[fmt.split()[0]], "BLOCK_ROWS": 16}
        compile_for_hopper(dk._gate_up_q_kernel, {"x_ptr": "*bf16", "h_ptr": "*fp32", "TOP_K": "constexpr", **quantized},
                           {**tile, "TOP_K": 8})
        compile_for_hopper(dk._down_q_kernel, {"h_ptr": "*fp32", "y_ptr": "*fp32", "part_bytes": "i64", **quantized}, tile)
    for publish in (True, False):
        compile_for_hopper(dk._combine_kernel, {
            "y_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*bf16", "ids_ptr": "*i64", "land_ptr": "*i64",
            "table_ptr": "*i64", "row": "i32", "H": "i32", "E1": "constexpr",
            "K": "constexpr", "KP": "constexpr", "PUBLISH": "constexpr", "BLOCK": "constexpr"},
            {"E1": 129, "K": 8, "KP": 8, "PUBLISH": publish, "BLOCK": 1024})
    candidates = {"rows_ptr": "*i64", "ids_ptr": "*i64", "table_ptr": "*i64", "landing_ptr": "*i64",
                  "count_ptr": "*i64", "used_ptr": "*i64", "owner_ptr": "*i64", "slab_ptr": "*i64", "B": "i32",
                  "E": "constexpr", "R": "constexpr", "BP": "constexpr"}
    compile_for_hopper(dk._prefetch_claim_kernel, candidates, {"E": 128, "R": 12, "BP": 32})
    gate_up, down = 2 * 768 * 2048, 768 * 2048
    compile_for_hopper(dk._prefetch_copy_kernel, {
        "rows_ptr": "*i64", "ids_ptr": "*i64", "slab_ptr": "*i64", "host_ptr": "*i64", "gate_up_addr": "i64",
        "down_addr": "i64", "B": "i32", "block_elems": "i32", "ROUNDS": "constexpr", "W_DTYPE": "constexpr", "ELEM_BYTES": "constexpr",
        "GATE_UP": "constexpr", "CHUNK": "constexpr", "PROGRAMS": "constexpr"},
        {"ROUNDS": 60, "W_DTYPE": tl.bfloat16, "ELEM_BYTES": 2, "GATE_UP": gate_up, "CHUNK": dk.copy_chunk(gate_up, down),
         "PROGRAMS": dk.PREFETCH_PROGRAMS})
    compile_for_hopper(dk._prefetch_publish_kernel, {"rows_ptr": "*i64", "ids_ptr": "*i64", "slab_ptr": "*i64",
                                                     "table_ptr": "*i64", "B": "i32", "E": "constexpr",
                                                     "BP": "constexpr"}, {"E": 128, "BP": 32})
