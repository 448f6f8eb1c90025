"""The offload runtime's quantized host stores: llama.cpp's Q8_0 and Q4_0 blocks on the host (about a half
and a quarter of BF16's bytes in memory and per fetched expert), dequantized into the GPU's slabs as
experts arrive, through the placement path's copies and the decode table's misses alike."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.demo.tiny import SPECS, build_tiny_model, save_tiny_model
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.engine.decoding import decode_engine
from vismmoe_kt.errors import RuleError
from vismmoe_kt.operators.vis_experts import VisExperts
from vismmoe_kt.runtime import q4, q4k, q5k, q6k, q8

CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False)
SPEC = SPECS["tiny-6x64"]  # rows of 96 and 64 weights: whole Q8_0 blocks
LAYER_BYTES = SPEC.experts * 3 * SPEC.hidden * SPEC.moe_intermediate * 4  # float32


def test_q8_round_trip_is_within_half_a_step_and_the_scales_rounding():
    weights = torch.randn(3, 5, 64)
    data = q8.quantize(weights)
    assert data.dtype == torch.uint8 and data.shape == (3, 5, 68)
    back = q8.dequantize(data, 64)
    step = weights.reshape(3, 5, 2, 32).abs().amax(-1, keepdim=True) / 127
    # half a step, plus the float16 scale's rounding (relative 2**-11) over up to 127 steps
    assert ((back - weights).reshape(3, 5, 2, 32).abs() <= step * (0.5 + 127 * 2**-11)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        q8.quantize(torch.randn(2, 48))


@pytest.mark.parametrize("codec,kind", [(q8, "Q8_0"), (q4, "Q4_0")])
def test_bytes_are_the_gguf_packages_own(codec, kind):
    """Our quantizers write what the gguf package (and so ggml) writes, byte for byte, on BF16-valued
    weights, where rounding ties are common."""
    gguf = pytest.importorskip("gguf")
    weights = (torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16().float()
    theirs = gguf.quants.quantize(weights.numpy(), gguf.GGMLQuantizationType[kind])
    assert (codec.quantize(weights).numpy() == theirs).all()
    back = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType[kind])
    assert torch.equal(codec.dequantize(torch.from_numpy(theirs), 512), torch.from_numpy(back))


def test_q4_k_reads_any_q4_k_bytes_as_the_gguf_package_and_writes_valid_ones():
    """Q4_K (the experts' type in Q4_K_M files): our reader equals the gguf package's on arbitrary
    bytes (every packed scale and minimum bit used, as llama.cpp's quantizer writes them); our min-max
    quantizer's bytes read back within each sub-block's step, and below Q4_0's error."""
    gguf = pytest.importorskip("gguf")
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3, 2 * q4k.BLOCK_BYTES), dtype=torch.uint8, generator=generator)
    data[:, 0:2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)  # finite d and dmin
    data[:, 2:4] = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8)
    data[:, 144:146], data[:, 146:148] = data[:, 0:2], data[:, 2:4]
    want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(q4k.dequantize(data, 512), torch.from_numpy(want))
    weights = torch.randn(4, 512, generator=generator)
    back = q4k.dequantize(q4k.quantize(weights), 512)
    blocks = weights.reshape(4, 16, 32)
    # a sub-block's step is its range / 15, up to rounding the scale and minimum to 6 bits of the largest
    step = (blocks.amax(-1) - blocks.amin(-1).clamp(max=0)) / 15
    largest = step.reshape(4, 2, 8).amax(-1, keepdim=True).expand(4, 2, 8).reshape(4, 16)
    assert ((back - weights).reshape(4, 16, 32).abs() <= (step + largest / 63 * 16)[..., None]).all()
    error = ((back - weights).norm() / weights.norm()).item()
    assert error < ((q4.dequantize(q4.quantize(weights), 512) - weights).norm() / weights.norm()).item()
    assert torch.equal(q4k.dequantize(q4k.quantize(torch.zeros(2, 256)), 256), torch.zeros(2, 256))
    with pytest.raises(ValueError, match="multiple of 256"):
        q4k.quantize(torch.randn(2, 96))
    with pytest.raises(ValueError, match="non-finite"):
        q4k.quantize(torch.full((1, 256), float("nan")))
    with pytest.raises(ValueError, match="overflow"):
        q4k.quantize(torch.linspace(-1e9, 1e9, 256).view(1, 256))
    with pytest.raises(ValueError, match="not Q4_K"):
        q4k.dequantize(data[:, :100], 512)


