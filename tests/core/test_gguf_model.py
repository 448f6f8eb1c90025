"""A model from GGUF files alone: `vismmoe-kt convert` writes the pair (model GGUF with the vocabulary and
chat template, mmproj GGUF with the clip.* keys), and `--gguf_path FILE --mmproj_path FILE` with no
`--model_path` rebuilds config, tokenizer, processor and generation config from them: equal to the Hugging
Face directory's, the same tokens generated, and clear errors for what a file cannot give."""

import re
import shutil

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.apps.cli import main
from vismmoe_kt.core.gguf_model import model_dir_from_gguf, read_metadata
from vismmoe_kt.demo.gguf_export import export_gguf, export_mmproj
from vismmoe_kt.demo.pictures import make_image
from vismmoe_kt.demo.tiny import build_tiny_model, save_tiny_model
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.engine.inputs import build_inputs, user_turn
from vismmoe_kt.errors import LoadError
from vismmoe_kt.models import adapter_for

gguf = pytest.importorskip("gguf")
CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False, dtype="float32")


def _write_pair(model, processor, out, qtype="F32", with_vocab=True):
    adapter = adapter_for(model.config.model_type)
    state = model.state_dict()
    text, mmproj = out / "model.gguf", out / "mmproj-model.gguf"
    export_gguf(state, adapter, text, qtype, config=model.config, processor=processor if with_vocab else None)
    export_mmproj(state, adapter, model.config, mmproj, qtype, processor=processor)
    return text, mmproj


def _differences(want, got, prefix=""):
    out = []
    for key in sorted(set(want) | set(got)):
        a, b = want.get(key), got.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b and key not in ("_name_or_path", "initializer_range"):  # the tiny GLM's init std: unused
            out.append(f"{prefix}{key}: {a!r} != {b!r}")
    return out


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-only")
    hf_dir = save_tiny_model(root / "hf", "tiny-4x16", seed=0)
    model, processor = build_tiny_model("tiny-4x16", seed=0)
    (root / "pair").mkdir()
    text, mmproj = _write_pair(model, processor, root / "pair")
    return hf_dir, text, mmproj, model, processor


def test_the_pair_rebuilds_the_hf_directorys_config_tokenizer_and_processor(qwen_pair):
    hf_dir, text, mmproj, model, processor = qwen_pair
    from transformers import AutoConfig, GenerationConfig

    rebuilt = model_dir_from_gguf(text, mmproj)
    assert not any(rebuilt.glob("*.safetensors"))
    assert _differences(model.config.to_dict(), AutoConfig.from_pretrained(rebuilt).to_dict()) == []
    assert GenerationConfig.from_pretrained(rebuilt).eos_token_id == model.generation_config.eos_token_id
    got = adapter_for("qwen3_vl_moe").load_processor(rebuilt)
    samples = ["hello there", "<|im_start|>user\nÄpfel, 3 ✓<|im_end|>", "<|vision_start|><|image_pad|><|vision_end|>"]
    for sample in samples:
        assert got.tokenizer(sample)["input_ids"] == processor.tokenizer(sample)["input_ids"], sample
    assert got.chat_template == processor.chat_template
    want_images, got_images = processor.image_processor, got.image_processor
    for field in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "size"):
        assert getattr(got_images, field) == getattr(want_images, field), field
    assert model_dir_from_gguf(text, mmproj) == rebuilt  # built once, then the cached directory


def test_the_pair_alone_generates_the_hf_directorys_tokens(qwen_pair):
    hf_dir, text, mmproj, _, _ = qwen_pair
    rgb_image = make_image(64, seed=1)
    reference, processor = load(hf_dir, **CPU)
    model, gguf_processor = load(model_dir_from_gguf(text, mmproj), gguf_path=text, mmproj_path=mmproj, **CPU)
    for question in ("What is in the picture?", "Describe it."):
        want_inputs = build_inputs(processor, [user_turn(question, 1)], [rgb_image])
        got_inputs = build_inputs(gguf_processor, [user_turn(question, 1)], [rgb_image])
        assert torch.equal(want_inputs["input_ids"], got_inputs["input_ids"])
        with torch.no_grad():
            want = generate(reference, dict(want_inputs), 6, min_new_tokens=6)
            got = generate(model, dict(got_inputs), 6, min_new_tokens=6)
        assert torch.equal(got, want)


