"""Loading weights from GGUF (`--gguf_path`): a tiny Qwen3-VL-MoE written by the `gguf` package's own
writer in every type it writes, read back against the safetensors reference; the K-quants read
against the package's dequantization; and clear errors for files and tensors that cannot be read."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vismmoe_kt import load
from vismmoe_kt.core.gguf_checkpoint import GgufCheckpointReader
from vismmoe_kt.demo.gguf_export import export_gguf
from vismmoe_kt.demo.tiny import SPECS, build_processor, build_tiny_model, save_tiny_model
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.errors import LoadError
from vismmoe_kt.models import adapter_for

gguf = pytest.importorskip("gguf")

CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False, dtype="float32")
RULES = "optimize_rules/qwen3vl-offload.yaml"
# relative L2 error of the logits against the float32 safetensors model (random tiny weights)
EXPECTED_ERROR = {"F16": 2e-3, "BF16": 1.5e-2, "Q8_0": 3e-2, "Q5_0": 0.15, "Q5_1": 0.15, "Q4_0": 0.3, "Q4_1": 0.3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The reference model, and an HF directory holding only the vision tower's safetensors (so every
    text tensor must come from the GGUF)."""
    root = tmp_path_factory.mktemp("gguf")
    model, processor = build_tiny_model("tiny-6x64", seed=0)
    hf_dir = save_tiny_model(root / "hf", "tiny-6x64", seed=0)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("model.visual")}, str(hf_dir / "model.safetensors"))
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    return root, model, hf_dir, inputs


@pytest.mark.parametrize("qtype", list(EXPECTED_ERROR))
def test_every_written_type_loads_within_its_error(tiny, qtype):
    root, reference, hf_dir, inputs = tiny
    written = export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), root / f"{qtype}.gguf", qtype)
    assert written["blk.0.ffn_gate_exps.weight"] == qtype and written["blk.0.attn_norm.weight"] == "F32"
    model, _ = load(hf_dir, RULES, gguf_path=root / f"{qtype}.gguf", expert_budget="1GiB", **CPU)
    with torch.no_grad():
        got, want = model(**inputs).logits, reference(**inputs).logits
    error = ((got - want).norm() / want.norm()).item()
    assert error <= EXPECTED_ERROR[qtype], error


@pytest.mark.parametrize("qtype", ["BF16", "Q8_0"])
def test_the_trained_demo_model_answers_the_same_from_gguf(tmp_path, qtype):
    """Random weights give flat logits (a 1% error flips a greedy token); the trained demo model's
    answers to held-out questions, image and all, are the same read from BF16 or Q8_0 GGUF."""
    import shutil

    from vismmoe_kt.apps.evaluate import synthetic_items
    from vismmoe_kt.demo.tiny import demo_model_dir
    from vismmoe_kt.engine.inputs import build_inputs, user_turn

    source = demo_model_dir()
    hf_dir = tmp_path / "hf"
    shutil.copytree(source, hf_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("model.visual")}, str(hf_dir / "model.safetensors"))
    export_gguf(tensors, adapter_for("qwen3_vl_moe"), tmp_path / "demo.gguf", qtype)
    cpu = dict(generate_device="cpu", prefill_device="cpu", progress=False)
    reference, processor = load(source, RULES, expert_budget="1GiB", **cpu)
    model, _ = load(hf_dir, RULES, gguf_path=tmp_path / "demo.gguf", dtype=str(next(iter(tensors.values())).dtype)
                    .removeprefix("torch."), expert_budget="1GiB", **cpu)
    for item in synthetic_items("test", 4, ["colour", "count"]):
        inputs = build_inputs(processor, [user_turn(item.question, 1)], [item.image])
        with torch.no_grad():
            want = generate(reference, dict(inputs), 6, min_new_tokens=6)
            got = generate(model, dict(inputs), 6, min_new_tokens=6)
        assert torch.equal(got, want), (item.question, qtype)


