"""The README's quick start runs as written: its commands, copied from the file, in a fresh folder.

`make demo` itself is CI's business (`.ci/run` runs it after the tests); here every other line of the
quick start runs with this interpreter's environment in place of `.venv/bin/`, and the server block
runs whole through bash (on a free port), curl included.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
BIN = os.path.dirname(sys.executable) + "/"


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


def test_the_quick_start_commands_run_as_written(tmp_path):
    commands, server = quick_start_blocks()
    for line in commands.strip().splitlines():
        command = line.split("  #")[0].strip()
        if command.startswith("make "):
            continue  # the venv this test runs in is what `make demo` builds
        result = subprocess.run(localised(command), shell=True, cwd=tmp_path, capture_output=True, text=True,
                                input="", timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
        if "--prompt" in command:
            assert result.stdout.strip(), f"{command}: no answer"
    assert (tmp_path / "shapes.png").read_bytes().startswith(b"\x89PNG")


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
