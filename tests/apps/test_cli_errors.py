"""Bad input found by a fault run against the CLI: each gives `error: ...` and exit 2, or a clear message and
another chance in interactive chat, never a traceback from deep inside torch, yaml or PIL."""

import io
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.engine.chat import ChatSession
from vismmoe_kt.apps.chat_input import read_entry
from vismmoe_kt.apps.cli import main
from vismmoe_kt.errors import InputError
from vismmoe_kt.demo.tiny import DEMO_SPEC, FORMAT_VERSION, demo_model_dir, demo_weights_digest

CONTEXT = 4096  # the demo model's max_position_embeddings
BINARY = b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x80 not text"


def chat(*args):
    return ["chat", "--demo", "--greedy", "--max_new_tokens", "2", *map(str, args)]


def fails_with(capsys, args, message):
    """main() returns 2 and prints `error: ...` matching `message`, no traceback."""
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(r"error: " + message, err), err
    assert "Traceback" not in err


def usage_error(capsys, args, message):
    """argparse refuses the flag: SystemExit(2) and `error: argument ...` before any model is looked for."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert re.search(r"error: " + message, err), err
    assert "Traceback" not in err


def fake_input(monkeypatch, lines):
    it = iter(lines)

    def ask(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", ask)


def prompt_counts(out):
    return [int(n) for n in re.findall(r"prompt eval count: +(\d+)", out)]


# 1. --prompt_file that is not UTF-8
def test_prompt_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "prompt.bin"
    path.write_bytes(BINARY)
    fails_with(capsys, chat("--prompt_file", path), re.escape(f"--prompt_file {path}: not UTF-8 text"))


# 2. interactive: the path of a binary file (an image's name, not an image; or no image's name at all)
def test_typed_path_of_a_binary_file_asks_again(tmp_path, capsys):
    photo, blob = tmp_path / "photo.png", tmp_path / "blob.bin"
    photo.write_bytes(BINARY)
    blob.write_bytes(BINARY)
    ask = iter([str(photo), str(blob), "the next line"])
    assert read_entry(lambda prompt="": next(ask)) == "the next line"
    err = capsys.readouterr().err
    assert re.search(rf"error: image {re.escape(str(photo))}: not a readable image", err)
    assert re.search(rf"error: {re.escape(str(blob))} is neither an image nor a UTF-8 text file", err)


def test_binary_path_in_interactive_chat_keeps_the_conversation(tmp_path, monkeypatch, capsys):
    path = tmp_path / "photo.png"
    path.write_bytes(BINARY)
    fake_input(monkeypatch, ["first question", str(path), "second question"])
    assert main(chat()) == 0
    captured = capsys.readouterr()
    assert "not a readable image" in captured.err and "Traceback" not in captured.err
    counts = prompt_counts(captured.out)
    assert len(counts) == 2 and counts[1] > counts[0]  # the second turn carries the first


# 3. --set with a value that is not YAML
def test_set_value_that_is_not_yaml(capsys):
    fails_with(capsys, chat("--set", "expert_budget=[", "--prompt", "x"),
               re.escape("--set expert_budget=[: the value is not valid YAML"))


def test_set_value_with_a_billion_laughs(capsys):
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]
    fails_with(capsys, chat("--set", "expert_budget={" + ", ".join(levels) + "}", "--prompt", "x"),
               r"--set expert_budget: the YAML has over 100,000 values once its aliases")


# 4. sampling flags (chat and serve); no model is named, so only the flag check can give these errors
@pytest.mark.parametrize("command", ["chat", "serve"])
@pytest.mark.parametrize("flag,value,message", [
    ("--temperature", "nan", "must be a finite number >= 0, got nan"),
    ("--temperature", "-1", "must be a finite number >= 0, got -1"),
    ("--temperature", "inf", "must be a finite number >= 0, got inf"),
    ("--top_p", "5", r"must be in \(0, 1\], got 5"),
    ("--top_p", "0", r"must be in \(0, 1\], got 0"),
    ("--top_p", "nan", r"must be in \(0, 1\], got nan"),
])
def test_sampling_flags_out_of_range(command, flag, value, message, capsys):
    usage_error(capsys, [command, flag, value], f"argument {flag}: {message}")


def test_serve_max_new_tokens_below_one(capsys):
    fails_with(capsys, ["serve", "--max_new_tokens", "0"], "--max_new_tokens must be at least 1, got 0")


# 5. devices
@pytest.mark.parametrize("args,message", [
    (["--generate_device", "banana"], "--generate_device: 'banana' is not a device"),
    (["--prefill_device", "banana"], "--prefill_device: 'banana' is not a device"),
    (["--set", "generate_device=banana"], "--set generate_device: 'banana' is not a device"),
    (["--set", "prefill_device=[cuda]"], r"--set prefill_device: \['cuda'\] is not a device"),
])
def test_device_that_is_not_a_device(args, message, capsys):
    fails_with(capsys, chat(*args, "--prompt", "x"), message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_named_cuda_device_without_cuda_is_not_replaced_by_cpu(capsys):
    """Without CUDA, rule files' cuda:0 run on the CPU; a device the user named must not be overwritten."""
    fails_with(capsys, chat("--set", "generate_device=cuda:7", "--prompt", "x"),
               "--set generate_device: cuda:7 is not available: this machine has no CUDA device")
    fails_with(capsys, chat("--prefill_device", "cuda", "--prompt", "x"),
               "--prefill_device: cuda is not available: this machine has no CUDA device")


