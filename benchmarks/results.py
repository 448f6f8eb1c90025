"""What the measurement modules print and keep: a Markdown table on stdout, the figures as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def save_json(out: str | None, name: str, data: dict[str, Any]) -> None:
    """`out/name` (out created if needed); nothing when out is None."""
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps(data, indent=2))
