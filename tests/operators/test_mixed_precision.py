"""MixedPrecisionExperts (ReaLB) on the tiny model: exact with LB off, switches under load, errors."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.errors import RuleError
from vismmoe_kt.operators.mixed_precision import MixedPrecisionExperts
from vismmoe_kt.core.stats import collect_stats

from conftest import make_image

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
RULES = "optimize_rules/qwen3vl-realb.yaml"


@pytest.fixture(scope="module")
def big_image_inputs(reference):
    """An image-heavy prompt: 196 visual tokens of 236."""
    _, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[prompt], images=[make_image(448, 448, seed=5)], return_tensors="pt")


def run(model, inputs, tokens=8):
    with torch.no_grad():
        return model(**inputs).logits, model.generate(**inputs, max_new_tokens=tokens, do_sample=False)


@pytest.mark.parametrize("overrides", [{}, {"mode": "bf16", "lb_gate_tokens": 0}])
def test_lb_off_is_exactly_the_reference(tiny_dir, reference, big_image_inputs, overrides):
    model, _ = load(tiny_dir, RULES, **overrides, **CPU)  # the default gate (2048) is above this batch
    logits, tokens = run(model, big_image_inputs)
    ref_logits, ref_tokens = run(reference[0], big_image_inputs)
    assert (logits - ref_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, ref_tokens)
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["lowprec_pairs"] == 0


def test_realb_switches_vision_heavy_experts_and_stays_close(tiny_dir, reference, big_image_inputs):
    model, _ = load(tiny_dir, RULES, lb_gate_tokens=64, md_start=0.5, **CPU)
    logits, _ = run(model, big_image_inputs, tokens=2)
    ref_logits, _ = run(reference[0], big_image_inputs, tokens=2)
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["switched_experts"] > 0 and 0 < stats["lowprec_pairs"] < stats["pairs"]
    assert stats["imbalance_after"] < stats["imbalance_before"]
    error = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert 0 < error < 0.2  # NVFP4 on part of the image rows: changed, but not destroyed


def test_fp4_all_changes_more_than_realb(tiny_dir, reference, big_image_inputs):
    ref_logits, _ = run(reference[0], big_image_inputs, tokens=1)
    errors = {}
    for mode in ("all", "realb"):
        model, _ = load(tiny_dir, RULES, mode=mode, lb_gate_tokens=64, md_start=0.5, **CPU)
        logits, _ = run(model, big_image_inputs, tokens=1)
        errors[mode] = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert errors["all"] > errors["realb"] > 0


def test_text_rows_stay_bf16_by_default(tiny_dir, big_image_inputs, monkeypatch):
    import vismmoe_kt.operators.mixed_precision as operator

    model, _ = load(tiny_dir, RULES, lb_gate_tokens=64, md_start=0.5, **CPU)
    seen = {}
    original = operator.lowprec_pairs

    def recording(mlp, hidden, index, weights, lowprec, *rest, **kwargs):
        seen.setdefault("rows", lowprec.any(dim=1))  # the rows of the first layer's low-precision pairs
        return original(mlp, hidden, index, weights, lowprec, *rest, **kwargs)
    monkeypatch.setattr(operator, "lowprec_pairs", recording)
    with torch.no_grad():
        model(**big_image_inputs)
    visual = (big_image_inputs["input_ids"][0] == model.config.image_token_id)
    assert seen["rows"].any() and not (seen["rows"] & ~visual).any()


def test_bad_kwargs(tiny_dir):
    with pytest.raises(RuleError, match="mode 'fp2' is not one of"):
        load(tiny_dir, RULES, mode="fp2", **CPU)
    with pytest.raises(RuleError, match="nvfp4 needs flashinfer's FP4 GEMMs on a Blackwell GPU"):
        load(tiny_dir, RULES, precision_backend="nvfp4", **CPU)
    with pytest.raises(RuleError, match="precision_backend 'int3' is not one of"):
        load(tiny_dir, RULES, precision_backend="int3", **CPU)


@pytest.mark.parametrize("backend,bound", [("nvfp4-emulated", 0.25), ("fp8", 0.08)])
def test_backend_expert_output_against_float64(backend, bound):
    """Each backend against a float64 computation with the exact (unquantized) weights."""
    from vismmoe_kt.lb.precision import expert_mlp_fn

    g = torch.Generator().manual_seed(0)
    x, gate_up, down = torch.randn(7, 64, generator=g), torch.randn(96, 64, generator=g) * 0.1, torch.randn(64, 48, generator=g) * 0.1
    act = torch.nn.functional.silu
    gate, up = (x.double() @ gate_up.double().T).chunk(2, dim=-1)
    ref = (act(gate) * up) @ down.double().T
    out = expert_mlp_fn(backend)(x, gate_up, down, act)
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert 0 < error < bound


def test_emulated_backend_equals_float64_on_dequantized_weights():
    from vismmoe_kt.lb.nvfp4 import nvfp4_dequantize, nvfp4_quantize
    from vismmoe_kt.lb.precision import expert_mlp_fn

    g = torch.Generator().manual_seed(1)
    x, gate_up, down = torch.randn(5, 32, generator=g), torch.randn(64, 32, generator=g), torch.randn(32, 32, generator=g)
    fq = lambda t: nvfp4_dequantize(nvfp4_quantize(t), torch.float64)
    act = torch.nn.functional.silu
    gate, up = (fq(x) @ fq(gate_up).T).chunk(2, dim=-1)
    ref = fq((act(gate) * up).float()) @ fq(down).T
    out = expert_mlp_fn("nvfp4-emulated")(x, gate_up, down, act)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_realb_with_the_fp8_backend(tiny_dir, big_image_inputs):
    model, _ = load(tiny_dir, RULES, precision_backend="fp8", lb_gate_tokens=64, md_start=0.5, **CPU)
    with torch.no_grad():
        model(**big_image_inputs)
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["precision_backend"] == "fp8" and stats["lowprec_pairs"] > 0
    with pytest.raises(RuleError, match="ep_size must be between 1 and the 16 experts"):
        load(tiny_dir, RULES, ep_size=32, **CPU)


def test_eplb_mode_is_bf16_exact_and_reports_its_rank_balance(tiny_dir, reference, big_image_inputs):
    model, _ = load(tiny_dir, RULES, mode="eplb", eplb_period=1, **CPU)
    logits, tokens = run(model, big_image_inputs, tokens=4)
    ref_logits, ref_tokens = run(reference[0], big_image_inputs, tokens=4)
    assert (logits - ref_logits).abs().max().item() <= 1e-5 and torch.equal(tokens, ref_tokens)
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["lowprec_pairs"] == 0 and stats["imbalance_after"] > 0


def test_ptq_scales_weights_at_load_and_activations_online(tiny_dir, big_image_inputs):
    model, _ = load(tiny_dir, RULES, **CPU)
    op = next(m for m in model.modules() if isinstance(m, MixedPrecisionExperts))
    amax = op.orig_module.gate_up_proj.abs().amax(dim=(1, 2))
    assert torch.allclose(op.scales.weights["gate_up"], 448 * 6 / amax)
    assert (op.scales.activation_amax == 0).all()
    with torch.no_grad():
        model(**big_image_inputs)
    first = op.scales.activation_amax.clone()
    assert (first > 0).any()
    with torch.no_grad():
        model(**big_image_inputs)
    assert (op.scales.activation_amax >= first).all()  # a running maximum
    scales = op.scales.of(int(torch.argmax(first)))
    assert set(scales) == {"gate_up", "down", "input"}


def test_switched_pairs_are_computed_once_and_the_others_as_in_bf16(tiny_dir, big_image_inputs, monkeypatch):
    """Each (token, expert) pair goes through exactly one GEMM path, the BF16 one or the low-precision
    backend (rows counted at both), never both; an unswitched expert's pair outputs are the all-BF16
    ones (to the last bits of fp32: the CPU's grouped GEMM may round a group's rows differently where
    they start at another offset of a larger batch), while the switched ones move by the low
    precision's error."""
    import vismmoe_kt.operators.mixed_precision as operator

    model, _ = load(tiny_dir, RULES, lb_gate_tokens=64, md_start=0.5, **CPU)
    operators = [m for m in model.modules() if isinstance(m, MixedPrecisionExperts)]
    bf16_pairs, lowprec_rows, checked = [0], [0], []
    grouped = operator.bank_experts
    monkeypatch.setattr(operator, "bank_experts",
                        lambda hidden, index, *rest: bf16_pairs.__setitem__(0, bf16_pairs[0] + index.numel())
                        or grouped(hidden, index, *rest))
    for op in operators:
        op.orig_module.register_forward_hook(  # layers that switched nothing: the model's own call
            lambda module, args, output: bf16_pairs.__setitem__(0, bf16_pairs[0] + args[1].numel()))
        mlp = op.lowprec_mlp
        op.lowprec_mlp = lambda x, *rest, mlp=mlp: lowprec_rows.__setitem__(0, lowprec_rows[0] + x.shape[0]) or mlp(x, *rest)
        split = op._split

        def recording(hidden, index, weights, lowprec, split=split, op=op):
            checked.append((hidden, index, weights, lowprec, op))
            return split(hidden, index, weights, lowprec)
        op._split = recording
    with torch.no_grad():
        model(**big_image_inputs)
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["lowprec_pairs"] > 0 and checked  # some layers switched experts
    assert lowprec_rows[0] == stats["lowprec_pairs"] and bf16_pairs[0] + lowprec_rows[0] == stats["pairs"]
    for hidden, index, weights, lowprec, op in checked:
        with torch.no_grad():
            split = op._pair_outputs(hidden, index, weights, lowprec)
            bf16 = op._pair_outputs(hidden, index, weights, torch.zeros_like(lowprec))
        unswitched = ~torch.isin(index, index[lowprec])  # pairs of experts with no switched pair
        scale = bf16.abs().max().item()
        assert unswitched.any() and (split[unswitched] - bf16[unswitched]).abs().max().item() <= 1e-6 * scale
        assert (split[lowprec] - bf16[lowprec]).abs().max().item() > 1e-3 * scale  # the switched ones did change


