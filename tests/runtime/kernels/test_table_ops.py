"""The decode table's kernels (runtime/kernels/table_ops.py): plan and combine-with-publish do
DecodeTable's lookup and publish in one launch each and must leave the same table behind, the
hybrid's CPU pairs included; in Triton's interpreter (no GPU); and the kernels compiled for Hopper
(kernel_cases.py: the fixtures).
"""

from kernel_cases import hopper, interpreter  # noqa: F401 (fixtures)

SCRIPT = r"""
from vismmoe_kt.runtime.kernels import bf16_gemv, table_ops
from vismmoe_kt.runtime.table_experts import experts_twin, combine

E, H, I, S = 6, 160, 40, 5

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
k_slots, k_land = table_ops.plan(tables[1], 1, ids)
assert k_slots.tolist() == slots.tolist() == [-1, 4, -1] and k_land.tolist() == land.tolist() == [3, -1, -1]
got = table_ops.combine(y, w, torch.float32, tables[1], 1, ids, k_land)
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
k_slots, k_land = table_ops.plan(tables[1], 1, ids)
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
got = bf16_gemv.experts_where_they_lie(x, ids, cpu_slots, land, [p.clone() for p in pools], host.data_ptr(),
                                       host.shape[1], 3)
# fp32 in a different summation order: within a few ulps of the outputs' scale
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())
assert torch.equal(got[0], torch.zeros(H)) and got[1].abs().sum() > 0 and got[2].abs().sum() > 0
"""


def test_kernels_match_the_twin_in_the_interpreter(interpreter):
    interpreter(SCRIPT)


def test_kernels_compile_for_hopper(hopper):
    from vismmoe_kt.runtime.kernels import table_ops

    table = {name: "*i64" for name in ("ids_ptr", "table_ptr", "landing_ptr", "count_ptr", "used_ptr", "owner_ptr",
                                       "routed_ptr", "read_ptr", "slots_ptr", "land_ptr", "quota_ptr")}
    small = {"E1": 129, "K": 8, "KP": 8, "R": 12}
    for stride in (8, 64):  # a single step's records, and a batched step's
        hopper.compile(table_ops._plan_kernel, {**table, "row": "i32", "E1": "constexpr", "K": "constexpr",
                                         "KP": "constexpr", "R": "constexpr", "STRIDE": "constexpr"},
                       {**small, "STRIDE": stride})
    for publish in (True, False):
        hopper.compile(table_ops._combine_kernel, {
            "y_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*bf16", "ids_ptr": "*i64", "land_ptr": "*i64",
            "table_ptr": "*i64", "row": "i32", "H": "i32", "E1": "constexpr",
            "K": "constexpr", "KP": "constexpr", "PUBLISH": "constexpr", "BLOCK": "constexpr"},
            {"E1": 129, "K": 8, "KP": 8, "PUBLISH": publish, "BLOCK": 1024})
    candidates = {"rows_ptr": "*i64", "ids_ptr": "*i64", "table_ptr": "*i64", "landing_ptr": "*i64",
                  "count_ptr": "*i64", "used_ptr": "*i64", "owner_ptr": "*i64", "slab_ptr": "*i64", "B": "i32",
                  "E": "constexpr", "R": "constexpr", "BP": "constexpr"}
    hopper.compile(table_ops._prefetch_claim_kernel, candidates, {"E": 128, "R": 12, "BP": 32})
    hopper.compile(table_ops._prefetch_publish_kernel, {"rows_ptr": "*i64", "ids_ptr": "*i64", "slab_ptr": "*i64",
                                                 "table_ptr": "*i64", "B": "i32", "E": "constexpr",
                                                 "BP": "constexpr"}, {"E": 128, "BP": 32})
