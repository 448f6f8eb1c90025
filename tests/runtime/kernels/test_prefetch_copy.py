"""The lookahead prefetch inside the graph (runtime/kernels/prefetch_copy.py): claim, copy from the
host, publish, against DecodeTable's torch twin, in Triton's interpreter (no GPU); and the kernel compiled
for Hopper (kernel_cases.py: the fixtures).
"""

from kernel_cases import hopper, interpreter  # noqa: F401 (fixtures)

SCRIPT = r"""
from vismmoe_kt.runtime.decode_table import DecodeTable

E, H, I, K = 6, 160, 40, 3
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
"""


def test_kernels_match_the_twin_in_the_interpreter(interpreter):
    interpreter(SCRIPT)


def test_kernels_compile_for_hopper(hopper):
    from vismmoe_kt.runtime.kernels import prefetch_copy

    down = hopper.shapes["I"] * hopper.shapes["H"]
    gate_up = 2 * down
    hopper.compile(prefetch_copy._prefetch_copy_kernel, {
        "rows_ptr": "*i64", "ids_ptr": "*i64", "slab_ptr": "*i64", "host_ptr": "*i64", "gate_up_addr": "i64",
        "down_addr": "i64", "B": "i32", "block_elems": "i32", "ROUNDS": "constexpr", "W_DTYPE": "constexpr", "ELEM_BYTES": "constexpr",
        "GATE_UP": "constexpr", "CHUNK": "constexpr", "PROGRAMS": "constexpr"},
        {"ROUNDS": 60, "W_DTYPE": hopper.tl.bfloat16, "ELEM_BYTES": 2, "GATE_UP": gate_up,
         "CHUNK": prefetch_copy.copy_chunk(gate_up, down), "PROGRAMS": hopper.tuned["prefetch_programs"]})