def test_q5_k_reads_as_the_gguf_package_and_halves_q4_ks_error():
    """Q5_K (Q5_K_M files' experts): our reader equals the gguf package's on arbitrary bytes, our
    min-max quantizer's bytes read the same through both, and the fifth bit halves Q4_K's error."""
    gguf = pytest.importorskip("gguf")
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3, 2 * q5k.BLOCK_BYTES), dtype=torch.uint8, generator=generator)
    for block in range(2):  # finite d and dmin of each super-block's own
        scales = (torch.rand(3, 2, generator=generator) * 0.02 + 0.001).to(torch.float16)
        data[:, block * 176:block * 176 + 4] = scales.view(torch.uint8)
    want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q5_K)
    assert torch.equal(q5k.dequantize(data, 512), torch.from_numpy(want))
    weights = torch.randn(4, 512, generator=generator)
    ours = q5k.quantize(weights)
    theirs = gguf.quants.dequantize(ours.numpy(), gguf.GGMLQuantizationType.Q5_K)
    assert torch.equal(q5k.dequantize(ours, 512), torch.from_numpy(theirs))
    error = lambda codec: ((codec.dequantize(codec.quantize(weights), 512) - weights).norm() / weights.norm()).item()  # noqa: E731
    assert error(q5k) < 0.6 * error(q4k)
    with pytest.raises(ValueError, match="multiple of 256"):
        q5k.quantize(torch.randn(2, 96))


def test_q6_k_reads_as_the_gguf_package():
    """Q6_K (a Q4_K_M file's down experts in some layers): random super-blocks, each with its own d,
    read exactly as the gguf package reads them."""
    gguf = pytest.importorskip("gguf")
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, 3 * q6k.BLOCK_BYTES), dtype=torch.uint8, generator=generator)
    for block in range(3):
        d = (torch.rand(4, 1, generator=generator) * 0.02 + 0.001).to(torch.float16)
        data[:, block * 210 + 208:block * 210 + 210] = d.view(torch.uint8)
    want = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q6_K)
    assert torch.equal(q6k.dequantize(data, 768), torch.from_numpy(want))
    with pytest.raises(ValueError, match="multiple of 256"):
        q6k.row_bytes(96)
    with pytest.raises(ValueError, match="not Q6_K"):
        q6k.dequantize(data[:, :100], 768)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("q8"), "tiny-6x64", seed=0)
    reference, processor = build_tiny_model("tiny-6x64", seed=0)
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    return model_dir, reference, inputs


@pytest.mark.parametrize("rules,fmt,error", [("optimize_rules/qwen3vl-offload.yaml", "q8_0", 1e-2),
                                              ("optimize_rules/qwen3vl-lru.yaml", "q8_0", 1e-2),
                                              ("optimize_rules/qwen3vl-offload.yaml", "q4_0", 0.2)])
def test_offloaded_decode_from_a_quantized_store(case, rules, fmt, error):
    model_dir, reference, inputs = case
    runs = {}
    for fmt, graphs in (("model", "off"), (fmt, "off"), (fmt, "replay")):
        model, _ = load(model_dir, rules, expert_budget=2 * LAYER_BYTES, store_dtype=fmt, graphs=graphs, **CPU)
        runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
        with torch.no_grad():
            logits = model(**inputs).logits
            tokens = generate(model, dict(inputs), 10, min_new_tokens=10)
        runs[fmt, graphs] = (runtime, logits, tokens, decode_engine(model).stats())
    runtime, logits, tokens, stats = runs[fmt, "off"]
    plain = runs["model", "off"][0]
    block_bytes = {"q8_0": 34, "q4_0": 18}[fmt]  # per 32 weights, against float32's 128
    assert runtime.store.nbytes == plain.store.nbytes * block_bytes / 32 / 4
    assert runtime.num_slabs == plain.num_slabs  # the GPU's slabs keep the model's dtype
    want = reference(**inputs).logits
    assert 0 < ((logits - want).norm() / want.norm()).item() <= error  # quantized, and within the format's error
    decode = [runtime.counters["decode"][layer] for layer in runtime.moe_layers if layer not in runtime.pinned]
    misses = sum(c.misses + c.late for c in decode)
    assert misses > 0 and runtime.copy_counters["decode"].bytes_host_reads == misses * runtime.store.block_bytes
    graphed = runs[fmt, "replay"]
    assert torch.equal(graphed[2], tokens)  # the graphs' CPU twin decodes the same tokens
    assert graphed[3]["graphed_steps"] == graphed[3]["steps"] == 9