def _write(path, tensors):
    """A GGUF file of `tensors` (name -> (data, type)), written by the gguf package."""
    writer = gguf.GGUFWriter(str(path), arch="qwen3vlmoe")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _k_quant_bytes(kind, rows, rng):
    """Random K-quant super-blocks (one per row) with random finite fp16 scales (the gguf package reads
    but cannot write them)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, 256 // block * size), dtype=np.uint8)
    scale_at = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[kind.name]
    for offset in scale_at:
        scales = rng.uniform(0.001, 0.02, (rows, 1)).astype(np.float16)
        data[:, offset:offset + 2] = scales.view(np.uint8)
    return data


@pytest.mark.parametrize("kind_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_read_as_the_gguf_package_dequantizes_them(tmp_path, kind_name):
    kind = gguf.GGMLQuantizationType[kind_name]
    rng = np.random.default_rng(0)
    gate, up = _k_quant_bytes(kind, 6, rng), _k_quant_bytes(kind, 6, rng)
    # (E 2, I 3, H 256)
    _write(tmp_path / "k.gguf", {"gate": (gate.reshape(2, 3, -1), kind), "up": (up.reshape(2, 3, -1), kind)})
    names = {"experts.gate_up_proj": ("gate", "up")}
    reader = GgufCheckpointReader(tmp_path, tmp_path / "k.gguf", names.get, dtype=torch.float32)
    fused = reader.load_tensor("experts.gate_up_proj")
    assert fused.shape == (2, 6, 256)  # (E, 2I, H): gate and up concatenated along dim 1
    want_gate = gguf.quants.dequantize(gate, kind).reshape(2, 3, 256)
    want_up = gguf.quants.dequantize(up, kind).reshape(2, 3, 256)
    assert torch.equal(fused, torch.from_numpy(np.concatenate([want_gate, want_up], axis=1)).float())
    assert torch.isfinite(fused).all() and fused.abs().sum() > 0


def test_unreadable_files_and_tensors_are_clear_errors(tiny, tmp_path):
    root, reference, hf_dir, _ = tiny
    good = root / "Q8_0-errors.gguf"
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), good, "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(LoadError, match=r"cut.gguf: (not a readable GGUF file|cannot read tensor)"):
        load(hf_dir, RULES, gguf_path=cut, expert_budget="1GiB", **CPU)
    with pytest.raises(LoadError, match=r"--gguf_path .*absent.gguf: no such file or directory"):
        load(hf_dir, RULES, gguf_path=tmp_path / "absent.gguf", expert_budget="1GiB", **CPU)
    # a tensor of the wrong shape names itself and both shapes
    state = dict(reference.state_dict())
    state["model.language_model.layers.1.mlp.gate.weight"] = torch.zeros(32, 96)
    export_gguf(state, adapter_for("qwen3_vl_moe"), tmp_path / "shape.gguf", "F16")
    with pytest.raises(LoadError, match=r"blk.1.ffn_gate_inp.weight .* has shape \(32, 96\), the model config wants"):
        load(hf_dir, RULES, gguf_path=tmp_path / "shape.gguf", expert_budget="1GiB", **CPU)
    # a text tensor that is in neither the GGUF nor the directory's safetensors
    del state["model.language_model.layers.1.mlp.gate.weight"]
    state["model.language_model.layers.1.mlp.gate.weight"] = reference.state_dict()["model.language_model.layers.1.mlp.gate.weight"]
    state.pop("model.language_model.norm.weight")
    export_gguf(state, adapter_for("qwen3_vl_moe"), tmp_path / "missing.gguf", "F16")
    with pytest.raises(LoadError, match=r"tensor 'model.language_model.norm.weight' is missing: it maps to GGUF tensor "
                                        r"output_norm.weight"):
        load(hf_dir, RULES, gguf_path=tmp_path / "missing.gguf", expert_budget="1GiB", **CPU)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    kind = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[kind]
    _write(tmp_path / "iq.gguf", {"w": (np.zeros((2, 64 // block * size), dtype=np.uint8), kind)})
    reader = GgufCheckpointReader(tmp_path, tmp_path / "iq.gguf", {"w": ("w",)}.get)
    with pytest.raises(LoadError, match=r"tensor 'w' is IQ4_NL; this loader reads F32, F16, BF16, Q8_0"):
        reader.load_tensor("w")


def test_the_cli_reads_weights_from_gguf_path(tiny, capsys):
    from vismmoe_kt.apps.cli import main

    root, reference, hf_dir, _ = tiny
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), root / "cli.gguf", "Q8_0")
    args = ["chat", "--model_path", str(hf_dir), "--optimize_config_path", RULES, "--prompt", "hi",
            "--max_new_tokens", "2", "--generate_device", "cpu", "--prefill_device", "cpu", "--set", "expert_budget=1GiB"]
    assert main(args + ["--gguf_path", str(root / "cli.gguf")]) == 0
    assert main(args + ["--gguf_path", str(root / "absent.gguf")]) != 0
    err = capsys.readouterr().err
    assert "--gguf_path" in err and "absent.gguf: no such file or directory" in err
    from vismmoe_kt.demo.gguf_export import export_mmproj

    export_mmproj(reference.state_dict(), adapter_for("qwen3_vl_moe"), reference.config, root / "cli-mmproj.gguf",
                  processor=build_processor(SPECS["tiny-6x64"]))
    assert main(args + ["--gguf_path", str(root / "cli.gguf"), "--mmproj_path", str(root / "cli-mmproj.gguf")]) == 0
    assert main(args + ["--mmproj_path", str(root / "cli-mmproj.gguf")]) != 0
    assert "give --gguf_path too" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("cpu_kernels.isa", fromlist=["x"]).kt_kernel_installed(),
                    reason="kt_kernel is not installed")
@pytest.mark.parametrize("qtype,error", [("Q8_0", 0.05), ("Q4_0", 0.35)])
def test_kt_cpu_computes_gguf_experts_as_stored(tmp_path, qtype, error):
    """KTransformers-style rules over a GGUF: the experts go to kt-kernel's llamafile kernels in the
    file's own type (no BF16 copy: its host memory is the quantized size), within the type's error."""
    from vismmoe_kt.demo.tiny import TinySpec

    spec = TinySpec(layers=2, experts=8, top_k=2, hidden=256, moe_intermediate=256, heads=4, kv_heads=2, head_dim=64)
    reference, processor = build_tiny_model(spec, seed=0)
    hf_dir = save_tiny_model(tmp_path / "hf", spec, seed=0)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("model.visual")}, str(hf_dir / "model.safetensors"))
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), tmp_path / "m.gguf", qtype)
    model, _ = load(hf_dir, "optimize_rules/qwen3vl-kt-cpu.yaml", gguf_path=tmp_path / "m.gguf", cpu_backend="kt-kernel",
                    cpu_infer=1, **CPU)
    backend = model.vismmoe.context.cpu_backend
    assert backend.stored_layers == spec.layers and "llamafile" in backend.describe()
    block_bytes = {"Q8_0": 34 / 32, "Q4_0": 18 / 32}[qtype]  # bytes per weight as stored
    assert backend.host_bytes == spec.layers * spec.experts * 3 * 256 * 256 * block_bytes
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    with torch.no_grad():
        got, want = model(**inputs).logits, reference(**inputs).logits
    assert ((got - want).norm() / want.norm()).item() <= error


class UpstreamStyleGGUFLoader:
    """The interface of KTransformers' GGUFLoader (util/custom_loader.py) that operators meet: tensors
    by GGUF name through `load_gguf_tensor(name, device, target_dtype)`, no `load_tensor`, no
    `context`; `safetensor_loader` None for a GGUF directory."""

    safetensor_loader = None

    def __init__(self, path):
        reader = gguf.GGUFReader(str(path))
        self.tensor_info = {t.name: t for t in reader.tensors}

    def has_tensor(self, name):
        return name in self.tensor_info

    def load_gguf_tensor(self, name, device="cpu", target_dtype=None):
        t = self.tensor_info[name]
        values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        return values.view(*reversed(t.shape.tolist())).to(device, target_dtype or torch.get_default_dtype())


def test_operators_read_experts_through_kt_transformers_gguf_loader(tiny):
    """Our operators' `load()` reads through upstream's GGUF interface (GGUF names, fused experts
    concatenated), the same tensors as our own reader; and layer indices parse from GGUF names too."""
    from vismmoe_kt.core.weights import read_tensor

    root, reference, hf_dir, _ = tiny
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), root / "up.gguf", "Q8_0")
    adapter = adapter_for("qwen3_vl_moe")
    ours = GgufCheckpointReader(hf_dir, root / "up.gguf", adapter.gguf_names, dtype=torch.float32)
    upstream = UpstreamStyleGGUFLoader(root / "up.gguf")
    for name in ("model.language_model.layers.2.mlp.experts.gate_up_proj",
                 "model.language_model.layers.2.mlp.experts.down_proj"):
        shape = reference.state_dict()[name].shape
        got = read_tensor(upstream, name, torch.device("cpu"), shape, adapter.gguf_names)
        assert torch.equal(got, ours.load_tensor(name)) and got.shape == shape
    with pytest.raises(LoadError, match="no GGUF name is known"):
        read_tensor(upstream, "model.visual.blocks.0.attn.qkv.weight", torch.device("cpu"), torch.Size([1]),
                    adapter.gguf_names)
    assert adapter.layer_of("blk.7.ffn_gate_exps") == 7 == adapter.layer_of("model.language_model.layers.7.mlp.experts")


@pytest.mark.skipif(not __import__("cpu_kernels.isa", fromlist=["x"]).kt_kernel_installed(),
                    reason="kt_kernel is not installed")
def test_the_hybrid_cpu_copy_is_the_gguf_experts_as_stored(tmp_path):
    """Hybrid mode over a Q8_0 GGUF: the store holds the dequantized experts for the GPU, and kt-kernel
    computes the CPU's misses on the file's own Q8_0 bytes (no BF16 or re-quantized copy)."""
    from vismmoe_kt.demo.tiny import TinySpec
    from vismmoe_kt.operators.vis_experts import VisExperts

    spec = TinySpec(layers=3, experts=8, top_k=2, hidden=256, moe_intermediate=256, heads=4, kv_heads=2, head_dim=64)
    reference, processor = build_tiny_model(spec, seed=0)
    hf_dir = save_tiny_model(tmp_path / "hf", spec, seed=0)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("model.visual")}, str(hf_dir / "model.safetensors"))
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), tmp_path / "m.gguf", "Q8_0")
    layer_bytes = spec.experts * 3 * 256 * 256 * 4  # float32 experts
    model, _ = load(hf_dir, "optimize_rules/qwen3vl.yaml", gguf_path=tmp_path / "m.gguf", keep_ratio=1.0,
                    expert_budget=2 * layer_bytes, miss_policy="cpu", cpu_backend="kt-kernel", cpu_infer=1, **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    offloaded = len(runtime.moe_layers) - len(runtime.pinned)
    assert offloaded > 0 and runtime.cpu.stored_layers == offloaded
    assert runtime.cpu.host_bytes == offloaded * spec.experts * 3 * 256 * 256 * 34 / 32
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    with torch.no_grad():
        got, want = model(**inputs).logits, reference(**inputs).logits
    assert ((got - want).norm() / want.norm()).item() <= 0.05


@pytest.mark.parametrize("qtype,error", [("Q8_0", 3e-2), ("Q4_0", 0.3)])
def test_a_quantized_gguf_fills_a_store_of_its_format_byte_for_byte(tiny, qtype, error):
    """Offloaded layers of a Q8_0 (Q4_0) GGUF go into a Q8_0 (Q4_0) host store as the file stores them
    (no dequantizing and requantizing); decoding from it stays within the format's error."""
    from vismmoe_kt.operators.vis_experts import VisExperts

    root, reference, hf_dir, inputs = tiny
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), root / f"store-{qtype}.gguf", qtype)
    spec_bytes = 64 * 3 * 96 * 64 * 4  # one float32 layer of tiny-6x64's experts
    model, _ = load(hf_dir, RULES, gguf_path=root / f"store-{qtype}.gguf", expert_budget=2 * spec_bytes,
                    store_dtype=qtype.lower(), **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    layer = next(layer for layer in runtime.moe_layers if layer not in runtime.pinned)
    file = gguf.GGUFReader(str(root / f"store-{qtype}.gguf"))
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in file.tensors if t.name.startswith(f"blk.{layer}.ffn_")}
    per_block = {"Q8_0": 34, "Q4_0": 18}[qtype]
    row_h, row_i = 96 // 32 * per_block, 64 // 32 * per_block
    gate_up, down = (runtime.store.layers[layer][:, :128 * row_h], runtime.store.layers[layer][:, 128 * row_h:])
    assert torch.equal(gate_up.reshape(64, 128, row_h)[:, :64], raw[f"blk.{layer}.ffn_gate_exps.weight"])
    assert torch.equal(gate_up.reshape(64, 128, row_h)[:, 64:], raw[f"blk.{layer}.ffn_up_exps.weight"])
    assert torch.equal(down.reshape(64, 96, row_i), raw[f"blk.{layer}.ffn_down_exps.weight"])
    with torch.no_grad():
        got, want = model(**inputs).logits, reference(**inputs).logits
    assert ((got - want).norm() / want.norm()).item() <= error