def test_an_mmproj_without_pixel_bounds_takes_llama_cpps(qwen_pair):
    """llama.cpp's converter writes no image_min/max_pixels for a Qwen-VL tower; llama.cpp then takes 8 to 4096
    merged tokens a picture, and so does the processor rebuilt here, so both see a picture as the same tokens."""
    _, _, mmproj, _, processor = qwen_pair
    metadata = read_metadata(mmproj)
    assert metadata.get("clip.vision.image_max_pixels") is not None  # our writer keeps the processor's bounds
    for key in ("clip.vision.image_min_pixels", "clip.vision.image_max_pixels"):
        metadata.values.pop(key)
    rebuilt = adapter_for("qwen3_vl_moe").processor_from_gguf(metadata, processor.tokenizer, processor.chat_template,
                                                              "qwen3_vl_moe")
    images = rebuilt.image_processor
    token_pixels = (images.patch_size * images.merge_size) ** 2
    assert images.size == {"shortest_edge": 8 * token_pixels, "longest_edge": 4096 * token_pixels}


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory):
    """`vismmoe-kt convert --demo --out DIR` and a picture of the demo's task."""
    from vismmoe_kt.demo.pictures import make_vqa_image

    root = tmp_path_factory.mktemp("demo-pair")
    image = root / "shapes.png"
    make_vqa_image().save(image)
    out = root / "files"
    assert main(["convert", "--demo", "--out", str(out)]) == 0
    return out, image


def test_convert_demo_then_chat_from_the_two_files_gives_the_demos_answer(demo_pair, capsys):
    out, image = demo_pair
    files = sorted(p.name for p in out.iterdir())
    assert files == ["demo-4x32-BF16.gguf", "mmproj-demo-4x32-F16.gguf"]
    capsys.readouterr()
    ask = ["--image", str(image), "--prompt", "What colour is the square?", "--greedy", "--max_new_tokens", "6"]
    assert main(["chat", "--demo", *ask]) == 0
    want = capsys.readouterr().out.splitlines()[0]
    assert main(["chat", "--gguf_path", str(out / files[0]), "--mmproj_path", str(out / files[1]), *ask]) == 0
    got = capsys.readouterr().out.splitlines()[0]
    assert got == want and want.strip() == "blue"
    assert sorted(p.name for p in out.iterdir()) == files  # nothing written beside them


def test_eval_from_the_two_files_replies_as_the_demo(demo_pair, tmp_path):
    import json

    out, _ = demo_pair
    pair = ["--gguf_path", str(out / "demo-4x32-BF16.gguf"), "--mmproj_path", str(out / "mmproj-demo-4x32-F16.gguf")]
    for name, source in (("demo", ["--demo"]), ("pair", pair)):
        assert main(["eval", *source, "--limit", "4", "--output", str(tmp_path / f"{name}.json")]) == 0
    replies = {name: [item["reply"] for item in json.loads((tmp_path / f"{name}.json").read_text())["items"]]
               for name in ("demo", "pair")}
    assert replies["pair"] == replies["demo"] and len(replies["demo"]) == 4


def test_serve_from_the_two_files_answers_as_the_demo(demo_pair):
    import base64

    import httpx
    from conftest import serve_in_thread

    out, image = demo_pair
    cpu = ["--generate_device", "cpu", "--prefill_device", "cpu", "--max_new_tokens", "6"]
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()}}
    answers = []
    for source in (["--demo"], ["--gguf_path", str(out / "demo-4x32-BF16.gguf"),
                                "--mmproj_path", str(out / "mmproj-demo-4x32-F16.gguf")]):
        for url in serve_in_thread([*source, *cpu]):
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": [picture, {"type": "text", "text": "How many triangles are there?"}]}]})
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["message"]["content"])
            names = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
            assert [m["id"] for m in names] == (["vismmoe-demo"] if source == ["--demo"] else ["demo-4x32-BF16"])
    assert answers[0] == answers[1] and answers[0].strip() == "1"


