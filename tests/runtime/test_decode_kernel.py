"""The decode experts' Triton kernels against their torch twin, in Triton's interpreter (no GPU).

The kernels read each pair's weights from its slab or from the host store by address and write a
missing expert into its landing slab; the twin does the same in torch. Run in a subprocess because
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
print("OK")
"""


def test_kernels_match_the_twin_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
