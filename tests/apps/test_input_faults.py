"""Input an operator's fault run found answered wrongly: deep images turned white, images the processor
refuses ending the CLI or the chat, message fields of the wrong type as 500s, `"n": true` taken for 1,
a temperature of 1e-38 as a 500 on one engine, and an empty rule file taken for no rules. Each gets its
clear answer: the image as it looks, `error: ...` and exit 2 (or another chance in the chat), a 400
naming the field, the greedy answer from either engine."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from conftest import serve_in_thread
from test_cli_errors import chat, fails_with, fake_input, prompt_counts
from test_server_faults import chat_body, demo, post, served  # noqa: F401
from vismmoe_kt.apps.cli import main
from vismmoe_kt.apps.images import MAX_ASPECT_RATIO, load_image, to_rgb
from vismmoe_kt.apps.serve.inputs import ImageRef, Limits, decode_image

MID_GREY_16 = 32768  # of 65535: 128 of 255


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def grey_16bit() -> Image.Image:
    """A 16-bit greyscale image (PIL mode I;16) whose mean is mid-grey, with a gradient so that it is not flat."""
    ramp = np.linspace(MID_GREY_16 - 8000, MID_GREY_16 + 8000, 40 * 30).reshape(30, 40)
    return Image.fromarray(ramp.astype(np.uint16))


# -- 1. every PIL mode to RGB that looks like the image -------------------------------------------------

def test_a_16bit_png_keeps_its_mean_in_the_cli_and_the_server(tmp_path):
    path = tmp_path / "grey16.png"
    path.write_bytes(png_bytes(grey_16bit()))
    assert Image.open(path).mode == "I;16" and np.asarray(Image.open(path).convert("RGB")).mean() == 255  # the fault
    cli = np.asarray(load_image(path), dtype=np.float64)
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    server = np.asarray(decode_image(ImageRef(url, "messages[0].content[0]"), Limits()), dtype=np.float64)
    for rgb in (cli, server):
        assert rgb.shape == (30, 40, 3)
        assert abs(rgb.mean() - 128) < 2
        assert rgb[0, 0, 0] < rgb[-1, -1, 0]  # the gradient is still there


@pytest.mark.parametrize("make,expected", [
    (lambda: Image.fromarray(np.full((8, 8), MID_GREY_16, np.uint16)).convert("I"), 128),
    (lambda: Image.fromarray(np.full((8, 8), 0.5, np.float32)), 128),  # floats in [0, 1]
    (lambda: Image.fromarray(np.full((8, 8), 100.0, np.float32)), 100),  # floats in 8-bit range
    (lambda: Image.new("LA", (8, 8), (0, 0)), 255),  # fully transparent black: the white background
    (lambda: Image.new("LA", (8, 8), (0, 255)), 0),  # opaque black stays black
    (lambda: Image.new("RGBA", (8, 8), (200, 0, 0, 0)), 255),
    (lambda: Image.new("L", (8, 8), 77), 77),
    (lambda: Image.new("1", (8, 8), 1), 255),
])
def test_every_mode_is_normalised_before_rgb(make, expected):
    rgb = to_rgb(make())
    assert rgb.mode == "RGB"
    assert abs(np.asarray(rgb, dtype=np.float64).mean() - expected) < 1.5


def test_a_palette_image_with_transparency_is_composited():
    image = Image.new("P", (8, 8), 0)
    image.putpalette([0, 0, 0] * 256)
    image.info["transparency"] = 0  # index 0 transparent: no black shows
    assert np.asarray(to_rgb(Image.open(io.BytesIO(png_bytes(image))))).min() == 255


def test_cmyk_converts():
    rgb = to_rgb(Image.new("CMYK", (8, 8), (0, 0, 0, 0)))
    assert np.asarray(rgb).min() == 255


# -- 2. the processor's refusals, checked where the image is read ---------------------------------------

@pytest.fixture
def tall(tmp_path):
    path = tmp_path / "tall.png"
    path.write_bytes(png_bytes(Image.new("L", (1, 100_000), 128)))
    return path


def test_a_tall_image_is_an_error_exit_2_in_the_cli(tall, capsys):
    fails_with(capsys, chat("--image", tall, "--prompt", "what is it?"),
               rf"image .*tall\.png: 1x100000 pixels: its aspect ratio 100000:1 is over the {MAX_ASPECT_RATIO}:1")


def test_a_tall_image_attached_in_the_chat_is_refused_and_the_chat_goes_on(tall, monkeypatch, capsys):
    fake_input(monkeypatch, ["first question", f"/image {tall}", str(tall), "second question"])
    assert main(chat()) == 0
    captured = capsys.readouterr()
    assert captured.err.count("aspect ratio 100000:1") == 2 and "attached " + str(tall) not in captured.err
    assert "Traceback" not in captured.err
    counts = prompt_counts(captured.out)
    assert len(counts) == 2 and counts[1] > counts[0]  # both answered, the second with the first in its history


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "image_url"), ("/api/chat", "images")])
def test_a_tall_image_is_a_400_from_the_server(served, path, field):
    _, url, _, _ = served
    raw = base64.b64encode(png_bytes(Image.new("L", (1, 100_000), 128))).decode()
    if field == "image_url":
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + raw}},
                   {"type": "text", "text": "what is it?"}]
        body = {"messages": [{"role": "user", "content": content}]}
    else:
        body = {"messages": [{"role": "user", "content": "what is it?", "images": [raw]}], "stream": False}
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert "1x100000 pixels: its aspect ratio 100000:1 is over the 200:1" in r.text
    assert post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2)).status_code == 200


# -- 3. the types of message fields and of integers; tiny temperatures ---------------------------------

@pytest.mark.parametrize("role", [["user"], {"name": "user"}, 5, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_role_of_the_wrong_type_is_a_400_naming_the_field(served, path, role):
    _, url, _, _ = served
    r = post(url, path, {"messages": [{"role": role, "content": "hi"}], "stream": False})
    assert r.status_code == 400, r.text
    assert "'messages[0].role' must be a string" in r.text


@pytest.mark.parametrize("path,message,field", [
    ("/v1/chat/completions", {"role": "user", "content": 5}, "messages[0].content"),
    ("/v1/chat/completions", {"role": "user", "content": "hi", "name": ["x"]}, "messages[0].name"),
    ("/api/chat", {"role": "user", "content": {"text": "hi"}}, "messages[0].content"),
    ("/api/chat", {"role": "user", "content": "hi", "images": "abc"}, "messages[0].images"),
])
def test_other_message_fields_of_the_wrong_type_are_400s(served, path, message, field):
    _, url, _, _ = served
    r = post(url, path, {"messages": [message], "stream": False})
    assert r.status_code == 400 and f"'{field}' must be" in r.text, r.text


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"n": True}, "n"),
    ("/v1/chat/completions", {"n": 1.5}, "n"),
    ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
    ("/api/chat", {"options": {"num_predict": True}}, "options.num_predict"),
    ("/api/chat", {"options": {"seed": True}}, "options.seed"),
    ("/api/chat", {"options": {"top_k": "40"}}, "options.top_k"),
])
def test_a_boolean_or_fraction_where_an_integer_is_required_is_a_400(served, path, body, field):
    _, url, _, _ = served
    r = post(url, path, {"messages": [{"role": "user", "content": "hi"}], "stream": False, **body})
    assert r.status_code == 400 and f"'{field}' must be a whole number" in r.text, r.text


def test_n_of_one_and_ignored_ollama_options_of_their_type_are_accepted(served):
    _, url, _, _ = served
    assert post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2, n=1)).status_code == 200
    r = post(url, "/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                                "options": {"seed": 7, "top_k": 40, "num_ctx": 2048, "num_predict": 2}})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def serial():
    yield from serve_in_thread(["--demo", "--generate_device", "cpu", "--prefill_device", "cpu", "--max_new_tokens", "6"])


@pytest.fixture(scope="module")
def batched():
    yield from serve_in_thread(["--demo", "--optimize_config_path", "optimize_rules/qwen3vl-offload.yaml",
                                "--generate_device", "cpu", "--prefill_device", "cpu", "--max_new_tokens", "6",
                                "--max_batch", "2", "--slot_tokens", "512"])


def answer(url: str, temperature: float) -> str:
    r = post(url, "/v1/chat/completions", chat_body("What shape is in the picture?", max_tokens=6,
                                                    temperature=temperature))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-6])
def test_a_temperature_below_the_threshold_is_greedy_on_both_engines(serial, batched, temperature):
    greedy = answer(serial, 0)
    assert answer(serial, temperature) == greedy
    assert answer(batched, temperature) == answer(batched, 0) == greedy  # the same model on the lean path


# -- 4. an empty rule file --------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "# only a comment\n", "[]\n"])
@pytest.mark.parametrize("command", ["chat", "serve"])
def test_an_empty_rule_file_is_an_error_exit_2(tmp_path, capsys, text, command):
    rules = tmp_path / "empty.yaml"
    rules.write_text(text)
    args = chat("--optimize_config_path", rules, "--prompt", "x") if command == "chat" else \
        ["serve", "--demo", "--optimize_config_path", str(rules), "--generate_device", "cpu", "--prefill_device", "cpu"]
    fails_with(capsys, args, rf"rule file {rules} has no rules \(it is empty\)")
