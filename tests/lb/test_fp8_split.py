"""ReaLB's fp8 path: the one-pass activation quantization kernels (lb/fp8_quant.py) and the precision
split of a rank's pairs (runtime/expert_compute.precision_split_rows)."""

import pytest
import torch

from conftest import UNDER_INTERPRETER, compile_for_hopper, run_in_triton_interpreter
from vismmoe_kt.lb import fp8_quant
from vismmoe_kt.lb.fp8_experts import Fp8Experts
from vismmoe_kt.lb.precision import fp8_rows
from vismmoe_kt.runtime.expert_compute import bank_experts, precision_split_rows

SILU = torch.nn.functional.silu


def test_off_the_gpu_the_quantizers_are_the_torch_formula():
    x = torch.randn(7, 48) * torch.logspace(-2, 2, 7)[:, None]
    x[3] = 0  # an all-zero row: the scale's floor, no division by zero
    q, s = fp8_quant.quantize_rows(x)
    want_q, want_s = fp8_rows(x)
    assert torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s.squeeze(-1))
    assert s[3] == 1e-12 and not q.float().isnan().any()
    gate_up = torch.randn(5, 2 * 24)
    q, s = fp8_quant.silu_mul_quantize(gate_up, torch.nn.SiLU())
    gate, up = gate_up.chunk(2, dim=-1)
    want_q, want_s = fp8_rows(SILU(gate) * up)
    assert torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s.squeeze(-1))


@pytest.mark.parametrize("act,silu", [(SILU, True), (torch.nn.SiLU(), True), (torch.nn.functional.gelu, False)])
def test_only_silu_takes_the_fused_kernel(act, silu):
    assert fp8_quant.is_silu(act) is silu


SCRIPT = r"""
import torch
from vismmoe_kt.lb import fp8_quant as fq
from vismmoe_kt.lb.precision import fp8_rows

torch.manual_seed(0)
x = torch.randn(5, 200) * torch.logspace(-3, 2, 5)[:, None]   # 200: not a power of two, the mask matters
x[2] = 0
q, s = fq.quantize_rows_kernel(x)
want_q, want_s = fp8_rows(x)
assert torch.allclose(s, want_s.squeeze(-1), rtol=1e-6), (s, want_s)
# the interpreter's own E4M3 cast rounds some values just under a power of two down a binade (the
# GPU's cvt does not: scripts/gpu_check.py --fp8 finds every value equal there); the rest must agree
assert float((q.float() == want_q.float()).float().mean()) > 0.97
gu = torch.randn(4, 2 * 72)
q, s = fq.silu_mul_quantize_kernel(gu)
g, u = gu.chunk(2, dim=-1)
want_q, want_s = fp8_rows(torch.nn.functional.silu(g) * u)
assert torch.allclose(s, want_s.squeeze(-1), rtol=1e-5), (s, want_s)
assert float((q.float() == want_q.float()).float().mean()) > 0.97
print("OK")
"""


def test_quantization_kernels_give_the_torch_scales_in_the_interpreter():
    run_in_triton_interpreter(SCRIPT)


@pytest.mark.skipif(UNDER_INTERPRETER, reason="the interpreter replaces the compiler")
def test_quantization_kernels_compile_for_hopper():
    common = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "MAX": "constexpr", "BLOCK": "constexpr"}
    compile_for_hopper(fp8_quant._quantize_rows_kernel, {"x_ptr": "*bf16", "n": "i32", **common},
                       {"MAX": 448.0, "BLOCK": 2048}, num_warps=4)
    compile_for_hopper(fp8_quant._silu_mul_quantize_kernel, {"gu_ptr": "*bf16", "inter": "i32", **common},
                       {"MAX": 448.0, "BLOCK": 1024}, num_warps=4)