def test_what_the_q8_store_cannot_do_yet_is_a_clear_error(case, tmp_path):
    model_dir, _, _ = case
    with pytest.raises(RuleError, match="store_dtype q8_0 with the hybrid mode needs cpu_backend: kt-kernel"):
        load(model_dir, "optimize_rules/qwen3vl.yaml", expert_budget=2 * LAYER_BYTES, store_dtype="q8_0",
             miss_policy="cpu", keep_ratio=1.0, **CPU)  # auto fetches them instead (test_offload_plan.py)
    with pytest.raises(RuleError, match="store_dtype 'q4' is not one of: auto, model, q8_0, q4_0, q4_k, q5_k"):
        load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=2 * LAYER_BYTES, store_dtype="q4", **CPU)
    odd = save_tiny_model(tmp_path / "odd", "tiny-4x16", seed=0)  # intermediate 48: not whole Q8_0 blocks
    with pytest.raises(RuleError, match="Q8_0 needs rows whose length is a multiple of 32, got 48"):
        load(odd, "optimize_rules/qwen3vl-offload.yaml", expert_budget=int(2 * 16 * 3 * 64 * 48 * 4),
             store_dtype="q8_0", **CPU)


@pytest.fixture(scope="module")
def case256(tmp_path_factory):
    spec = SPECS["tiny-3x32"]  # rows of 256 weights: whole tiles of every format the slabs can hold
    model_dir = save_tiny_model(tmp_path_factory.mktemp("qslabs"), spec, seed=0)
    _, processor = build_tiny_model(spec, seed=0)
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    return model_dir, spec, inputs


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k"])
def test_quantized_slabs_decode_as_dequantized_ones_and_hold_more_experts(case256, fmt):
    """slab_format quantized: the GPU's slabs (and the pinned layer's bank) keep the store's blocks and the
    decode GEMVs decode them as they read; the same numbers as slabs dequantized on arrival (every layer
    offloaded there: a pinned bank of dequantized slabs would hold the unquantized weights), in a fraction
    of the memory."""
    model_dir, spec, inputs = case256
    layer = spec.experts * 3 * spec.hidden * spec.moe_intermediate * 4  # float32 experts of one layer
    runs = {}
    for slabs, budget, graphs in (("dequantized", 3 * layer, "off"), ("quantized", None, "off"),
                                  ("quantized", None, "replay")):
        if budget is None:  # one pinned layer's blocks, and slabs for 40 of the other layers' 64 experts
            probe, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=3 * layer,
                            store_dtype=fmt, **CPU)
            block = next(m for m in probe.modules() if isinstance(m, VisExperts)).runtime.store.block_bytes
            budget = (spec.experts + 40) * block
        pinning = dict(pinned_layers=1) if slabs == "quantized" else dict(policy="lru")  # lru pins nothing
        model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget, store_dtype=fmt,
                        slab_format=slabs, graphs=graphs, **pinning, **CPU)
        runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
        with torch.no_grad():
            logits = model(**inputs).logits
            tokens = generate(model, dict(inputs), 10, min_new_tokens=10)
        runs[slabs, graphs] = (runtime, logits, tokens, decode_engine(model).stats())
    runtime, logits, tokens, _ = runs["quantized", "off"]
    dequantized = runs["dequantized", "off"]
    assert runtime.num_slabs == 40 and runtime.pool[0].dtype == torch.uint8 and len(runtime.pool) == 1
    assert runtime.banks[runtime.moe_layers[0]][0].dtype == torch.uint8 and dequantized[0].pinned == set()
    assert runtime.summary()["slab_format"] == "quantized"
    torch.testing.assert_close(logits, dequantized[1], rtol=1e-4, atol=1e-5)  # the same bytes, decoded elsewhere
    assert torch.equal(tokens, dequantized[2])
    decode = [runtime.counters["decode"][layer] for layer in runtime.moe_layers if layer not in runtime.pinned]
    misses = sum(c.misses + c.late for c in decode)
    assert misses > 0 and runtime.copy_counters["decode"].bytes_host_reads == misses * runtime.store.block_bytes
    graphed = runs["quantized", "replay"]
    assert torch.equal(graphed[2], tokens) and graphed[3]["graphed_steps"] == graphed[3]["steps"] == 9


