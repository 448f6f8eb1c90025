"""A pytest plugin: every kernel the tests compile for sm_90 (tests/conftest.py's compile_for_hopper), read back
with the nvdisasm and cuobjdump Triton ships, and its registers, stack and local-memory loads and stores (ptxas's
spills) listed, worst first. No GPU needed.

    PYTHONPATH=scripts:tests .venv/bin/python -m pytest -q -p spill_audit -k "hopper or compile" \\
        tests/runtime/kernels tests/engine/test_fused_attention.py tests/engine/test_fused_ops.py

The table goes to stdout at the end and, as JSON, to $SPILL_AUDIT_OUT (default spill_audit.json).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

RESULTS: list[dict] = []


def _read(compiled, tools: Path) -> dict:
    cubin = Path(tempfile.mkdtemp()) / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                          timeout=120).stdout
    usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                           timeout=120).stdout
    number = lambda key: int(m.group(1)) if (m := re.search(rf"{key}:(\d+)", usage)) else None  # noqa: E731
    return {"registers": number("REG"), "stack": number("STACK"),
            "local": len(re.findall(r"\b(?:LDL|STL)\b", sass)), "instructions": sass.count(";")}


def pytest_configure(config) -> None:
    import conftest
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    compile_for_hopper = conftest.compile_for_hopper

    def audited(kernel, signature, constants, aligned=(), **options):
        compiled = compile_for_hopper(kernel, signature, constants, aligned, **options)
        RESULTS.append({"kernel": getattr(kernel, "fn", kernel).__name__,
                        "constants": {k: v for k, v in constants.items() if isinstance(v, (int, str, bool))},
                        "options": options, **_read(compiled, tools)})
        return compiled

    conftest.compile_for_hopper = audited


def pytest_unconfigure(config) -> None:
    if not RESULTS:
        return
    unique = {json.dumps([r["kernel"], r["constants"], r["options"]], sort_keys=True): r for r in RESULTS}
    rows = sorted(unique.values(), key=lambda r: -r["local"])
    Path(os.environ.get("SPILL_AUDIT_OUT", "spill_audit.json")).write_text(json.dumps(rows, indent=1))
    print(f"\n{len(rows)} kernels compiled for sm_90; local loads and stores a program, worst first:")
    for r in rows:
        if r["local"]:
            print(f"  {r['local']:6d}  {r['kernel']} {r['constants']} {r['options']} "
                  f"(registers {r['registers']}, stack {r['stack']} B, {r['instructions']} instructions)")
