"""FP8 checkpoints with block scales (as the published Qwen3-VL FP8 models store them) load through the
same reader, dequantized as read; integer-quantized ones are a clear error naming what is supported."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from vismmoe_kt import load
from vismmoe_kt.demo.tiny import build_tiny_model, save_tiny_model
from vismmoe_kt.errors import LoadError

CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False)
BLOCK = 32


def to_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 e4m3 weight, scale_inv per BLOCK x BLOCK block of the last two dims): weight ~= fp8 * scale."""
    *lead, rows, cols = weight.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(*lead, br * BLOCK, bc * BLOCK)
    padded[..., :rows, :cols] = weight.float()
    blocks = padded.view(*lead, br, BLOCK, bc, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0  # e4m3's largest finite value
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :rows, :cols]
    return (weight.float() / full).to(torch.float8_e4m3fn), scale


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    model_dir = save_tiny_model(root / "m", "tiny-6x64", seed=0)
    tensors = load_file(str(model_dir / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if tensor.dim() >= 2 and "embed" not in name and "lm_head" not in name:
            out[name], out[f"{name}_scale_inv"] = to_fp8(tensor)
        else:
            out[name] = tensor
    save_file(out, str(model_dir / "model.safetensors"))
    return model_dir


def test_fp8_block_scaled_checkpoint_loads_within_fp8_error(fp8_dir):
    reference, processor = build_tiny_model("tiny-6x64", seed=0)
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    model, _ = load(fp8_dir, "optimize_rules/qwen3vl-offload.yaml", expert_budget="1GiB", dtype="float32", **CPU)
    with torch.no_grad():
        got, want = model(**inputs).logits, reference(**inputs).logits
    error = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < error <= 0.1, error  # really FP8 (not silently the float weights), within e4m3's error


def test_fp8_without_its_scales_and_integer_checkpoints_are_clear_errors(fp8_dir, tmp_path):
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    broken = tmp_path / "noscale"
    save_tiny_model(broken, "tiny-6x64", seed=0)
    name = "model.language_model.layers.0.mlp.gate.weight"
    save_file({k: v for k, v in tensors.items() if k != f"{name}_scale_inv"}, str(broken / "model.safetensors"))
    with pytest.raises(LoadError, match=rf"{name}' is float8_e4m3fn without '{name}_scale_inv'"):
        load(broken, "optimize_rules/qwen3vl-offload.yaml", expert_budget="1GiB", **CPU)
    gptq = tmp_path / "gptq"
    save_tiny_model(gptq, "tiny-6x64", seed=0)
    plain = load_file(str(gptq / "model.safetensors"))
    plain[name] = torch.zeros(plain[name].shape, dtype=torch.int32)
    save_file(plain, str(gptq / "model.safetensors"))
    with pytest.raises(LoadError, match=r"is int32, not a floating-point type; .*FP8 ones with block scales .*GGUF files"):
        load(gptq, "optimize_rules/qwen3vl-offload.yaml", expert_budget="1GiB", **CPU)