@pytest.mark.parametrize("name", ["tiny-glm-4x16", "tiny-llama4-6x16", "tiny-kimi-4x16"])
def test_a_tiny_glm_llama4_or_kimi_pair_alone_is_the_hf_directorys_model(name, tmp_path):
    """GLM-4.5V (llama.cpp's glm4moe + glm4v: its end tokens eos and `<|user|>`, written as llama.cpp's eot;
    the router's correction bias read as exp_probs_b), Llama 4 (llama4 + llama4: the attention
    temperature's keys, the projector's widths from its tensors) and Kimi K2.5 (deepseek2 + kimik25: MLA's
    kv_b_proj back from attn_k_b / attn_v_b, MoonViT's q, k, v from the permuted attn_qkv): written from
    the loaded model (our experts' layout, as `convert` writes), the rebuilt config and processor, the
    same greedy tokens from an image prompt."""
    from transformers import AutoConfig

    hf_dir = save_tiny_model(tmp_path / "hf", name, seed=0)
    reference, want_processor = load(hf_dir, **CPU)
    text, mmproj = _write_pair(reference, want_processor, tmp_path)
    rebuilt = model_dir_from_gguf(text, mmproj)
    want_config = build_tiny_model(name, seed=0)[0].config.to_dict()
    assert _differences(want_config, AutoConfig.from_pretrained(rebuilt).to_dict()) == []
    alone, got_processor = load(rebuilt, gguf_path=text, mmproj_path=mmproj, **CPU)
    ends = lambda ids: [ids] if isinstance(ids, int) else ids  # noqa: E731
    # the directory's end tokens, then those llama.cpp ends on by their text (Kimi's vocabulary has its [EOS])
    also = {"tiny-kimi-4x16": [want_processor.tokenizer.convert_tokens_to_ids("[EOS]")]}.get(name, [])
    assert ends(alone.generation_config.eos_token_id) == ends(reference.generation_config.eos_token_id) + also
    image = make_image(64, seed=2)
    want_inputs = build_inputs(want_processor, [user_turn("what is this?", 1)], [image])
    got_inputs = build_inputs(got_processor, [user_turn("what is this?", 1)], [image])
    assert torch.equal(want_inputs["input_ids"], got_inputs["input_ids"])
    with torch.no_grad():
        want = generate(reference, dict(want_inputs), 6, min_new_tokens=6)
        assert torch.equal(generate(alone, dict(got_inputs), 6, min_new_tokens=6), want)


