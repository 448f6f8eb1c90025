"""The BF16 GEMVs (runtime/kernels/bf16_gemv.py) against their torch twin, in Triton's interpreter
(no GPU): each pair's weights read from its slab or from the host store by address, a missing
expert written into its landing slab as it is read, the same as the twin; and the kernels compiled
for Hopper (kernel_cases.py: the fixtures).
"""

from kernel_cases import hopper, interpreter  # noqa: F401 (fixtures)

SCRIPT = r"""
from vismmoe_kt.runtime.kernels import bf16_gemv
from vismmoe_kt.runtime.table_experts import experts_twin, combine

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
    got = bf16_gemv.experts_where_they_lie(x, ids, slots, land, kernel_pools, host.data_ptr(), host.shape[1], K)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(kernel_pools[0][0], gu[0]) and torch.equal(kernel_pools[1][0], dn[0])
    assert torch.equal(kernel_pools[0][4], gu[5]) and torch.equal(kernel_pools[1][4], dn[5])
    for slab in (1, 2, 3):  # nothing else written
        assert torch.equal(kernel_pools[0][slab], pools[0][slab]) and torch.equal(kernel_pools[1][slab], pools[1][slab])
    weights = torch.rand(T, K)
    again = bf16_gemv.experts_where_they_lie(x, ids, slots, land, kernel_pools, host.data_ptr(), host.shape[1], K)
    assert torch.equal(combine(got, weights, dtype), combine(again, weights, dtype))  # deterministic
"""


def test_kernels_match_the_twin_in_the_interpreter(interpreter):
    interpreter(SCRIPT)


def test_kernels_compile_for_hopper(hopper):
    from vismmoe_kt.runtime.kernels import bf16_gemv

    tuned = hopper.tuned["bf16_gemv"]
    weights = {"ids_ptr": "*i64", "slots_ptr": "*i64", "land_ptr": "*i64", "pool_addr": "i64", "host_addr": "i64",
               "slab_elems": "i32", "block_elems": "i32", "H": "constexpr", "I": "constexpr", "W_DTYPE": "constexpr",
               "ELEM_BYTES": "constexpr", "BLOCK_ROWS": "constexpr", "BLOCK_COLS": "constexpr"}
    shapes = {**hopper.shapes, "W_DTYPE": hopper.tl.bfloat16, "ELEM_BYTES": 2}
    rows, cols, _ = tuned["gate_up"]
    hopper.compile(bf16_gemv._gate_up_kernel, {"x_ptr": "*bf16", "h_ptr": "*fp32", "TOP_K": "constexpr", **weights},
                   {**shapes, "TOP_K": 8, "BLOCK_ROWS": rows, "BLOCK_COLS": cols})
    rows, cols, _ = tuned["down"]
    hopper.compile(bf16_gemv._down_kernel, {"h_ptr": "*fp32", "y_ptr": "*fp32", **weights},
                   {**shapes, "BLOCK_ROWS": rows, "BLOCK_COLS": cols})
