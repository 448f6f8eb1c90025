"""A random-weight model written as a GGUF checkpoint (benchmarks/models/synthetic_gguf.py), as the benchmarks write
Qwen3-VL-30B-A3B's shapes: read back with `--gguf_path`, it is the synthetic model up to the
quantization, and its Q4_K experts stay Q4_K in the host store."""

import pytest
import torch
from safetensors import safe_open

from vismmoe_kt import load
from benchmarks.models.synthetic import assemble_synthetic
from benchmarks.models.synthetic_gguf import write_synthetic_checkpoint
from vismmoe_kt.demo.tiny import SPECS, build_config, build_processor

gguf = pytest.importorskip("gguf")

CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False, dtype="float32", expert_budget="1GiB")
RULES = "optimize_rules/qwen3vl-offload.yaml"
SEED = 3


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    spec = SPECS["tiny-2x8"]  # rows of 256 and 512: whole K-quant super-blocks
    processor = build_processor(spec)
    config = build_config(spec, processor.tokenizer)
    out = tmp_path_factory.mktemp("synthetic-gguf")
    info = write_synthetic_checkpoint(out, config, processor, qtype="Q4_K", rest="Q8_0", seed=SEED, progress=False,
                                      dtype=torch.float32)
    inputs = processor(text=["<|im_start|>user\nwhat is here?<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    return out, info, config, processor, inputs


def test_the_file_holds_experts_in_qtype_the_rest_in_rest_and_the_vision_tower_beside_it(written):
    out, info, *_ = written
    types = info["types"]
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"  # the router, as llama.cpp keeps it whatever the file's type
    reader = gguf.GGUFReader(str(out / "model-Q4_K.gguf"))
    stored = {t.name: t.tensor_type.name for t in reader.tensors}
    assert stored == types
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("model.visual.") for k in keys)


def test_read_back_it_is_the_synthetic_model_up_to_q4_k_and_the_store_keeps_q4_k(written):
    out, info, config, processor, inputs = written
    reference, _ = assemble_synthetic(config, processor, RULES, seed=SEED, **CPU)
    offload = {**CPU, "expert_budget": "24MiB", "pinned_layers": 1}  # 12 MiB a layer: 1 offloaded
    model, _ = load(out, RULES, gguf_path=out, **offload)  # store_dtype auto: the file's Q4_K bytes in the store
    dequantized, _ = load(out, RULES, gguf_path=out, store_dtype="model", **offload)  # the gguf package's dequantization
    with torch.no_grad():
        want, got, read = reference(**inputs).logits, model(**inputs).logits, dequantized(**inputs).logits
    torch.testing.assert_close(got, read, rtol=1e-4, atol=1e-5)  # the store's Q4_K = the gguf package's
    error = ((got - want).norm() / want.norm()).item()
    # quantized (not 0) and close; this random model is sensitive: Q8_0 everywhere alone gives about 10%
    assert 0.01 < error < 0.2, error
    runtime = model.vismmoe.context.offload_runtime
    assert 1 not in runtime.pinned and runtime.summary()["bytes_copied_prefill"] > 0  # the store was read
    assert runtime.store.fmt == "q4_k" and dequantized.vismmoe.context.offload_runtime.store.fmt == "model"
    bf16_bytes = 3 * config.text_config.hidden_size * config.text_config.moe_intermediate_size * 2
    assert runtime.store.block_bytes <= 0.3 * bf16_bytes


def test_a_type_the_writer_cannot_write_is_refused_before_anything_is_written(tmp_path, written):
    _, _, config, processor, _ = written
    with pytest.raises(ValueError, match="Q6_K"):
        write_synthetic_checkpoint(tmp_path / "x", config, processor, qtype="Q6_K", progress=False)
    assert not (tmp_path / "x").exists()


def test_the_two_gguf_files_alone_are_the_same_model(written):
    """The vocabulary, chat template and mmproj the writer adds: with no HF directory, the logits are the
    directory load's (the same GGUF text weights; the tower F16 in the mmproj, float32 beside)."""
    from vismmoe_kt.core.gguf_model import model_dir_from_gguf

    out, info, config, processor, inputs = written
    rebuilt = model_dir_from_gguf(info["gguf_file"], info["mmproj_file"])
    model, alone = load(rebuilt, RULES, gguf_path=info["gguf_file"], mmproj_path=info["mmproj_file"], **CPU)
    beside, _ = load(out, RULES, gguf_path=out, **CPU)
    assert alone.tokenizer("what is here?")["input_ids"] == processor.tokenizer("what is here?")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, beside(**inputs).logits)  # text only: the tower unused