def test_what_quantized_slabs_need_is_a_clear_error(case, case256):
    model_dir, _, _ = case256
    rules, budget = "optimize_rules/qwen3vl-offload.yaml", 10**9
    with pytest.raises(RuleError, match="slab_format quantized keeps the store's blocks in the slabs: it needs a quantized"):
        load(model_dir, rules, expert_budget=budget, store_dtype="model", slab_format="quantized", **CPU)
    with pytest.raises(RuleError, match="slab_format quantized works with miss_policy wait, not auto"):
        load(model_dir, "optimize_rules/qwen3vl.yaml", expert_budget=budget, store_dtype="q8_0", slab_format="quantized",
             keep_ratio=1.0, **CPU)
    with pytest.raises(RuleError, match="slab_format 'q4' is not one of: auto, dequantized, quantized"):
        load(model_dir, rules, expert_budget=budget, store_dtype="q8_0", slab_format="q4", **CPU)
    narrow_dir = case[0]  # tiny-6x64: hidden 96, not whole 256-weight tiles
    with pytest.raises(RuleError, match="hidden 96 and expert intermediate 64 must be multiples of 256"):
        load(narrow_dir, rules, expert_budget=2 * LAYER_BYTES, store_dtype="q8_0", slab_format="quantized", **CPU)


def test_quantized_slabs_hold_the_largest_down_experts_the_file_declares():
    """A Q4_K_M file's Q6_K down experts are larger than Q4_K blocks: the slabs are sized for what the
    file's header declares (gguf_down_formats), and a layer larger than that is a clear error."""
    from vismmoe_kt.models import adapter_for
    from vismmoe_kt.operators.base import gguf_down_formats
    from vismmoe_kt.runtime.budget import BudgetError
    from vismmoe_kt.runtime.offload import OffloadRuntime
    from vismmoe_kt.runtime.offload_settings import OffloadSettings

    class Header:  # what the GGUF reader answers from a Q4_K_M file's header
        def gguf_names(self, name):
            return adapter_for("qwen3_vl_moe").gguf_names(name)

        def tensor_type(self, name):
            return {"blk.1.ffn_down_exps.weight": "Q6_K", "blk.2.ffn_down_exps.weight": "Q4_K"}[name]

    assert gguf_down_formats(Header(), adapter_for("qwen3_vl_moe"), [1, 2, 3]) == {1: "q6_k", 2: "q4_k"}
    assert gguf_down_formats(object(), adapter_for("qwen3_vl_moe"), [1, 2]) == {}  # not reading GGUF
    settings = OffloadSettings(expert_budget=10**8, store_dtype="q4_k", slab_format="quantized", pinned_layers=1)
    gate, up = (q4k.quantize(torch.randn(4, 256, 256)) for _ in range(2))
    q6k_down = torch.zeros(4, 256, 210, dtype=torch.uint8)
    plain = OffloadRuntime(settings, [0, 1], 4, 256, 256, torch.float32, "cpu", top_k=2)
    with pytest.raises(BudgetError, match="layer 1's experts with q6_k down experts take"):
        plain.load_layer_raw(1, gate, up, q6k_down, down_format="q6_k")
    sized = OffloadRuntime(settings, [0, 1], 4, 256, 256, torch.float32, "cpu", top_k=2, down_formats={1: "q6_k"})
    assert sized.slab_bytes == sized.store.block_bytes_with("q6_k") > plain.slab_bytes == plain.store.block_bytes
    sized.load_layer_raw(1, gate, up, q6k_down, down_format="q6_k")
    assert 1 in sized.loaded and sized.store.block_bytes_of(1) == sized.slab_bytes


