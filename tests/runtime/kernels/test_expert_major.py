"""The batched step's expert-major kernels (runtime/kernels/expert_major.py): the block layout, the torch twin
against grouped GEMM (bank_experts), the Triton kernels against the twin in Triton's interpreter, and
the kernels compiled for Hopper at Qwen3-VL-30B-A3B's shapes."""

import pytest
import torch

from vismmoe_kt.runtime.expert_compute import bank_experts
from vismmoe_kt.runtime.kernels.expert_major import BLOCK_M, expert_blocks, experts_by_block

from kernel_cases import hopper, interpreter  # noqa: F401 (fixtures)


def test_each_experts_pairs_fill_blocks_of_their_own_in_pair_order():
    ids = torch.tensor([3, 1, 3, 0, 3, 1])
    block_expert, block_pairs = expert_blocks(ids, num_experts=5, block=2)
    blocks = [(int(block_expert[b]), block_pairs[b].tolist()) for b in range(6) if block_expert[b] >= 0]
    assert blocks == [(0, [3, -1]), (1, [1, 5]), (3, [0, 2]), (3, [4, -1])]  # expert 3's 3 pairs: 2 blocks of 2
    assert block_expert.shape == (6,) and block_pairs.shape == (6, 2)
    assert (block_expert[4:] == -1).all() and (block_pairs[4:] == -1).all()
    # every pair in exactly one lane, whatever the routing (fixed shapes: P blocks at most)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, 9, (24,), generator=generator)
        block_expert, block_pairs = expert_blocks(ids, num_experts=9)
        lanes = block_pairs[block_pairs >= 0]
        assert sorted(lanes.tolist()) == list(range(24))
        owner = block_expert[:, None].expand_as(block_pairs)[block_pairs >= 0]
        assert torch.equal(ids[lanes], owner) and block_pairs.shape == (24, BLOCK_M)


