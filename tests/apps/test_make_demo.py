"""`make demo` goes through our operators and answers right: its commands, as make expands them (without
building the venv this test already runs in), run from the repository root (#26: it used to run the stock
modules, and forcing offload flipped its answer)."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vismmoe_kt.demo.pictures import DEMO_QUESTIONS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("make") is None, reason="needs make")]


def demo_commands(image: Path) -> list[str]:
    """The demo recipe's commands with this interpreter's bin directory in place of the venv's."""
    expanded = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "demo",
                               f"BIN={os.path.dirname(sys.executable)}", f"IMAGE={image}"],
                              cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
    return [line for line in expanded.replace("\\\n", " ").splitlines() if line.strip()]


def test_make_demo_answers_right_through_offload_and_pruning(tmp_path):
    picture, chat = demo_commands(tmp_path / "demo.png")
    subprocess.run(picture, shell=True, cwd=ROOT, check=True, capture_output=True, timeout=120)
    words = shlex.split(chat)
    assert "--optimize_config_path" in words and "--stats" in words
    question = words[words.index("--prompt") + 1]
    result = subprocess.run(chat, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert out.splitlines()[0].strip() == DEMO_QUESTIONS[question], out[:500]
    offload = re.search(r"offload: experts of (\d+) of (\d+) MoE layers pinned, the other \d+ in the host store "
                        r"behind (\d+) slabs: (\d+) fetched, (\d+) evicted", out)
    assert offload, out
    pinned, layers, slabs, fetched, evicted = map(int, offload.groups())
    assert pinned < layers and fetched > 0 and evicted > 0  # experts really moved, the cache really was short
    pruned = re.search(r"visual tokens: (\d+) -> (\d+) \(affinity compression, 1 of 1 prefills pruned\)", out)
    assert pruned and int(pruned.group(2)) < int(pruned.group(1)), out