def test_slab_format_auto_is_quantized_wherever_quantized_slabs_work(case, case256):
    """The rules' default: a quantized store with whole 256-weight tiles and miss_policy wait gets
    quantized slabs; the model's dtype, sizes that are not whole tiles or a CPU miss path get
    dequantized ones, with no error (auto never asks for what cannot work)."""
    def slabs(model_dir, rules, **kw):
        model, _ = load(model_dir, rules, **kw, **CPU)
        runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
        return runtime.summary()["slab_format"], runtime.quantized_slabs

    rules = "optimize_rules/qwen3vl-offload.yaml"
    model_dir = case256[0]
    assert slabs(model_dir, rules, expert_budget=10**9, store_dtype="q4_k") == ("quantized", True)
    assert slabs(model_dir, rules, expert_budget=10**9, store_dtype="model") == ("dequantized", False)
    assert slabs(model_dir, rules, expert_budget=10**9, store_dtype="q4_k", slab_format="dequantized") \
        == ("dequantized", False)
    assert slabs(case[0], rules, expert_budget=2 * LAYER_BYTES, store_dtype="q8_0") == ("dequantized", False)
    from vismmoe_kt.runtime.offload import OffloadRuntime
    from vismmoe_kt.runtime.offload_settings import OffloadSettings

    for miss_policy, quantized in (("wait", True), ("cpu", False), ("auto", False)):  # the CPU backends read BF16
        settings = OffloadSettings(expert_budget=10**8, store_dtype="q8_0", miss_policy=miss_policy,
                                   cpu_backend="kt-kernel")
        runtime = OffloadRuntime(settings, [0, 1], 4, 256, 256, torch.float32, "cpu", top_k=2)
        assert runtime.quantized_slabs is quantized


@pytest.mark.parametrize("fmt,slabs,graphs,mode", [("q4_k", "quantized", "off", "table"),
                                                   ("q4_k", "quantized", "replay", "table"),
                                                   ("q4_k", "quantized", "off", "auto"),
                                                   ("q4_k", "quantized", "replay", "auto"),
                                                   ("q4_k", "quantized", "off", "expert-major"),
                                                   ("q8_0", "dequantized", "replay", "auto")])
def test_batched_steps_read_quantized_experts_through_the_table(case256, fmt, slabs, graphs, mode, monkeypatch):
    """Batched generation over a quantized store: each token of a batched step looks its experts up in
    the decode table after the one before it (a miss the first lands is a hit for the next), with
    quantized or dequantized slabs, eagerly and captured (`batch_experts` table); or, with quantized
    slabs and `batch_experts` expert-major or auto, the step's tokens at once (misses staged into
    landing slabs or staging rows, each expert decoded once per block of its tokens). Every request
    gets its tokens alone."""
    from vismmoe_kt.engine.generation import generate_batch
    from vismmoe_kt.runtime.executors import batch_step

    seen = {"calls": 0, "staged": 0, "landed": 0}

    def spy(hidden, top_k_index, slots, land, *args):
        seen["calls"] += 1
        seen["staged"] += int(((slots < 0) & (land < 0)).sum())
        seen["landed"] += int(((slots < 0) & (land >= 0)).sum())
        return quantized_batch_outputs(hidden, top_k_index, slots, land, *args)

    quantized_batch_outputs = batch_step.quantized_batch_outputs
    monkeypatch.setattr(batch_step, "quantized_batch_outputs", spy)

    model_dir, spec, _ = case256
    _, processor = build_tiny_model(spec, seed=0)
    layer = spec.experts * 3 * spec.hidden * spec.moe_intermediate * 4
    # expert-major: the pinned layer (its Q4_K blocks) and 33 Q4_K slabs for the other two layers' 64 experts,
    # so steps miss
    major = slabs == "quantized" and mode in ("auto", "expert-major")  # auto: expert-major on quantized slabs
    budget = (spec.experts + 33) * 3 * spec.hidden * spec.moe_intermediate // 256 * 144 if major else 2 * layer
    model, _ = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget=budget, store_dtype=fmt,
                    slab_format=slabs, graphs=graphs, pinned_layers=1, **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    runtime.batch_experts = mode
    assert runtime.batch_table and runtime.summary()["slab_format"] == slabs
    prompts = [processor(text=[f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
               for text in ("hello there", "what is this about", "two words")]
    budgets = [6, 4, 5]
    with torch.no_grad():
        alone = [generate(model, dict(p), n, min_new_tokens=n) for p, n in zip(prompts, budgets)]
        sizes, stats = [], {}
        together = generate_batch(model, [dict(p) for p in prompts], budgets, max_batch=3, min_new_tokens=max(budgets),
                                  on_step=sizes.append, stats=stats)
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    assert max(sizes) == 3
    if graphs == "replay":  # the offloaded layers inside the captures too
        assert stats["graphed_steps"] == stats["steps"] and stats["eager_pieces_per_step"] == 0
    if major:  # every batched step's offloaded layer at once; misses both landed and staged
        assert seen["calls"] > 0 and seen["landed"] > 0 and (graphs == "replay" or seen["staged"] > 0)
    else:
        assert seen["calls"] == 0  # token by token: the per-pair GEMVs (or dequantized slabs)
