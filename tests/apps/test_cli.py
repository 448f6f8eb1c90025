"""`vismmoe-kt chat`: end to end on the demo model, interactive habits, and clear errors for bad input."""

import os
import re
import struct
import subprocess
import sys
import zlib

import pytest

from vismmoe_kt.apps.chat_input import read_entry
from vismmoe_kt.apps.cli import main
from vismmoe_kt.demo.tiny import DEMO_SPEC, SPECS

TIMING_LINES = ("prompt eval count:", "prompt eval duration:", "prompt eval rate:", "eval count:", "eval duration:", "eval rate:")


def chat(*args):
    return ["chat", "--demo", "--greedy", "--max_new_tokens", "6", *map(str, args)]


def png_header_only(path, width, height):
    """A PNG whose header claims width x height pixels (no pixel data): size checks must not decode it."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
    return path


@pytest.mark.slow
def test_demo_end_to_end_in_a_subprocess(image_file):
    """The installed command prints a reply, Ollama-style timings and stats, and exits 0."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "vismmoe-kt"), "chat", "--demo", "--image", str(image_file),
           "--prompt", "Describe the image.", "--max_new_tokens", "16", "--stats"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for label in TIMING_LINES:
        assert label in out
    reply = out[: out.index("prompt eval count:")]
    assert reply.strip(), "no reply text before the timings"
    generated = int(re.search(r"^eval count: +(\d+) token", out, re.M).group(1))
    assert 1 <= generated <= 16
    prompt_tokens = int(re.search(r"prompt eval count: +(\d+) token", out).group(1))
    assert prompt_tokens > 16  # the image's tokens are part of the prompt
    assert "runtime stats:" in out and "operators: none" in out


def test_rule_file_with_cpu_overrides_runs_and_reports_operators(image_file, capsys):
    rc = main(chat("--image", image_file, "--prompt", "What is this?", "--stats",
                   "--optimize_config_path", "optimize_rules/qwen3vl.yaml", "--generate_device", "cpu", "--prefill_device", "cpu"))
    out = capsys.readouterr().out
    assert rc == 0
    stats = re.search(r"VisExperts x(\d+):\s+policy=vismmoe, pinned_layers=(\d+)", out)
    layers = SPECS[DEMO_SPEC].layers
    assert stats and int(stats.group(1)) == layers and int(stats.group(2)) == layers  # the 16GiB budget pins them all


def test_every_rule_file_works_on_cpu(capsys, tmp_path):
    """Each family's rule files on a model of that family: the demo model (Qwen3-VL-MoE), a tiny GLM-4.5V,
    a tiny DeepSeek-OCR-2, a tiny Kimi K2.5, a tiny ERNIE-4.5-VL, a tiny Llama 4."""
    from vismmoe_kt.demo.tiny import save_tiny_model

    families = {prefix: save_tiny_model(tmp_path / spec, spec, seed=0) for prefix, spec in
                (("glm4v", "tiny-glm-4x16"), ("deepseek-ocr2", "tiny-dsocr2-4x16"), ("kimi-k25", "tiny-kimi-4x16"),
                 ("ernie45vl", "tiny-ernie-4x16"), ("llama4", "tiny-llama4-6x16"))}
    for rules in sorted(os.listdir("optimize_rules")):
        if rules.endswith("-ep.yaml"):  # needs a process group: tests/parallel and tests/models run them under gloo
            continue
        family = next((path for prefix, path in families.items() if rules.startswith(prefix)), None)
        model = ["--model_path", str(family)] if family is not None else ["--demo"]
        rc = main(["chat", *model, "--greedy", "--prompt", "hi", "--max_new_tokens", "2", "--optimize_config_path",
                   f"optimize_rules/{rules}", "--generate_device", "cpu", "--prefill_device", "cpu"])
        out = capsys.readouterr().out
        assert rc == 0, rules
        assert "eval count:" in out