def test_convert_refuses_bad_input_clearly(tmp_path, capsys):
    assert main(["convert", "--model_path", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["convert", "--demo", "--out", str(blocker)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--demo", "--out", str(tmp_path / "o"), "--qtype", "Q3_XS"])
    assert exit_info.value.code == 2 and "invalid choice: 'Q3_XS'" in capsys.readouterr().err
    assert main(["convert", "--out", str(tmp_path / "o")]) == 2
    assert "no model" in capsys.readouterr().err


def test_what_a_pair_cannot_give_is_a_clear_error(qwen_pair, tmp_path):
    _, text, mmproj, model, processor = qwen_pair
    with pytest.raises(LoadError, match="needs its vision tower's file too"):
        model_dir_from_gguf(text, None)
    (tmp_path / "novocab").mkdir()
    bare, bare_mmproj = _write_pair(model, processor, tmp_path / "novocab", with_vocab=False)
    with pytest.raises(LoadError, match=re.escape("tokenizer.ggml.model = 'no_vocab'")):
        model_dir_from_gguf(bare, bare_mmproj)
    assert read_metadata(text).get("tokenizer.ggml.merges") == []  # a byte vocabulary: the key, empty


# what llama.cpp (or this project) lacks for each family whose pair cannot be its model
GAPS = {"tiny-ernie-4x16": ("ernie4_5_vl_moe", "llama.cpp has no mmproj projector for ERNIE-4.5-VL"),
        "tiny-dsocr2-4x16": ("deepseek_ocr2", "no mmproj projector for DeepSeek-OCR-2: its one DeepSeek-OCR "
                                              "projector, deepseekocr")}


@pytest.mark.parametrize("name", sorted(GAPS))
def test_a_family_llama_cpp_cannot_hold_is_named_by_convert_and_chat(name, tmp_path, capsys):
    """ERNIE-4.5-VL (no projector in llama.cpp), DeepSeek-OCR-2 (no projector for its tower): `convert`
    refuses before writing anything, and `chat` on a
    pair written with the family's architecture says what is lacking, naming the llama.cpp checked, as an
    error line, not a traceback."""
    from vismmoe_kt.models.llama_cpp_keys import LLAMA_CPP_CHECKED

    model_type, lacking = GAPS[name]
    hf_dir = save_tiny_model(tmp_path / "hf", name, seed=0)
    assert main(["convert", "--model_path", str(hf_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"family {model_type}: llama.cpp has" in err and lacking in err and LLAMA_CPP_CHECKED in err
    assert "--model_path DIR" in err
    assert not (tmp_path / "o").exists()
    model, processor = build_tiny_model(name, seed=0)
    (tmp_path / "pair").mkdir()
    with pytest.warns(UserWarning):  # the writer says what the files lack (no tensor names, or no projector)
        text, mmproj = _write_pair(model, processor, tmp_path / "pair")
    assert main(["chat", "--gguf_path", str(text), "--mmproj_path", str(mmproj), "--prompt", "hi",
                 "--max_new_tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert f"stands for {model_type} here; llama.cpp has" in err and lacking in err and LLAMA_CPP_CHECKED in err


def test_the_cli_names_a_missing_mmproj_and_an_unknown_architecture(qwen_pair, tmp_path, capsys):
    _, text, mmproj, _, _ = qwen_pair
    assert main(["chat", "--gguf_path", str(text), "--prompt", "hi", "--max_new_tokens", "1"]) == 2
    assert "--mmproj_path FILE" in capsys.readouterr().err
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), arch="mamba")
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_ti_data_to_file(), writer.close()
    shutil.copy(mmproj, tmp_path / "mm.gguf")
    assert main(["chat", "--gguf_path", str(other), "--mmproj_path", str(tmp_path / "mm.gguf"), "--prompt", "hi"]) == 2
    assert "general.architecture = 'mamba' is none of the families" in capsys.readouterr().err


def test_a_split_model_file_is_read_from_its_first_part(qwen_pair, tmp_path):
    """llama.cpp's split (X-00001-of-0000N.gguf: the keys in the first part, tensors spread over all): the
    same rebuilt config and the same logits as the single file."""
    from vismmoe_kt.demo.gguf_export import _writer_class

    hf_dir, text, mmproj, _, _ = qwen_pair
    source = gguf.GGUFReader(str(text))
    writer = _writer_class()(str(tmp_path / "split.gguf"), arch="qwen3vlmoe", split_max_tensors=20)
    for key, field in source.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, tensor.data.copy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) > 1
    from transformers import AutoConfig

    whole, split = model_dir_from_gguf(text, mmproj), model_dir_from_gguf(parts[0], mmproj)
    assert _differences(AutoConfig.from_pretrained(whole).to_dict(), AutoConfig.from_pretrained(split).to_dict()) == []
    inputs = {"input_ids": torch.tensor([[1, 2, 3, 260, 7]])}
    a, _ = load(whole, gguf_path=text, mmproj_path=mmproj, **CPU)
    b, _ = load(split, gguf_path=parts[0], mmproj_path=mmproj, **CPU)
    with torch.no_grad():
        assert torch.equal(a(**inputs).logits, b(**inputs).logits)


def test_tied_embeddings_are_written_once_and_rebuilt_tied(tmp_path):
    from dataclasses import replace

    from transformers import AutoConfig

    from vismmoe_kt.demo.tiny import SPECS

    model, processor = build_tiny_model(replace(SPECS["tiny-4x16"], tie_embeddings=True), seed=0)
    text, mmproj = _write_pair(model, processor, tmp_path)
    assert "output.weight" not in read_metadata(text).shapes and "token_embd.weight" in read_metadata(text).shapes
    rebuilt = AutoConfig.from_pretrained(model_dir_from_gguf(text, mmproj))
    assert rebuilt.tie_word_embeddings and _differences(model.config.to_dict(), rebuilt.to_dict()) == []


def test_a_tokenizer_the_vocabulary_keys_cannot_name_is_refused():
    """Only Qwen2's byte-level split is written as `tokenizer.ggml.pre = qwen2`: another pre-tokenizer
    (here GPT-2's plain byte level) would tokenize differently in llama.cpp, so the writer says so."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vismmoe_kt.demo.gguf_vocab import vocabulary_keys

    backend = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    with pytest.raises(ValueError, match="not Qwen2's byte-level split"):
        vocabulary_keys(PreTrainedTokenizerFast(tokenizer_object=backend), 3, None)


def test_a_pair_alone_ends_where_llama_cpp_ends():
    """The eos, eot and eom keys; llama.cpp's end texts in the vocabulary; each fill-in-the-middle pad,
    repository and separator token from its key where the file has one, else from its text."""
    from vismmoe_kt.core.gguf_model import end_token_ids

    class Vocab:
        def get_vocab(self):
            return {"a": 0, "<|im_end|>": 1, "[EOS]": 2, "<|fim_pad|>": 3, "<|repo_name|>": 4, "<|file_sep|>": 5,
                    "<|user|>": 6, "<|fim_prefix|>": 7}

    keys = {"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 6}  # read as GgufMetadata.get
    assert end_token_ids(keys, Vocab()) == [1, 6, 2, 3, 4, 5]  # a FIM prefix does not end
    keyed = keys | {"tokenizer.ggml.fim_pad_token_id": 0}      # the key wins over the text
    assert end_token_ids(keyed, Vocab()) == [1, 6, 2, 0, 4, 5]
