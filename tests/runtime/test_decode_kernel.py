"""The decode experts' Triton kernels against their torch twin, in Triton's interpreter (no GPU).

The kernels read each pair's weights from its slab or from the host store by address and write a
missing expert into its landing slab; the twin does the same in torch. The plan and combine kernels
do DecodeTable's lookup and publish in one launch each; they must leave the same table behind. Run in a subprocess because
the interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 at import).
"""

import os
import subprocess
import sys

import pytest

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
assert tables[1].slots[1, 3] == 3 and tables[1].owner[1, 1] == 3 and tables[1].used[1] == 2
print("OK")
"""


def test_kernels_match_the_twin_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def test_kernels_compile_for_hopper():
    """Triton's compiler front end and ptxas accept every kernel for sm_90 (what the interpreter does
    not check: e.g. a name given two types), with the shapes and tiles of Qwen3-VL-30B-A3B."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vismmoe_kt.runtime import decode_kernel as dk

    def compile_for_hopper(kernel, signature, constants):
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))

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
    table = {name: "*i64" for name in ("ids_ptr", "table_ptr", "landing_ptr", "count_ptr", "used_ptr", "routed_ptr",
                                       "read_ptr", "slots_ptr", "land_ptr")}
    small = {"E1": 129, "K": 8, "KP": 8}
    compile_for_hopper(dk._plan_kernel, {**table, "row": "i32", "E1": "constexpr", "K": "constexpr", "KP": "constexpr"},
                       small)
    for publish in (True, False):
        compile_for_hopper(dk._combine_kernel, {
            "y_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*bf16", "ids_ptr": "*i64", "land_ptr": "*i64",
            "table_ptr": "*i64", "owner_ptr": "*i64", "used_ptr": "*i64", "row": "i32", "H": "i32", "E1": "constexpr",
            "K": "constexpr", "KP": "constexpr", "PUBLISH": "constexpr", "BLOCK": "constexpr"},
            {**small, "PUBLISH": publish, "BLOCK": 1024})