@pytest.mark.parametrize("qtype,bound", [("Q4_K", "Q4_0"), ("Q5_K", "Q4_K")])
def test_a_k_quant_gguf_fills_a_store_of_its_format_as_stored(tmp_path, qtype, bound):
    """Q4_K and Q5_K, the experts' types in the Q4_K_M / Q5_K_M files users run, on a model whose sizes
    are multiples of 256: the file's expert bytes become the host store's blocks unchanged, and the
    logits stay closer to the float32 model's than a file one step coarser (Q4_0, same bytes as Q4_K;
    Q4_K for Q5_K)."""
    from vismmoe_kt.operators.vis_experts import VisExperts
    from vismmoe_kt.runtime.store import CODECS

    model_ref, processor = build_tiny_model("tiny-2x8", seed=0)
    hf_dir = save_tiny_model(tmp_path / "hf", "tiny-2x8", seed=0)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("model.visual")}, str(hf_dir / "model.safetensors"))
    codec, kind = CODECS[qtype.lower()], gguf.GGMLQuantizationType[qtype]
    written = export_gguf(model_ref.state_dict(), adapter_for("qwen3_vl_moe"), tmp_path / "k.gguf", qtype)
    assert written["blk.0.ffn_gate_exps.weight"] == qtype == written["blk.1.ffn_down_exps.weight"]
    file = gguf.GGUFReader(str(tmp_path / "k.gguf"))
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in file.tensors if t.name.startswith("blk.1.ffn_")}
    # what the gguf package reads from our bytes is what our decoder reads
    want = gguf.quants.dequantize(raw["blk.1.ffn_down_exps.weight"].numpy(), kind)
    assert np.array_equal(codec.dequantize(raw["blk.1.ffn_down_exps.weight"], 512).numpy(), want)
    layer_bytes = 8 * 3 * 256 * 512 * 4  # one float32 layer of experts
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    model, _ = load(hf_dir, "optimize_rules/qwen3vl-lru.yaml", gguf_path=tmp_path / "k.gguf",
                    expert_budget=layer_bytes, store_dtype=qtype.lower(), **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    assert runtime.pinned == set() and runtime.store.fmt == qtype.lower()
    row_h, row_i = codec.row_bytes(256), codec.row_bytes(512)
    gate_up, down = runtime.store.layers[1][:, :1024 * row_h], runtime.store.layers[1][:, 1024 * row_h:]
    assert torch.equal(gate_up.reshape(8, 1024, row_h)[:, :512], raw["blk.1.ffn_gate_exps.weight"])
    assert torch.equal(gate_up.reshape(8, 1024, row_h)[:, 512:], raw["blk.1.ffn_up_exps.weight"])
    assert torch.equal(down.reshape(8, 256, row_i), raw["blk.1.ffn_down_exps.weight"])
    export_gguf(model_ref.state_dict(), adapter_for("qwen3_vl_moe"), tmp_path / "coarser.gguf", bound)
    coarser, _ = load(hf_dir, "optimize_rules/qwen3vl-lru.yaml", gguf_path=tmp_path / "coarser.gguf",
                      expert_budget=layer_bytes, store_dtype=bound.lower(), **CPU)
    with torch.no_grad():
        want = model_ref(**inputs).logits
        error = ((model(**inputs).logits - want).norm() / want.norm()).item()
        error_coarser = ((coarser(**inputs).logits - want).norm() / want.norm()).item()
    # every weight of the file quantized (attention too)
    assert 0 < error < error_coarser <= 0.5, (error, error_coarser)


def test_the_vision_tower_loads_from_an_mmproj_file(tiny, tmp_path):
    """`--mmproj_path`: with no safetensors at all beside the config, the text from the GGUF and the
    vision tower from an mmproj file under llama.cpp's names (blocks through the gguf package's name
    map, `mm.0` / `mm.2`, `v.post_ln`, `v.deepstack.<layer>`, the patch embedding in two time slices):
    an image's logits match the float32 model within F16's error."""
    from conftest import make_image
    from vismmoe_kt.demo.gguf_export import export_mmproj

    root, reference, hf_dir, _ = tiny
    bare = tmp_path / "hf"
    bare.mkdir()
    for file in hf_dir.iterdir():  # everything but the weights
        if file.suffix != ".safetensors":
            (bare / file.name).write_bytes(file.read_bytes())
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), tmp_path / "text.gguf", "F16")
    tiny_processor = build_processor(SPECS["tiny-6x64"])
    written = export_mmproj(reference.state_dict(), adapter_for("qwen3_vl_moe"), reference.config,
                            tmp_path / "mmproj.gguf", "F16", processor=tiny_processor)
    layers = reference.config.vision_config.deepstack_visual_indexes
    assert {"v.patch_embd.weight", "v.patch_embd.weight.1", "mm.0.weight", "mm.2.bias", "v.post_ln.weight",
            "v.blk.0.attn_qkv.weight", "v.position_embd.weight", f"v.deepstack.{layers[-1]}.fc2.weight"} <= set(written)
    with pytest.raises(LoadError, match=r"'model.visual.patch_embed.proj.weight' is missing: it maps to mmproj "
                                        r"tensors v.patch_embd.weight, v.patch_embd.weight.1 \(no --mmproj_path given\)"):
        load(bare, RULES, gguf_path=tmp_path / "text.gguf", expert_budget="1GiB", **CPU)
    partial = {k: v for k, v in reference.state_dict().items() if k != "model.visual.merger.linear_fc1.weight"}
    export_mmproj(partial, adapter_for("qwen3_vl_moe"), reference.config, tmp_path / "partial.gguf", "F16",
                  processor=tiny_processor)
    with pytest.raises(LoadError, match=r"partial.gguf: the model's vision tensor "
                                        r"'model.visual.merger.linear_fc1.weight' is missing: it maps to mmproj tensor mm.0.weight"):
        load(hf_dir, RULES, gguf_path=tmp_path / "text.gguf", mmproj_path=tmp_path / "partial.gguf", **CPU)
    with pytest.raises(LoadError, match=r"--mmproj_path .*absent.gguf: no such file"):
        load(bare, RULES, gguf_path=tmp_path / "text.gguf", mmproj_path=tmp_path / "absent.gguf", **CPU)
    with pytest.raises(LoadError, match="give --gguf_path too"):
        load(bare, RULES, mmproj_path=tmp_path / "mmproj.gguf", expert_budget="1GiB", **CPU)
    model, processor = load(bare, RULES, gguf_path=tmp_path / "text.gguf", mmproj_path=tmp_path / "mmproj.gguf",
                            expert_budget="1GiB", **CPU)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[make_image(96, 64, seed=3)], return_tensors="pt")
    with torch.no_grad():
        got, want = model(**inputs).logits, reference(**inputs).logits
    assert ((got - want).norm() / want.norm()).item() <= EXPECTED_ERROR["F16"]