def test_cuda_index_beyond_the_device_count(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fails_with(capsys, chat("--generate_device", "cuda:7", "--prompt", "x"),
               "--generate_device: cuda:7 is not available: this machine has 1 CUDA device$")


# 6. serve flags
@pytest.mark.parametrize("flag,value,message", [
    ("--port", "70000", "must be a port number, 0..65535, got 70000"),
    ("--port", "-1", "must be a port number, 0..65535, got -1"),
    ("--max_image_mb", "-1", "must be a number > 0, got -1"),
    ("--max_image_mb", "0", "must be a number > 0, got 0"),
    ("--max_queue", "-1", "must be at least 0, got -1"),
    ("--limit_mm_per_prompt", "-2", "must be at least 0, got -2"),
    ("--ep_timeout", "-5", "must be a number > 0, got -5"),  # torch's process group took it (and waited 0 s)
    ("--header_timeout", "0", "must be a number > 0, got 0"),
    ("--body_timeout", "-1", "must be a number > 0, got -1"),
    ("--shutdown_timeout", "nan", "must be a number > 0, got nan"),
])
def test_serve_flags_out_of_range(flag, value, message, capsys):
    usage_error(capsys, ["serve", flag, value], f"argument {flag}: {message}")


# 7. a rule file of binary junk (rule classes that are not operators: tests/core/test_inject_errors.py)
def test_rule_file_of_binary_junk(tmp_path, capsys):
    junk = tmp_path / "rules.yaml"
    junk.write_bytes(BINARY * 20)
    fails_with(capsys, chat("--optimize_config_path", junk, "--prompt", "x"),
               re.escape(f"cannot read rule file {junk}: not UTF-8 text"))


def test_rule_class_that_is_not_an_operator(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: {name: '^lm_head$'}\n  replace: {class: torch.nn.Identity}\n")
    fails_with(capsys, chat("--optimize_config_path", rules, "--prompt", "x"),
               r".*rules\.yaml, rule 0: replace\.class 'torch\.nn\.Identity' is not an injectable operator")


# 10. prompts over the model's context
def test_prompt_over_the_context_fails_before_generating(tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_text("a " * 3000)  # byte-level tokens: 6000 of them
    rc = main(chat("--prompt_file", path))
    captured = capsys.readouterr()
    assert rc == 2
    assert re.search(rf"error: the prompt is \d+ tokens, over this model's context of {CONTEXT}", captured.err)
    assert "Traceback" not in captured.err and "prompt eval count" not in captured.out


def test_interactive_turn_over_the_context_is_dropped(monkeypatch, capsys):
    fake_input(monkeypatch, ["first question", "a " * 3000, "second question"])
    assert main(chat()) == 0
    captured = capsys.readouterr()
    assert f"over this model's context of {CONTEXT}" in captured.err
    counts = prompt_counts(captured.out)
    assert len(counts) == 2
    assert counts[0] < counts[1] < 200  # the second turn has the first one, not the dropped one


@pytest.fixture(scope="module")
def demo():
    return load(demo_model_dir(), None, generate_device="cpu", prefill_device="cpu", progress=False)


def test_session_is_unchanged_by_a_turn_over_the_context(demo):
    session = ChatSession(*demo, max_new_tokens=2, greedy=True)
    session.ask("hello", out=io.StringIO())
    before = [dict(m) for m in session.messages]
    with pytest.raises(InputError, match=f"over this model's context of {CONTEXT}"):
        session.ask("a " * 3000, out=io.StringIO())
    assert session.messages == before and session.images == []


# 11. staging directories of killed demo model builds
def test_demo_assembly_removes_stale_staging_but_not_a_live_one(tmp_path, monkeypatch):
    monkeypatch.setenv("VISMMOE_KT_CACHE", str(tmp_path))
    models = tmp_path / "models"
    name = f"{DEMO_SPEC}-{demo_weights_digest()}-v{FORMAT_VERSION}"
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=60)  # exited and reaped: its pid belongs to no process now
    host = socket.gethostname()
    stale = models / f"{name}.staging-{host}-{finished.pid}-x1y2"  # a build on this host that was killed
    old_stale = models / f"{name}.staging-{finished.pid}-q9r8"  # the same, named before hosts were recorded
    live = models / f"{name}.staging-{host}-{os.getpid()}-a1b2"  # another build under way (here: this process)
    elsewhere = models / f"{name}.staging-another-host.lan-{finished.pid}-c3d4"  # another host's: its pids aren't ours
    for path in (stale, old_stale, live, elsewhere):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    target = demo_model_dir()
    assert (target / ".complete").exists()
    assert not stale.exists() and not old_stale.exists()
    assert live.exists() and elsewhere.exists()
    # (and the builders' lock file)
    assert sorted(p.name for p in models.iterdir()) == sorted([target.name, live.name, elsewhere.name,
                                                               f"{target.name}.lock"])