def test_the_blocks_in_use_fit_the_grid_the_kernels_launch():
    """The quantized kernels launch min(P, P // M + E) programs a column tile, not P: every block in use
    must come before that, whatever the routing and the block size (a prompt's blocks of 64 pairs)."""
    generator = torch.Generator().manual_seed(1)
    for experts, pairs, block in ((9, 24, 2), (128, 1888, 64), (128, 6592, 64), (16, 40, 16), (4, 400, 128)):
        for skew in (False, True):
            weights = torch.arange(experts, 0, -1).float() ** (3 if skew else 0)
            ids = torch.multinomial(weights, pairs, replacement=True, generator=generator)
            block_expert, _ = expert_blocks(ids, experts, block)
            used = int(torch.nonzero(block_expert >= 0).max()) + 1
            assert used <= min(pairs, pairs // block + experts), (experts, pairs, block, skew)
            assert int((block_expert >= 0).sum()) == used  # contiguous from block 0


def test_the_twin_gives_grouped_gemms_pair_outputs():
    torch.manual_seed(0)
    E, H, I, T, K = 7, 48, 24, 5, 3
    gate_up, down = torch.randn(E, 2 * I, H) / 6, torch.randn(E, H, I) / 6
    hidden = torch.randn(T, H)
    top_k_index = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    block_expert, block_pairs = expert_blocks(top_k_index.reshape(-1), E)
    y = experts_by_block(hidden, K, block_expert, block_pairs, gate_up, down, torch.nn.SiLU())
    got = (y.view(T, K, H) * weights[..., None]).sum(dim=1)
    want = bank_experts(hidden, top_k_index, weights, torch.arange(E), gate_up, down, torch.nn.SiLU())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


SCRIPT = r"""
from vismmoe_kt.runtime.kernels import expert_major as em

E, H, I, K = 6, 160, 72, 4      # H, I not multiples of the tiles: the masks matter
# float16: the interpreter's tl.dot misreads bfloat16 (numpy has none); the GPU runs bfloat16
# (decode_kernel_bench --batch checks it against grouped GEMM there)
for T in (1, 5):                # T=5, K=4 over 6 experts: several pairs per expert, some blocks partly empty
    gate_up = (torch.randn(E, 2 * I, H) / 8).to(torch.float16)
    down = (torch.randn(E, H, I) / 8).to(torch.float16)
    hidden = torch.randn(T, H).to(torch.float16)
    top_k_index = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    got = em.experts_expert_major(hidden, top_k_index, gate_up, down)
    block_expert, block_pairs = em.expert_blocks(top_k_index.reshape(-1), E)
    want = em.experts_by_block(hidden, K, block_expert, block_pairs, gate_up, down, torch.nn.SiLU())
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert got.abs().sum() > 0
# the one-program block plan gives the torch version's blocks exactly
generator = torch.Generator().manual_seed(1)
for pairs, experts in ((1, 4), (7, 3), (64, 128), (40, 2), (128, 128), (200, 9)):
    ids = torch.randint(0, experts, (pairs,), generator=generator)
    for got, want in zip(em.block_plan(ids, experts), em.expert_blocks(ids, experts)):
        assert torch.equal(got, want), (pairs, experts, got, want)
# a prompt's pairs, beyond one program's comparisons: the chunked plan, blocks of 16 and of 32 (a chunk
# boundary inside an expert's run, an expert with no pair, one with many, 128 experts like Qwen3-VL's)
# (2100 and 4500 pairs: chunks of 128 and of 256)
for pairs, experts, block in ((257, 5, 16), (600, 128, 32), (520, 3, 32), (300, 130, 16), (2100, 128, 32),
                              (4500, 40, 16)):
    weights = torch.arange(experts, 0, -1).float() ** 2
    weights[1] = 0                                                 # expert 1 never routed to
    ids = torch.multinomial(weights, pairs, replacement=True, generator=generator)
    for got, want in zip(em.block_plan(ids, experts, block), em.expert_blocks(ids, experts, block)):
        assert torch.equal(got, want), (pairs, experts, block)
"""


def test_kernels_match_the_twin_in_the_interpreter(interpreter):
    interpreter(SCRIPT)


def test_kernels_compile_for_hopper(hopper):
    from vismmoe_kt.runtime.kernels import expert_major as em

    blocks = {"expert_ptr": "*i64", "pairs_ptr": "*i64", "w_ptr": "*bf16", "H": "constexpr", "I": "constexpr",
              "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    shapes = {**hopper.shapes, "BLOCK_M": em.BLOCK_M}
    tuned = hopper.tuned["expert_major"]
    n, k, warps, stages = tuned["gate_up"]
    hopper.compile(em._gate_up_blocks, {"x_ptr": "*bf16", "h_ptr": "*bf16", "TOP_K": "constexpr", **blocks},
                   {**shapes, "TOP_K": 8, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
    n, k, warps, stages = tuned["down"]
    hopper.compile(em._down_blocks, {"h_ptr": "*bf16", "y_ptr": "*fp32", **blocks},
                   {**shapes, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
    for chunk in (64, 128, 256):  # every chunk size plan_chunk picks, with the most chunks it leaves (32)
        hopper.compile(em._chunk_counts_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "P": "i32",
                                                 "EP": "constexpr", "CHUNK": "constexpr"},
                       {"EP": 128, "CHUNK": chunk}, num_warps=em.PLAN_WARPS, num_stages=1)
        hopper.compile(em._chunk_place_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "expert_ptr": "*i64",
                                                "pairs_ptr": "*i64", "P": "i32", "chunks": "i32", "E": "constexpr",
                                                "EP": "constexpr", "CHUNK": "constexpr", "CHUNKS": "constexpr",
                                                "BLOCK_M": "constexpr"},
                       {"E": 128, "EP": 128, "CHUNK": chunk, "CHUNKS": 32, "BLOCK_M": 32}, num_warps=em.PLAN_WARPS,
                       num_stages=1)
    for pairs in (8, 32, em.MAX_PLAN_PAIRS):  # one token's pairs up to the plan's largest
        hopper.compile(em._blocks_kernel, {"ids_ptr": "*i64", "expert_ptr": "*i64", "pairs_ptr": "*i64",
                                           "P": "constexpr", "PP": "constexpr", "BLOCK_M": "constexpr"},
                       {"P": pairs, "PP": hopper.triton.next_power_of_2(pairs), "BLOCK_M": em.BLOCK_M},
                       num_warps=4, num_stages=1)


def test_a_prompts_plan_spreads_over_about_32_programs_of_64_to_256_pairs():
    from vismmoe_kt.runtime.kernels import expert_major as em

    pytest.importorskip("triton")
    assert em.plan_chunk(257) == 64 and em.plan_chunk(1888) == 64   # a 448 px prompt's pairs: 30 programs
    assert em.plan_chunk(4096) == 128 and em.plan_chunk(6592) == 256 and em.plan_chunk(10 ** 6) == 256
    for pairs in (257, 1888, 2049, 4097, 8192):
        assert em.PLAN_CHUNKS // 2 < -(-pairs // em.plan_chunk(pairs)) <= em.PLAN_CHUNKS or em.plan_chunk(pairs) == 64


def test_the_plans_kernels_keep_their_registers_on_hopper(hopper):
    """Compiled for sm_90 (ptxas) at the chunk sizes a prompt of up to 4096 pairs gets, and the one-program plan at
    its most pairs: the one-hot rows and comparisons stay in registers, a few words of local memory at most
    (256-pair chunks with 4 warps had spilled 4 KB a thread, 7658 local loads and stores; one program of 128
    pairs 4.9 KB). The machine code is read with the nvdisasm Triton ships."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    from vismmoe_kt.runtime.kernels import expert_major as em

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip("no nvdisasm in this Triton")
    place = {"ids_ptr": "*i64", "counts_ptr": "*i32", "expert_ptr": "*i64", "pairs_ptr": "*i64", "P": "i32",
             "chunks": "i32", "E": "constexpr", "EP": "constexpr", "CHUNK": "constexpr", "CHUNKS": "constexpr",
             "BLOCK_M": "constexpr"}
    kernels = [(f"chunks of {chunk}", hopper.compile(
        em._chunk_place_kernel, place, {"E": 128, "EP": 128, "CHUNK": chunk, "CHUNKS": 32, "BLOCK_M": 32},
        num_warps=em.PLAN_WARPS, num_stages=1)) for chunk in (64, 128)]
    # and the one-program plan at its most pairs (a batched step's)
    kernels.append(("one program", hopper.compile(
        em._blocks_kernel, {"ids_ptr": "*i64", "expert_ptr": "*i64", "pairs_ptr": "*i64", "P": "constexpr",
                            "PP": "constexpr", "BLOCK_M": "constexpr"},
        {"P": em.MAX_PLAN_PAIRS, "PP": em.MAX_PLAN_PAIRS, "BLOCK_M": 16}, num_warps=4, num_stages=1)))
    for name, compiled in kernels:
        cubin = Path(tempfile.mkdtemp()) / "place.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, timeout=60).stdout
        assert "HGMMA" not in sass and sass.count(";") > 100   # the plan's code, read
        assert len(re.findall(r"\b(?:LDL|STL)\b", sass)) <= 32, name