def test_prompt_file(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Tell me about this.")
    assert main(chat("--prompt_file", prompt)) == 0
    assert "prompt eval count:" in capsys.readouterr().out


def test_interactive_session_keeps_history(monkeypatch, image_file, capsys):
    answers = iter(["first question", "", "second question"])

    def fake_input(prompt=""):
        try:
            return next(answers)
        except StopIteration:
            raise EOFError
    monkeypatch.setattr("builtins.input", fake_input)
    assert main(chat("--image", image_file)) == 0
    out = capsys.readouterr().out
    counts = [int(n) for n in re.findall(r"prompt eval count: +(\d+)", out)]
    assert len(counts) == 2  # the empty line is skipped
    assert counts[1] > counts[0]  # the second prompt carries the first turn and its answer


def scripted(lines):
    it = iter(lines)

    def ask(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError
    return ask


def test_triple_quotes_open_and_close_multi_line_input():
    assert read_entry(scripted(['"""first line', "second line", 'third"""'])) == "first line\nsecond line\nthird"
    assert read_entry(scripted(['"""one line"""'])) == "one line"


def test_a_path_to_an_existing_file_reads_the_prompt(tmp_path):
    path = tmp_path / "question.txt"
    path.write_text("from a file")
    assert read_entry(scripted([str(path)])) == "from a file"
    assert read_entry(scripted(["just text"])) == "just text"
    assert read_entry(scripted([])) is None


@pytest.mark.parametrize("case,message", [
    ("missing_image", r"image .*nope\.png: no such file"),
    ("corrupt_image", r"image .*corrupt\.png: not a readable image \(corrupt or unsupported format\)"),
    ("truncated_image", r"image .*truncated\.png: corrupt or truncated image data"),
    ("oversized_image", r"image .*huge\.png: 9000x9000 pixels is over the 64,000,000-pixel limit"),
    ("bomb_image", r"image .*bomb\.png: too many pixels"),
    ("missing_model", r"model path /no/such/model does not exist"),
    ("no_model", r"no model: pass --model_path DIR .* or --demo"),
    ("bad_rules", r"rules\.yaml: not valid YAML"),
    ("missing_rules", r"--optimize_config_path /no/rules\.yaml: no such rule file"),
    ("bad_set", r"--set 'weights_device': expected key=value"),
    ("unknown_set", r"override 'colour' is not a kwarg of any rule"),
    ("set_without_rules", r"--set expert_budget: no rules to set it in .* --optimize_config_path"),
    ("bad_max_tokens", r"--max_new_tokens must be at least 1"),
    ("two_prompts", r"give either --prompt or --prompt_file, not both"),
    ("two_models", r"give either --demo or --model_path, not both"),
])
def test_bad_input_gives_a_clear_error_and_nonzero_exit(case, message, tmp_path, image_file, capsys):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(os.urandom(2000))
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(image_file.read_bytes()[:200])
    bad_rules = tmp_path / "rules.yaml"
    bad_rules.write_text("- match: {name: [oops\n")
    args = {
        "missing_image": chat("--image", tmp_path / "nope.png", "--prompt", "x"),
        "corrupt_image": chat("--image", corrupt, "--prompt", "x"),
        "truncated_image": chat("--image", truncated, "--prompt", "x"),
        "oversized_image": chat("--image", png_header_only(tmp_path / "huge.png", 9000, 9000), "--prompt", "x"),
        "bomb_image": chat("--image", png_header_only(tmp_path / "bomb.png", 30000, 30000), "--prompt", "x"),
        "missing_model": ["chat", "--model_path", "/no/such/model", "--prompt", "x"],
        "no_model": ["chat", "--prompt", "x"],
        "bad_rules": chat("--optimize_config_path", bad_rules, "--prompt", "x"),
        "missing_rules": chat("--optimize_config_path", "/no/rules.yaml", "--prompt", "x"),
        "bad_set": chat("--set", "weights_device", "--prompt", "x"),
        "unknown_set": chat("--optimize_config_path", "optimize_rules/qwen3vl.yaml", "--set", "colour=red", "--prompt", "x"),
        "set_without_rules": chat("--set", "expert_budget=7MiB", "--prompt", "x"),
        "bad_max_tokens": chat("--prompt", "x", "--max_new_tokens", "0"),
        "two_prompts": chat("--prompt", "x", "--prompt_file", bad_rules),
        "two_models": chat("--model_path", tmp_path, "--prompt", "x"),
    }[case]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.slow
def test_installed_command_exits_nonzero_on_bad_input(tmp_path):
    cmd = [os.path.join(os.path.dirname(sys.executable), "vismmoe-kt"), "chat", "--model_path", str(tmp_path / "none")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("error: model path") and "Traceback" not in result.stderr



@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the fallback on machines without CUDA")
def test_rule_files_run_on_the_cpu_without_device_flags(capsys):
    """`vismmoe-kt chat --optimize_config_path optimize_rules/qwen3vl-kt-cpu.yaml --demo` on a CPU-only machine."""
    assert main(["chat", "--demo", "--optimize_config_path", "optimize_rules/qwen3vl-kt-cpu.yaml", "--prompt", "hi",
                 "--max_new_tokens", "3", "--stats"]) == 0
    captured = capsys.readouterr()
    assert "no CUDA device: running every module on the CPU" in captured.err
    assert f"CpuExperts x{SPECS[DEMO_SPEC].layers}" in captured.out and "eval count:" in captured.out
