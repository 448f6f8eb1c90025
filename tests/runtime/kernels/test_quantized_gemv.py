"""The quantized store's kernels against their torch twins, in Triton's interpreter (no GPU): a
decode miss's blocks staged from the host (runtime/kernels/block_staging.py) and dequantized into
its landing or scratch slab (dequantize.py), and the quantized slabs' GEMVs (quantized_gemv.py),
which decode each format as they read it, in every load form (quantized_gemv.LOAD_FORMS; the dp4a
form's int8 inputs against their own twin, q4k_dp4a.py); and the
kernels compiled for Hopper (kernel_cases.py: the fixtures, and the stores and the reference the
scripts build).
"""

from kernel_cases import assert_nibbles_by_exponent, hopper, interpreter  # noqa: F401 (fixtures)

SCRIPT = r"""
from vismmoe_kt.runtime.kernels import dequantize, tuning
from kernel_cases import dequantized_reference, filled_store, q6k_rows

# a quantized store's misses: fetched and dequantized into their landing or scratch slabs, kernel = twin
from vismmoe_kt.runtime.table_experts import fetch_dequantized
from vismmoe_kt.runtime.decode_table import CPU_PAIR
QE = 5
q6k_down = q6k_rows(QE, 256, 512, 0.02, 0.001, torch.Generator().manual_seed(0))  # Q6_K rows of 512
for dtype, fmt, (QH, QI), down_fmt in ((torch.float32, "q8_0", (96, 64), None), (torch.bfloat16, "q8_0", (96, 64), None),
                                       (torch.float32, "q4_0", (96, 64), None), (torch.float32, "q4_k", (256, 512), None),
                                       (torch.bfloat16, "q4_k", (256, 512), None),
                                       (torch.float32, "q5_k", (256, 512), None),
                                       (torch.float32, "q4_k", (256, 512), "q6_k")):
    store = filled_store(QE, QH, QI, dtype, fmt, (lambda: q6k_down) if down_fmt else None)
    if down_fmt is not None:  # a Q4_K_M file's layer: gate and up in Q4_K, down in Q6_K, as stored
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
    word_loads = not fmt.endswith(":bytes")
    fmt = fmt.split(":")[0]
    store = filled_store(QE, QH, QI, dtype, fmt, (lambda: q6k_down) if down_fmt else None)
    bb = store.block_bytes_of(0)
    ids = torch.tensor([1, 3, 4, 0])                    # tokens 0 and 1, two experts each
    slots, land = torch.tensor([-1, 2, -2, -1]), torch.tensor([1, -1, -1, -1])
    x = torch.randn(2, QH).to(dtype)
    outs = []
    for use_kernel in (False, True):
        pool = torch.zeros(9, bb + 64, dtype=torch.uint8)  # rows wider than a block: the row stride matters
        pool[2, :bb] = store.layers[0][3]                    # expert 3 resident in slab 2
        with tuning.overridden(q4_k_word_loads=word_loads):
            y = quantized_slab_outputs(x, ids, slots, land, pool, store.layers[0], store, 0, 4, torch.nn.SiLU(), QK,
                                       use_kernel)
        outs.append((y, pool))
    (want, twin_pool), (got, kern_pool) = outs
    # the kernels decode into fp32; the twin (and the reference below) round the weights to the model's dtype first
    # (fp32: within a few ulps of the outputs' scale, which the Q6_K rows make large)
    scale = want.abs().max().item()
    close = dict(rtol=2e-4, atol=2e-6 * scale) if dtype == torch.float32 else dict(rtol=0, atol=1e-2 * scale)
    torch.testing.assert_close(got, want, **close)
    # expert 1 landed in slab 1; experts 4 and 0 (no landing slab) in scratch slabs 4 + 2 and 4 + 3
    for slab, expert in ((1, 1), (6, 4), (7, 0)):
        assert torch.equal(kern_pool[slab, :bb], store.layers[0][expert]), (fmt, slab)
        assert torch.equal(twin_pool[slab, :bb], store.layers[0][expert]), (fmt, slab)
    for slab in (0, 3, 4, 5):
        assert not kern_pool[slab].any(), (fmt, slab)
    torch.testing.assert_close(got, dequantized_reference(store, ids, x, QK), **close)
    # a prefill's bank decoded from the slabs (fetch_q8 on blocks already on the device, `staged`)
    bank = [torch.zeros(QE, 2 * QI, QH, dtype=dtype), torch.zeros(QE, QH, QI, dtype=dtype)]
    slabs_of, experts_of = torch.tensor([1, 6, 2]), torch.tensor([1, 4, 3])
    dequantize.fetch_q8(slabs_of, torch.ones(3, dtype=torch.int8), experts_of, bank, kern_pool.data_ptr(),
                        kern_pool.shape[1], QI, QH, fmt=fmt, down_fmt=down_fmt, staged=True)
    want_gu, want_dn = store.dequantized(store.layers[0][experts_of], 0)
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(bank[0][experts_of], want_gu, **exact)
    torch.testing.assert_close(bank[1][experts_of], want_dn, **exact)
    assert not bank[0][0].any() and not bank[0][2].any()
"""