def _experts(E=6, H=32, I=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_precision_split_computes_each_pair_once_bf16_ones_as_bf16(share):
    gate_up, down = _experts()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 32, generator=g)
    token = torch.randint(0, 20, (50,), generator=g)
    experts = torch.randint(0, 6, (50,), generator=g)
    lowprec = torch.rand(50, generator=g) < share
    fp8 = Fp8Experts(gate_up, down)
    seen = []

    def grouped(x, ends, act):
        seen.append((x.clone(), ends.clone()))
        return fp8.grouped_rows(x, ends, act)

    got = precision_split_rows(hidden, token, experts, lowprec, gate_up, down, SILU, grouped)
    rows = torch.arange(6)
    bf16 = bank_experts(hidden[token], experts[:, None], torch.ones(50, 1), rows, gate_up, down, SILU)
    low = fp8(hidden[token], experts, SILU)
    # every low-precision pair went through the grouped call once, grouped by expert; no BF16 pair did
    assert sum(x.shape[0] for x, _ in seen) == int(lowprec.sum()) and len(seen) == int(lowprec.any())
    if seen:
        x, ends = seen[0]
        counts = torch.bincount(experts[lowprec], minlength=6)
        assert torch.equal(ends, torch.cumsum(counts, 0))
    # unswitched: the all-BF16 numbers (to the last bits only: a CPU GEMM may round a row differently in a
    # batch of another size, which some machines' kernels do; low precision moves them by far more)
    torch.testing.assert_close(got[~lowprec], bf16[~lowprec], rtol=1e-5, atol=1e-6)
    # switched: the E4M3 copy's numbers (the CPU GEMM may round rows at other offsets differently)
    torch.testing.assert_close(got[lowprec], low[lowprec], rtol=1e-5, atol=1e-6)
    if lowprec.any():
        assert not torch.equal(got[lowprec], bf16[lowprec])  # low precision did change them


def test_realb_layer_bench_takes_the_affinity_what_if_and_mixed_batches(tmp_path, capsys):
    import json

    import pytest

    from benchmarks import realb_layer_bench

    small = ["--device", "cpu", "--experts", "8", "--hidden", "32", "--intermediate", "16", "--top-k", "2",
             "--requests", "4", "--visual", "40", "--text", "8", "--layers", "2", "--passes", "1", "--repeats", "1",
             "--gate-tokens", "64", "--fixed-threshold", "0.0"]
    realb_layer_bench.main([*small, "--out", str(tmp_path), "--affinity", "0.283", "--image-share", "0"])
    written = json.loads((tmp_path / "realb_layer_bench.json").read_text())
    assert written["meta"]["routing"] == "synthetic:affinity=0.283" and written["meta"]["image_share"] == 0
    rows = {r["config"]: r for r in written["rows"]}
    assert rows["fixed"]["lowprec_share"] == 0  # text prompts only: no vision pair to switch, whatever the load
    # half the prompts with a picture: the first two carry their 40 visual tokens, the last two none
    ids, _, visual = realb_layer_bench.routed_prefill(4, 40, 8, 2, 8, 2, affinity=0.283, image_share=0.5)
    assert int(visual.sum()) == 2 * 40 and not visual[2 * 48:].any()
    for bad, why in ((["--affinity", "1.5"], "--affinity"), (["--image-share", "2"], "--image-share")):
        with pytest.raises(SystemExit):
            realb_layer_bench.main([*small, *bad])
        assert why in capsys.readouterr().err


def test_realb_layer_bench_runs_on_the_cpu(tmp_path):
    import json

    from benchmarks import realb_layer_bench

    realb_layer_bench.main(["--device", "cpu", "--out", str(tmp_path), "--experts", "8", "--hidden", "32",
                            "--intermediate", "16", "--top-k", "2", "--requests", "4", "--visual", "40",
                            "--text", "8", "--layers", "2", "--passes", "2", "--repeats", "1",
                            "--gate-tokens", "64", "--fixed-threshold", "0.0"])
    rows = {r["config"]: r for r in json.loads((tmp_path / "realb_layer_bench.json").read_text())["rows"]}
    assert set(rows) == {"bf16", "fp8-all", "realb", "fixed", "eplb", "bf16 (again)"}
    eplb = rows["eplb"]  # copies of the hot experts placed from the layer's loads: BF16, no worse balanced
    assert eplb["relative_error_vs_bf16"] == 0 and eplb["imbalance_after"] <= eplb["imbalance_before"]
    assert rows["bf16"]["lowprec_share"] == 0 and rows["bf16"]["relative_error_vs_bf16"] == 0
    assert rows["fp8-all"]["lowprec_share"] == 1 and rows["fp8-all"]["relative_error_vs_bf16"] > 0
    fixed = rows["fixed"]  # M_d 0: every overloaded rank sheds vision pairs, so the plan must lower imbalance
    assert 0 < fixed["lowprec_share"] < 1 and fixed["imbalance_after"] < fixed["imbalance_before"]
    assert 0 < fixed["relative_error_vs_bf16"] < rows["fp8-all"]["relative_error_vs_bf16"]
