"""The quantized slabs' staging plan (kernels/block_staging.py): which pairs stage their block, where to,
and which row the GEMVs read, one kernel against its torch twin in Triton's interpreter; compiled for
Hopper."""

import pytest

from conftest import UNDER_INTERPRETER, compile_for_hopper
from kernel_cases import interpreter  # noqa: F401  (fixture)


def test_the_staging_plan_kernel_matches_its_twin(interpreter):  # noqa: F811
    interpreter("""
from vismmoe_kt.runtime.kernels.block_staging import staging_plan
for pairs in (8, 13, 64):
    slots = torch.randint(-3, 20, (pairs,))
    land = torch.where(torch.rand(pairs) < 0.5, torch.randint(0, 20, (pairs,)), torch.full((pairs,), -1))
    need, target, read = staging_plan(slots, land, 100, use_kernel=True)
    want_need, want_target, want_read = staging_plan(slots, land, 100, use_kernel=False)
    assert need.dtype == torch.int8 and want_need.dtype == torch.bool
    assert torch.equal(need.bool(), want_need) and torch.equal(target, want_target) and torch.equal(read, want_read)
    assert bool((read[slots >= 0] == slots[slots >= 0]).all()) and bool((target[land < 0] >= 100).all())
""")


@pytest.mark.skipif(UNDER_INTERPRETER, reason="the interpreter replaces the compiler")
def test_the_staging_plan_kernel_compiles_for_hopper():
    pytest.importorskip("triton")
    from vismmoe_kt.runtime.kernels import block_staging

    compile_for_hopper(block_staging._staging_plan_kernel,
                       {"slots_ptr": "*i64", "land_ptr": "*i64", "need_ptr": "*i8", "target_ptr": "*i64",
                        "read_ptr": "*i64", "scratch": "i32", "pairs": "i32", "BLOCK": "constexpr"}, {"BLOCK": 8},
                       num_warps=1)