LOAD_FORMS = r"""
from vismmoe_kt.runtime.kernels import quantized_gemv, tuning
from kernel_cases import dequantized_reference, filled_store, q6k_rows

# H = 768: three super-blocks a gate or up row, which the tile form pads to four (masked); I = 256: one a
# down row (the interpreter walks every weight one program at a time: I = 512 made this script take 510 s on
# an idle 2-core machine, 256 366 s)
QE, QH, QI, QK = 5, 768, 256, 2
ids = torch.tensor([1, 3, 4, 0])  # tokens 0 and 1, two experts each
x = torch.randn(2, QH)
for fmt, down_fmt, word_loads in (("q8_0", None, True), ("q4_0", None, True), ("q4_k", None, True),
                                  ("q4_k", None, False), ("q5_k", None, True), ("q4_k", "q6_k", True)):
    q6k_down = q6k_rows(QE, QH, QI, 0.02, 0.001, torch.Generator().manual_seed(1)) if down_fmt else None
    store = filled_store(QE, QH, QI, torch.float32, fmt, (lambda: q6k_down) if down_fmt else None)
    pool = torch.zeros(QE, store.block_bytes_of(0) + 64, dtype=torch.uint8)  # rows wider than a block
    pool[:, :store.block_bytes_of(0)] = store.layers[0]                      # slab e holds expert e
    want = dequantized_reference(store, ids, x, QK)
    close = dict(rtol=2e-4, atol=2e-6 * want.abs().max().item())
    shared = [(16, 1, "shared"), (2, 1, "shared")] if fmt == "q4_k" and down_fmt is None else []  # Q4_K only
    for config in ((32, 1, "loop"), (32, 1, "unrolled"), (16, 1, "tile"), *shared):
        with tuning.overridden(q4_k_word_loads=word_loads):
            got = quantized_gemv.quantized_experts(x, ids, pool, fmt, down_fmt or fmt, QI, QH, QK, config)
        torch.testing.assert_close(got, want, **close, msg=lambda m: f"{fmt} {down_fmt} {word_loads} {config}: {m}")
    # a settled table's read: the pairs' experts, each one's slab from the layer's table row (here reversed)
    table_row = torch.arange(QE - 1, -1, -1)
    reversed_pool = pool.flip(0).contiguous()  # slab QE - 1 - e holds expert e
    for config in ((16, 1, "tile"), *shared):  # the shared form is the H200's for Q4_K: a settled step runs it
        got = quantized_gemv.quantized_experts(x, ids, reversed_pool, fmt, down_fmt or fmt, QI, QH, QK, config,
                                               table_row=table_row)
        torch.testing.assert_close(got, want, **close, msg=lambda m: f"{fmt} {down_fmt} {config} by expert: {m}")
"""


