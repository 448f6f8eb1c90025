"""The README's quick start runs as written: its commands, copied from the file, in a fresh folder.

`make demo` itself is CI's business (`.ci/run` runs it after the tests; test_make_demo.py runs its
commands); here every other line of the quick start runs with this interpreter's environment in place
of `.venv/bin/` (the interactive chat with typed lines: a picture's path, a question, /bye), and the server
block runs whole through bash (on a free port), curl included. Every command the README and docs/ show
names flags the parser knows, modules and scripts that exist, rule files that exist.
"""

import importlib.util
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench import build_parser as bench_parser
from vismmoe_kt.apps.cli import build_parser
from vismmoe_kt.demo.pictures import DEMO_QUESTIONS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
BIN = os.path.dirname(sys.executable) + "/"
TYPED_QUESTION = "How many triangles are there?"


def quick_start_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):text.index("\n## ", text.index("## Quick start") + 1)]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def localised(block: str) -> str:
    return block.replace(".venv/bin/", BIN)


def test_the_quick_start_is_where_the_readme_begins():
    text = README.read_text(encoding="utf-8")
    first = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
    assert text.index("## Quick start") < text.index("## Usage") and len(text) < 12_000


def makefile_question() -> str:
    return re.search(r"^QUESTION \?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).strip()


def test_the_quick_start_says_what_make_demo_answers():
    commands, _ = quick_start_blocks()
    claimed = re.search(r'^make demo .*answers "(\w+)"', commands, re.M).group(1)
    assert claimed == DEMO_QUESTIONS[makefile_question()]


@pytest.mark.slow
def test_the_quick_start_commands_run_as_written(tmp_path):
    commands, server = quick_start_blocks()
    for line in commands.strip().splitlines():
        command = line.split("  #")[0].strip()
        if command.startswith("make "):
            continue  # the venv this test runs in is what `make demo` builds
        words = shlex.split(command)
        typed = "" if "--prompt" in words else f"shapes.png\n{TYPED_QUESTION}\n/bye\n"  # as its comment says
        result = subprocess.run(localised(command), shell=True, cwd=tmp_path, capture_output=True, text=True,
                                input=typed, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
        if "chat" in words:
            question = words[words.index("--prompt") + 1] if "--prompt" in words else TYPED_QUESTION
            answer = re.sub(r"^(Chat: )+", "", result.stdout.strip().splitlines()[0])
            assert answer == DEMO_QUESTIONS[question], f"{command}: {result.stdout[:500]}"
            if typed:
                assert "attached shapes.png" in result.stderr
    assert (tmp_path / "shapes.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None, reason="needs curl and base64")
def test_the_quick_start_server_block_runs_as_written(tmp_path):
    commands, server = quick_start_blocks()
    picture = next(line for line in commands.splitlines() if "demo.pictures" in line).split("  #")[0]
    subprocess.run(localised(picture), shell=True, cwd=tmp_path, check=True, timeout=120)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = localised(server).replace("10002", port)
    result = subprocess.run(["bash", "-c", "set -e\n" + script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert '"choices"' in result.stdout and '"assistant"' in result.stdout, result.stdout[-2000:]


def shown_commands(path: Path) -> list[str]:
    """Every command line of a file's ```sh blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.split(r"\s+#", line)[0].strip().rstrip("&").strip()
            if command:
                lines.append(command)
    return lines


def test_every_command_the_docs_show_exists():
    """`vismmoe-kt ...` and `python -m benchmarks.bench ...` lines parse (flags and subcommands exist);
    modules, scripts and rule files exist."""
    parser, bench, checked = build_parser(), bench_parser(), 0
    for path in DOCS:
        for command in shown_commands(path):
            words = [w for w in shlex.split(command) if w != "..."]  # "..." stands for more flags
            for word in words:
                if re.fullmatch(r"(optimize_rules|scripts)/[\w.-]+\.(yaml|py|sh)", word):
                    assert (ROOT / word).is_file(), f"{path.name}: {command}: no {word}"
            module = words[words.index("-m") + 1] if "-m" in words else ""
            if module.startswith(("vismmoe_kt.", "benchmarks.")):
                assert importlib.util.find_spec(module), f"{path.name}: {command}: no module {module}"
            if module == "benchmarks.bench":
                try:
                    bench.parse_args(words[words.index("-m") + 2:])
                except SystemExit:
                    pytest.fail(f"{path.name}: {command}: the parser refuses it")
                checked += 1
            if any(w.endswith("vismmoe-kt") for w in words) or "vismmoe_kt" in words:
                start = next(i for i, w in enumerate(words) if w.endswith("vismmoe-kt") or w == "vismmoe_kt") + 1
                try:
                    parser.parse_args(words[start:])
                except SystemExit:
                    pytest.fail(f"{path.name}: {command}: the parser refuses it")
                checked += 1
    assert checked >= 20  # the README's and docs/usage.md's commands were found