def test_mmproj_names_are_llama_cpps_for_qwen3_vl_30b_a3b():
    """The mapping against names llama.cpp's converter writes for Qwen3-VL-30B-A3B's vision tower (27
    blocks, DeepStack mergers reading blocks 8, 16 and 24), fixed here: a round trip through our own
    writer would not notice two names swapped."""
    from types import SimpleNamespace

    config = SimpleNamespace(vision_config=SimpleNamespace(depth=27, deepstack_visual_indexes=[8, 16, 24]))
    adapter = adapter_for("qwen3_vl_moe")
    expected = {
        "model.visual.patch_embed.proj.weight": (("v.patch_embd.weight", "v.patch_embd.weight.1"), 2),
        "model.visual.patch_embed.proj.bias": (("v.patch_embd.bias",), None),
        "model.visual.pos_embed.weight": (("v.position_embd.weight",), None),
        "model.visual.blocks.26.norm1.weight": (("v.blk.26.ln1.weight",), None),
        "model.visual.blocks.26.norm2.bias": (("v.blk.26.ln2.bias",), None),
        "model.visual.blocks.3.attn.qkv.weight": (("v.blk.3.attn_qkv.weight",), None),
        "model.visual.blocks.3.attn.proj.bias": (("v.blk.3.attn_out.bias",), None),
        "model.visual.blocks.0.mlp.linear_fc1.weight": (("v.blk.0.ffn_up.weight",), None),
        "model.visual.blocks.0.mlp.linear_fc2.weight": (("v.blk.0.ffn_down.weight",), None),
        "model.visual.merger.norm.weight": (("v.post_ln.weight",), None),
        "model.visual.merger.linear_fc1.weight": (("mm.0.weight",), None),
        "model.visual.merger.linear_fc2.bias": (("mm.2.bias",), None),
        "model.visual.deepstack_merger_list.0.linear_fc1.weight": (("v.deepstack.8.fc1.weight",), None),
        "model.visual.deepstack_merger_list.1.norm.bias": (("v.deepstack.16.norm.bias",), None),
        "model.visual.deepstack_merger_list.2.linear_fc2.weight": (("v.deepstack.24.fc2.weight",), None),
    }
    for name, (names, stack_dim) in expected.items():
        source = adapter.mmproj_source(name, config)
        assert source is not None and (source.names, source.stack_dim) == (names, stack_dim), name
    for outside in ("model.language_model.layers.0.mlp.gate.weight", "lm_head.weight",
                    "model.visual.deepstack_merger_list.3.norm.weight"):  # no fourth DeepStack merger
        assert adapter.mmproj_source(outside, config) is None