DP4A = r"""
from vismmoe_kt.runtime.kernels import q4k_dp4a, quantized_gemv, tuning
from kernel_cases import dequantized_reference, filled_store, q6k_rows

# H = 768: three super-blocks a row, which the kernels pad to four (masked); I = 512: two
QE, QH, QI, QK = 5, 768, 512, 2
ids = torch.tensor([1, 3, 4, 0])  # tokens 0 and 1, two experts each
x = torch.randn(2, QH)
# the dp4a form (Q4_K only): the inputs rounded to int8 per 32 first, so it answers to its twin (the same rounding,
# the weights dequantized) within fp32 rounding, and to the exact reference within the rounding's error
store = filled_store(QE, QH, QI, torch.float32, "q4_k")
pool = torch.zeros(QE, store.block_bytes_of(0) + 64, dtype=torch.uint8)
pool[:, :store.block_bytes_of(0)] = store.layers[0]
dequantize = lambda experts: store.dequantized(store.layers[0][experts], 0)  # noqa: E731
want = dequantized_reference(store, ids, x, QK)
twin = q4k_dp4a.dp4a_reference(x, ids, dequantize, QK, torch.nn.functional.silu)
scale = want.abs().max().item()
assert 1e-3 < (twin - want).abs().max().item() / scale < 3e-2  # int8 inputs: less exact, not wrong
table_row = torch.arange(QE - 1, -1, -1)
for config, slab_pool, row in (((16, 1, "dp4a"), pool, None), ((32, 4, "dp4a"), pool.flip(0).contiguous(), table_row)):
    got = quantized_gemv.quantized_experts(x, ids, slab_pool, "q4_k", "q4_k", QI, QH, QK, config, table_row=row)
    torch.testing.assert_close(got, twin, rtol=0, atol=2e-5 * scale, msg=lambda m: f"{config}: {m}")
# the rounding itself: the kernel's int8 values, scales and sums are the twin's
for rows in (x, torch.randn(3, 512) * torch.tensor([0.0, 1.0, 1e3])[:, None]):  # a row of zeros: scale 0, values 0
    for got, want in zip(q4k_dp4a.q8_activations(rows), q4k_dp4a.q8_activations(rows, use_kernel=False)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
# a Q4_K_M layer under a tuning that names dp4a for Q4_K: gate and up in dp4a, the Q6_K down rows in their own form
q6k_down = q6k_rows(QE, QH, QI, 0.02, 0.001, torch.Generator().manual_seed(1))
store = filled_store(QE, QH, QI, torch.float32, "q4_k", lambda: q6k_down)
pool = torch.zeros(QE, store.block_bytes_of(0), dtype=torch.uint8)
pool[:] = store.layers[0]
forms = {"q4_k": (16, 1, "dp4a"), "q6_k": (32, 1, "loop")}
with tuning.overridden(quantized_gemv=forms):
    got = quantized_gemv.quantized_experts(x, ids, pool, "q4_k", "q6_k", QI, QH, QK)
twin = q4k_dp4a.dp4a_reference(x, ids, lambda e: store.dequantized(store.layers[0][e], 0), QK,
                               torch.nn.functional.silu, down_int8=False)
torch.testing.assert_close(got, twin, rtol=0, atol=2e-5 * twin.abs().max().item())
"""

# the interpreter runs one program at a time: on an idle 2-core machine (2026-12-06) LOAD_FORMS takes about
# 370 s, DP4A about 30 and SCRIPT a few minutes, so a bound well above that (a loaded CI machine), not a
# timing assertion
INTERPRETER_TIMEOUT = 1200


def test_kernels_match_the_twin_in_the_interpreter(interpreter):
    interpreter(SCRIPT, timeout=INTERPRETER_TIMEOUT)


def test_every_load_form_matches_the_reference_in_the_interpreter(interpreter):
    interpreter(LOAD_FORMS, timeout=INTERPRETER_TIMEOUT)


def test_the_dp4a_form_matches_its_twin_in_the_interpreter(interpreter):
    interpreter(DP4A, timeout=INTERPRETER_TIMEOUT)