def test_prompts_prefilled_together_open_the_lb_gate_that_one_prompt_leaves_shut(tiny_dir):
    """ReaLB balances a step's load only past its token gate. A single image prompt stays below it. The
    same prompts arriving together are prefilled in one forward (batched generation's grouped
    prefill), whose token count crosses it, so experts switch there and nowhere else."""
    from vismmoe_kt.engine.generation import generate_batch
    from vismmoe_kt.engine.inputs import build_inputs, user_turn

    calls = {}
    for budget in (0, 8192):  # one prompt per step, then all four in one forward
        model, processor = load(tiny_dir, RULES, lb_gate_tokens=300, md_start=0.5, **CPU)
        requests = [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(320, 320, seed=s)])
                    for s in range(4)]
        assert all(100 < r["input_ids"].shape[1] < 300 for r in requests)  # each alone below the gate
        with torch.no_grad():
            generate_batch(model, requests, 3, max_batch=4, min_new_tokens=3, prefill_budget=budget)
        stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
        calls[budget] = stats
    assert calls[0]["gated_calls"] == calls[0]["calls"] and calls[0]["lowprec_pairs"] == 0
    assert calls[8192]["gated_calls"] < calls[8192]["calls"] and calls[8192]["lowprec_pairs"] > 0


def test_fp8_backend_quantizes_the_weights_once_and_groups_the_switched_pairs(tiny_dir, big_image_inputs,
                                                                             monkeypatch):
    """precision_backend fp8: every expert's weights in E4M3 with per-row scales at load; a call quantizes
    only its activations (no weight-shaped tensor reaches the quantizer) and computes every switched pair
    once, the numbers of the per-expert function that quantizes the weights on each call."""
    import vismmoe_kt.lb.fp8_experts as fp8_experts
    import vismmoe_kt.lb.fp8_quant as fp8_quant
    from vismmoe_kt.lb.precision import expert_mlp_fn

    model, _ = load(tiny_dir, RULES, precision_backend="fp8", lb_gate_tokens=64, md_start=0.5, **CPU)
    operators = [m for m in model.modules() if isinstance(m, MixedPrecisionExperts)]
    op = operators[0]
    gate_up, down = op.adapter.expert_weights(op.orig_module)
    assert op.fp8.gate_up.dtype == torch.float8_e4m3fn and op.fp8.gate_up.shape == gate_up.shape
    assert torch.allclose(op.fp8.gate_up_scale, gate_up.abs().amax(-1) / 448)
    quantized, rows, checked = [], [0], []
    real_rows = fp8_experts.fp8_rows
    for module in (fp8_experts, fp8_quant):  # the weights' quantizer and the activations' (its torch formula here)
        monkeypatch.setattr(module, "fp8_rows", lambda t: quantized.append(tuple(t.shape)) or real_rows(t))
    for each in operators:
        call = each.fp8.grouped_rows
        each.fp8 = type("Counting", (), {"grouped_rows": lambda self, x, *rest, call=call: rows.__setitem__(
            0, rows[0] + x.shape[0]) or call(x, *rest), "stats": lambda self: {}})()
        split = each._split
        each._split = lambda h, i, w, lp, split=split, each=each: checked.append((h, i, w, lp, each)) or split(h, i, w, lp)
    with torch.no_grad():
        model(**big_image_inputs)
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["lowprec_pairs"] > 0 and rows[0] == stats["lowprec_pairs"]  # each switched pair once
    hidden = gate_up.shape[2]
    assert quantized and all(len(s) == 2 and s[1] in (hidden, gate_up.shape[1] // 2) for s in quantized)
    assert all(s[0] <= stats["lowprec_pairs"] for s in quantized)  # activations: a row per switched pair
    hidden_states, index, weights, lowprec, each = checked[0]
    with torch.no_grad():
        grouped = each._pair_outputs(hidden_states, index, weights, lowprec)
        each.fp8, each.lowprec_mlp = None, expert_mlp_fn("fp8")  # per expert, quantizing on every call
        per_expert = each._pair_outputs(hidden_states, index, weights, lowprec)
    # the same E4M3 values and scales: equal but for the CPU GEMM's rounding of rows at other offsets
    assert lowprec.any() and (grouped - per_expert).abs().max().item() <= 1e-6 * per_expert.abs().max().item()