def test_a_q4_k_m_files_q6_k_down_experts_go_into_the_store_as_stored(tmp_path):
    """Q4_K_M files keep the down experts of about half of the layers in Q6_K: a Q4_K store takes such
    a layer as stored (gate and up Q4_K, down Q6_K, blocks of their own size) instead of requantizing,
    and computes what the same file gives when every tensor is dequantized at load."""
    from vismmoe_kt.operators.vis_experts import VisExperts
    from vismmoe_kt.runtime import q6k

    model_ref, processor = build_tiny_model("tiny-2x8", seed=0)
    hf_dir = save_tiny_model(tmp_path / "hf", "tiny-2x8", seed=0)
    export_gguf(model_ref.state_dict(), adapter_for("qwen3_vl_moe"), tmp_path / "q4k.gguf", "Q4_K")
    # the same file with layer 1's down experts in Q6_K (random blocks: the gguf package cannot write them)
    source = gguf.GGUFReader(str(tmp_path / "q4k.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "q4km.gguf"), arch="qwen3vlmoe")
    rng = np.random.default_rng(1)
    for tensor in source.tensors:
        data, kind = np.array(tensor.data), tensor.tensor_type
        if tensor.name == "blk.1.ffn_down_exps.weight":  # (E 8, H 256, I 512)
            kind = gguf.GGMLQuantizationType.Q6_K
            data = _k_quant_bytes(kind, 8 * 256 * 2, rng).reshape(8, 256, 2 * 210)
            q6k_down = torch.from_numpy(data.copy())
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    layer_bytes = 8 * 3 * 256 * 512 * 4
    inputs = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    model, _ = load(hf_dir, "optimize_rules/qwen3vl-lru.yaml", gguf_path=tmp_path / "q4km.gguf",
                    expert_budget=layer_bytes, store_dtype="q4_k", **CPU)
    store = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime.store
    assert store.down_format(0) == "q4_k" and store.down_format(1) == "q6_k"
    assert store.block_bytes_of(1) == 1024 * 144 + 256 * q6k.row_bytes(512) > store.block_bytes_of(0)
    assert torch.equal(store.layers[1][:, 1024 * 144:].reshape(8, 256, 420), q6k_down)  # as stored
    dequantized, _ = load(hf_dir, "optimize_rules/qwen3vl-lru.yaml", gguf_path=tmp_path / "q4km.gguf",
                          expert_budget=layer_bytes, **CPU)  # every tensor dequantized at load
    with torch.no_grad():
        got, want = model(**inputs).logits, dequantized(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_store_dtype_auto_keeps_a_ggufs_expert_format(tiny):
    """The rule files' `store_dtype: auto`: a Q8_0 GGUF's experts stay Q8_0 in the host store (its
    bytes, half of BF16's host memory), under the default rules too (their torch CPU backend cannot read
    blocks: every miss is fetched); a BF16 GGUF, safetensors, an explicit `model` or a CPU share asked of
    the torch backend keep the model's dtype."""
    from vismmoe_kt.operators.vis_experts import VisExperts

    root, reference, hf_dir, _ = tiny
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), root / "auto-q8.gguf", "Q8_0")
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), root / "auto-bf16.gguf", "BF16")

    def store_of(**kwargs):
        model, _ = load(hf_dir, RULES, expert_budget="1GiB", **kwargs, **CPU)
        return next(m for m in model.modules() if isinstance(m, VisExperts)).runtime.store

    assert store_of(gguf_path=root / "auto-q8.gguf").fmt == "q8_0"
    assert store_of(gguf_path=root / "auto-q8.gguf", store_dtype="model").fmt == "model"
    assert store_of(gguf_path=root / "auto-bf16.gguf").fmt == "model"
    full = save_tiny_model(root / "auto-st", "tiny-6x64", seed=0)
    model, _ = load(full, RULES, expert_budget="1GiB", **CPU)
    assert next(m for m in model.modules() if isinstance(m, VisExperts)).runtime.store.fmt == "model"
    for misses, store, hybrid in (("auto", "q8_0", False), ("cpu", "model", True)):
        model, _ = load(hf_dir, "optimize_rules/qwen3vl.yaml", gguf_path=root / "auto-q8.gguf", expert_budget="1GiB",
                        keep_ratio=1.0, cpu_backend="torch", miss_policy=misses, **CPU)
        runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
        assert (runtime.store.fmt, runtime.plan.hybrid) == (store, hybrid), misses