def test_kernels_compile_for_hopper(hopper):
    from vismmoe_kt.runtime.kernels import block_decode, block_staging, dequantize, quantized_gemv

    q8 = {"ids_ptr": "*i64", "need_ptr": "*i8", "target_ptr": "*i64", "pool_ptr": "*bf16", "host_addr": "i64",
          "block_bytes": "i64", "part_bytes": "i64", "slab_elems": "i64", "part_elems": "i64", "ROWS": "constexpr",
          "COLS": "constexpr", "BLOCK_ROWS": "constexpr", "QBLOCKS": "constexpr"}
    for q4 in (False, True):
        hopper.compile(dequantize._fetch_q8_kernel, {**q8, "Q4": "constexpr"},
                       {"ROWS": 1536, "COLS": 2048, "BLOCK_ROWS": 16, "QBLOCKS": 8, "Q4": q4})
    kquant = {**{name: kind for name, kind in q8.items() if name != "QBLOCKS"}, "KIND": "constexpr"}
    for rows, cols, kind in ((1536, 2048, 4), (2048, 768, 4), (1536, 2048, 5), (2048, 768, 6)):  # Qwen3-VL-30B-A3B's
        hopper.compile(dequantize._fetch_kquant_kernel, kquant, {"ROWS": rows, "COLS": cols, "BLOCK_ROWS": 16, "KIND": kind})
    hopper.compile(block_staging._stage_kernel, {"ids_ptr": "*i64", "need_ptr": "*i8", "target_ptr": "*i64",
                                                 "staging_ptr": "*i32", "host_addr": "i64", "block_words": "i64",
                                                 "row_words": "i64", "CHUNK": "constexpr"},
                   {"CHUNK": block_staging.STAGE_CHUNK})
    quantized = {"slots_ptr": "*i64", "table_ptr": "*i64", "pool_ptr": "*u8", "slab_bytes": "i64", "H": "constexpr",
                 "I": "constexpr", "KIND": "constexpr", "SB_BYTES": "constexpr", "BLOCK_ROWS": "constexpr",
                 "LOADS": "constexpr", "SB_TILE": "constexpr", "BY_EXPERT": "constexpr"}
    H, I = hopper.shapes["H"], hopper.shapes["I"]
    for fmt in [*quantized_gemv.TILE_KINDS, "q4_k words"]:  # every format the quantized slabs hold, at Qwen3-VL-30B-A3B's shapes
        kind = 44 if fmt == "q4_k words" else quantized_gemv.TILE_KINDS[fmt]
        rows, warps, tuned_form = hopper.tuned["quantized_gemv"][fmt.split()[0]]
        # each form at the H200's tuned rows and warps; the tuned form also reading the slabs through the table row
        forms = [form for form in quantized_gemv.LOAD_FORMS  # dp4a's kernels are q4k_dp4a's (test below)
                 if form != "dp4a" and quantized_gemv.form_reads((rows, warps, form), fmt[:4])]
        for form, by_expert in [(form, False) for form in forms] + [(tuned_form, True)]:
            tile = {**hopper.shapes, "KIND": kind, "SB_BYTES": block_decode.TILE_BYTES[fmt.split()[0]],
                    "BLOCK_ROWS": rows, "LOADS": quantized_gemv.LOAD_FORMS[form], "BY_EXPERT": by_expert}
            hopper.compile(quantized_gemv._gate_up_q_kernel, {"x_ptr": "*bf16", "h_ptr": "*fp32", "TOP_K": "constexpr",
                                                              **quantized},
                           {**tile, "TOP_K": 8, "SB_TILE": hopper.triton.next_power_of_2(H // 256)}, num_warps=warps)
            hopper.compile(quantized_gemv._down_q_kernel, {"h_ptr": "*fp32", "y_ptr": "*fp32", "part_bytes": "i64",
                                                           **quantized},
                           {**tile, "SB_TILE": hopper.triton.next_power_of_2(I // 256)}, num_warps=warps)


def test_the_dp4a_form_compiles_to_dp4a_for_hopper(hopper):
    """The dp4a form's kernels at Qwen3-VL-30B-A3B's shapes: the inline `dp4a` reaches the PTX (the
    interpreter runs its integer twin instead), in both GEMVs and through a settled table's row."""
    import re

    from vismmoe_kt.runtime.kernels import q4k_dp4a

    H, I = hopper.shapes["H"], hopper.shapes["I"]
    common = {"q_ptr": "*i32", "scale_ptr": "*fp32", "sum_ptr": "*fp32", "slots_ptr": "*i64", "table_ptr": "*i64",
              "pool_ptr": "*u8", "slab_bytes": "i64", "H": "constexpr", "I": "constexpr", "BLOCK_ROWS": "constexpr",
              "SB_TILE": "constexpr", "BY_EXPERT": "constexpr", "ASM": "constexpr"}
    for by_expert in (False, True):
        shared = {"H": H, "I": I, "BLOCK_ROWS": 4, "BY_EXPERT": by_expert, "ASM": True}
        gate_up = hopper.compile(q4k_dp4a._gate_up_dp4a_kernel, {**common, "h_ptr": "*fp32", "TOP_K": "constexpr"},
                                 {**shared, "TOP_K": 8, "SB_TILE": hopper.triton.next_power_of_2(H // 256)}, num_warps=1)
        down = hopper.compile(q4k_dp4a._down_dp4a_kernel, {**common, "y_ptr": "*fp32", "part_bytes": "i64"},
                              {**shared, "SB_TILE": hopper.triton.next_power_of_2(I // 256)}, num_warps=1)
        for compiled in (gate_up, down):
            assert re.search(r"\bdp4a\.u32\.s32\b", compiled.asm["ptx"])
    hopper.compile(q4k_dp4a._q8_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32", "sum_ptr": "*fp32",
                                         "COLS": "constexpr", "BLOCKS": "constexpr"},
                   {"COLS": H, "BLOCKS": q4k_dp4a.Q8_BLOCKS_PER_PROGRAM})


def test_the_q4_k_gemvs_read_their_slabs_in_16_byte_loads(hopper):
    """The slabs come in as a pointer (the pool tensor), not an integer address: compiled as a launch
    specializes it (16-byte aligned, the slab bytes a multiple of 16), the Q4_K quant words of a
    super-block are read in 16-byte vector loads, none word by word (an address cast from an integer
    hides its alignment: 32 scalar loads a thread where 8 vector loads do)."""
    import re

    from vismmoe_kt.runtime.kernels import block_decode, quantized_gemv

    H, I = hopper.shapes["H"], hopper.shapes["I"]
    rows, warps, form = hopper.tuned["quantized_gemv"]["q4_k"]
    signature = {"x_ptr": "*bf16", "slots_ptr": "*i64", "table_ptr": "*i64", "h_ptr": "*fp32", "pool_ptr": "*u8",
                 "slab_bytes": "i64", "TOP_K": "constexpr", "H": "constexpr", "I": "constexpr", "KIND": "constexpr",
                 "SB_BYTES": "constexpr", "BLOCK_ROWS": "constexpr", "LOADS": "constexpr", "SB_TILE": "constexpr",
                 "BY_EXPERT": "constexpr"}
    constants = {"TOP_K": 8, "H": H, "I": I, "KIND": 44, "SB_BYTES": block_decode.TILE_BYTES["q4_k"],
                 "BLOCK_ROWS": rows, "LOADS": quantized_gemv.LOAD_FORMS[form], "BY_EXPERT": False,
                 "SB_TILE": hopper.triton.next_power_of_2(H // 256)}
    compiled = hopper.compile(quantized_gemv._gate_up_q_kernel, signature, constants, num_warps=warps,
                              aligned=("x_ptr", "h_ptr", "pool_ptr", "slab_bytes"))
    loads = re.findall(r"ld\.global((?:\.v\d)?)\.b(\d+)", compiled.asm["ptx"])
    assert ("", "32") not in loads, "quant words loaded one by one"
    assert sum(1 for vector, bits in loads if vector == ".v4" and bits == "32") >= 4
    # the nibbles become floats through the exponent trick (block_decode._nibble_float), no int-to-float
    # conversion per weight (an eighth of the FP32 rate on sm_90): the conversions left are the scales'
    assert_nibbles_by_exponent(compiled.asm["ptx"])


def test_the_shared_form_reads_q4_k_only():
    """A tuning that names the shared form for another format stops with the reason, before any launch."""
    import pytest
    import torch

    from vismmoe_kt.runtime.kernels import quantized_gemv

    x, pairs, pool = torch.zeros(1, 256), torch.zeros(8, dtype=torch.long), torch.zeros(8, 1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shared load form reads Q4_K only, not q8_0"):
        quantized_gemv.quantized_experts(x, pairs, pool, "q8_0", "q8_0", 256, 256, 8, (4, 1, "shared"))
    assert quantized_gemv.form_reads((4, 1, "shared"), "q4_k") and quantized_gemv.form_reads((4, 1), "q8_0")
