"""`vismmoe-kt convert`: a Hugging Face checkpoint (or the demo model) as the pair of GGUF files llama.cpp
runs, as its converter and `kt quant` write them: `<name>-<QTYPE>.gguf` (the text model, its
architecture's hyperparameters, the vocabulary and the chat template) and `mmproj-<name>-<QTYPE>.gguf`
(the vision tower and its `clip.*` keys). `vismmoe-kt chat --gguf_path ... --mmproj_path ...` then runs
from the two files alone (core/gguf_model.py).

The checkpoint is loaded with the stock modules on the CPU (every tensor in memory once), then each file
is written one tensor at a time (demo/gguf_export.py), with a progress bar each.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from ..errors import InputError

MMPROJ_QTYPE = "F16"  # llama.cpp's converter writes the vision tower in F16


def add_parser(commands) -> None:
    from ..demo.gguf_export import WRITABLE

    convert = commands.add_parser("convert", help="write a checkpoint as a model GGUF and an mmproj GGUF")
    source = convert.add_mutually_exclusive_group()
    source.add_argument("--model_path", help="local Hugging Face model directory (config, safetensors, processor)")
    source.add_argument("--demo", action="store_true", help="the embedded demo model")
    convert.add_argument("--out", required=True, help="directory the two files are written to (made if absent)")
    convert.add_argument("--qtype", default="BF16", type=str.upper, choices=WRITABLE,
                         help="the text model's matrices' type (norms and rows that do not divide into its blocks "
                              "stay F32)")
    convert.add_argument("--mmproj_qtype", default=MMPROJ_QTYPE, type=str.upper, choices=WRITABLE,
                         help="the vision tower's matrices' type")
    convert.add_argument("--name", help="the files' name stem (default: the model directory's name)")


def _writable_dir(path: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as exc:
        raise InputError(f"--out {out}: not writable ({exc.strerror or exc})") from None
    return out


def run(args: argparse.Namespace) -> int:
    from ..core.loader import load, read_model_config
    from ..demo.gguf_export import export_gguf, export_mmproj

    if args.demo:
        from ..demo.tiny import DEMO_SPEC, demo_model_dir

        model_dir, stem = demo_model_dir(), args.name or DEMO_SPEC
    elif args.model_path:
        model_dir = Path(args.model_path)
        stem = args.name or model_dir.resolve().name
    else:
        raise InputError("no model: pass --model_path DIR (a local Hugging Face model directory) or --demo")
    config, adapter = read_model_config(model_dir)  # a missing or unsupported model fails before --out is made
    if adapter.llama_cpp_gap:  # a family llama.cpp's files cannot hold (or not from here yet), before any work
        raise InputError(f"{model_dir}: family {'/'.join(adapter.model_types)}: {adapter.llama_cpp_gap}")
    out = _writable_dir(args.out)
    model, processor = load(model_dir, generate_device="cpu", prefill_device="cpu", progress=True)
    state = model.state_dict()
    family = "/".join(adapter.model_types)
    mapped = any(adapter.gguf_names(name) for name in state) and any(adapter.mmproj_source(name, config) for name in state)
    if not mapped:
        raise InputError(f"{model_dir}: family {family}: its tensors have no llama.cpp names here yet (text: "
                         f"ModelAdapter.gguf_names, vision tower: mmproj_source); convert writes Qwen3-VL-MoE, "
                         f"GLM-4.5V, Llama 4 and Kimi K2.5")
    text_file, mmproj_file = out / f"{stem}-{args.qtype}.gguf", out / f"mmproj-{stem}-{args.mmproj_qtype}.gguf"
    try:
        ends = model.generation_config.eos_token_id
        export_gguf(state, adapter, text_file, args.qtype, config=config, processor=processor, progress=True,
                    end_ids=[ends] if isinstance(ends, int) else ends)
        export_mmproj(state, adapter, config, mmproj_file, args.mmproj_qtype, processor=processor, progress=True)
    except ValueError as exc:  # a tokenizer or config llama.cpp's keys cannot carry
        for path in (text_file, mmproj_file):
            path.unlink(missing_ok=True)
        raise InputError(f"{model_dir}: {exc}") from None
    for path in (text_file, mmproj_file):
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    print(f"run it: vismmoe-kt chat --gguf_path {text_file} --mmproj_path {mmproj_file}", file=sys.stderr)
    return 0