def test_a_written_gguf_carries_what_llama_cpp_reads_before_it_loads(tiny, tmp_path):
    """llama.cpp refuses a qwen3vlmoe file without its hyperparameters (`key not found in model:
    qwen3vlmoe.context_length`): the writer puts every one it reads, taken from the config, and our loader
    still reads the file as before."""
    from gguf import GGUFReader

    root, reference, hf_dir, inputs = tiny
    path = tmp_path / "llama.gguf"
    export_gguf(reference.state_dict(), adapter_for("qwen3_vl_moe"), path, "Q8_0", config=reference.config)
    fields = GGUFReader(str(path)).fields

    def value(key):
        field = fields[key]
        parts = [field.parts[i] for i in field.data]
        if len(parts) == 1 and parts[0].dtype.kind == "u" and parts[0].dtype.itemsize == 1:
            return bytes(parts[0]).decode()
        values = [p.tolist()[0] for p in parts]
        return values if len(values) > 1 or key.endswith("dimension_sections") else values[0]

    text = reference.config.text_config
    required = {"context_length": text.max_position_embeddings, "embedding_length": text.hidden_size,
                "block_count": text.num_hidden_layers, "feed_forward_length": text.intermediate_size,
                "expert_feed_forward_length": text.moe_intermediate_size, "expert_count": text.num_experts,
                "expert_used_count": text.num_experts_per_tok, "attention.head_count": text.num_attention_heads,
                "attention.head_count_kv": text.num_key_value_heads, "attention.key_length": text.head_dim,
                "attention.value_length": text.head_dim, "n_deepstack_layers": 2, "vocab_size": text.vocab_size,
                "rope.dimension_sections": [*text.rope_parameters["mrope_section"], 0]}
    assert {key: value(f"qwen3vlmoe.{key}") for key in required} == required
    assert value("qwen3vlmoe.n_deepstack_layers") < value("qwen3vlmoe.block_count")
    assert abs(value("qwen3vlmoe.attention.layer_norm_rms_epsilon") - text.rms_norm_eps) < 1e-9
    assert value("qwen3vlmoe.rope.freq_base") == text.rope_parameters["rope_theta"]
    assert value("general.architecture") == "qwen3vlmoe" and value("tokenizer.ggml.model") == "no_vocab"
    model, _ = load(hf_dir, RULES, gguf_path=path, expert_budget="1GiB", **CPU)
    with torch.no_grad():
        got, want = model(**inputs).logits, reference(**inputs).logits
    assert ((got - want).norm() / want.norm()).item() <= EXPECTED_ERROR["Q8_0"]


def test_without_a_dtype_a_load_follows_the_files_type(tmp_path):
    """A file written all in F32 loads in float32 (the precision it was written in); one with BF16 or
    quantized matrices beside F32 norms in bfloat16; the mmproj's F16 does not decide; `dtype` wins."""
    F32, BF16, Q8_0 = (gguf.GGMLQuantizationType[name] for name in ("F32", "BF16", "Q8_0"))
    matrix = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    norm = np.ones(32, dtype=np.float32)
    names = {"w": ("w",), "norm": ("norm",)}.get
    _write(tmp_path / "f32.gguf", {"w": (matrix, F32), "norm": (norm, F32)})
    _write(tmp_path / "mmproj-f16.gguf", {"v": (matrix.astype(np.float16), gguf.GGMLQuantizationType.F16)})
    _write(tmp_path / "q8.gguf", {"w": (gguf.quants.quantize(matrix, Q8_0), Q8_0), "norm": (norm, F32)})
    _write(tmp_path / "bf16.gguf", {"w": (gguf.quants.quantize(matrix, BF16), BF16), "norm": (norm, F32)})

    f32 = GgufCheckpointReader(tmp_path, tmp_path / "f32.gguf", names, mmproj_path=tmp_path / "mmproj-f16.gguf")
    assert f32.dtype == torch.float32
    assert f32.load_tensor("w").dtype == torch.float32 and torch.equal(f32.load_tensor("w"), torch.from_numpy(matrix))
    for quantized in ("q8.gguf", "bf16.gguf"):
        reader = GgufCheckpointReader(tmp_path, tmp_path / quantized, names)
        assert reader.dtype == torch.bfloat16 and reader.load_tensor("w").dtype == torch.bfloat16
    assert GgufCheckpointReader(tmp_path, tmp_path / "f32.gguf", names, dtype=torch.float16).load_tensor("w").dtype \
        == torch.float16
