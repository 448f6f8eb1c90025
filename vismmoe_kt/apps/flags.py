"""Flags every model-loading command shares, their checks, and loading the model they describe.

Flags follow ktransformers' local_chat where they mean the same thing (`--model_path`,
`--optimize_config_path`, `--cpu_infer`, ...); `--placement NAME` stands for the checkpoint family's generated
rule file of that placement (vismmoe_kt/core/placements.py). A value out of range is a usage error before anything
loads; a device the user named is checked against this machine.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..core.context import DECODE_MODES, GRAPH_MODES
from ..errors import InputError


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


CPU_INFER_HELP = ("CPU expert workers (kt-kernel's pool) and torch's CPU threads (default: physical cores - 2, "
                  "leaving two for the threads that feed the GPU)")


def default_cpu_threads() -> int:
    from cpu_kernels.threads import RESERVED_CORES

    return max(physical_cores() - RESERVED_CORES, 1)


def parse_set(values: list[str], flag: str = "--set") -> dict[str, Any]:
    """`--set key=value` pairs; values are parsed as YAML scalars (numbers, booleans, strings). `flag` names
    where they came from in errors (a benchmark's `--configs NAME:key=value,...` takes the same pairs)."""
    import yaml

    from ..core.inject import check_yaml_size

    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"{flag} {item!r}: expected key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise InputError(f"{flag} {item}: the value is not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
        except RecursionError:
            raise InputError(f"{flag} {item}: the value is nested too deeply") from None
        check_yaml_size(parsed, f"{flag} {key.strip()}", InputError)
        out[key.strip()] = parsed
    return out


def checked(convert: type, ok: Callable[[Any], bool], wants: str) -> Callable[[str], Any]:
    """An argparse type: a value out of range is a usage error ("error: argument --port: ...") before anything loads."""
    def parse(text: str) -> Any:
        value = convert(text)  # a ValueError here gives argparse's own "invalid int value: 'x'"
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {wants}, got {text}")
        return value
    parse.__name__ = convert.__name__
    return parse


def at_least(low: int) -> Callable[[str], int]:
    return checked(int, lambda v: v >= low, f"at least {low}")


PORT = checked(int, lambda v: 0 <= v <= 65535, "a port number, 0..65535")  # uvicorn raises OverflowError otherwise
TEMPERATURE = checked(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")  # nan, inf break sampling
TOP_P = checked(float, lambda v: 0 < v <= 1, "in (0, 1]")  # false for nan too
TEMPERATURE_HELP = "sampling temperature (default: the model's generation_config; with --top_p, sampling on)"
TOP_P_HELP = "nucleus sampling: keep the likeliest tokens up to this probability mass (default: generation_config)"
POSITIVE = checked(float, lambda v: math.isfinite(v) and v > 0, "a number > 0")


PLACEMENT_FLAG_HELP = ("the generated rules of a placement for the checkpoint's family: vismmoe | gpu | offload | lru | "
                       "hybrid | kt-cpu | realb | ep (`vismmoe-kt rules list`; the same as "
                       "optimize_rules/<family>[-<placement>].yaml; default: neither, every module as the checkpoint "
                       "has it)")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model_path", help="local Hugging Face model directory (config, safetensors, processor)")
    group.add_argument("--demo", action="store_true", help="use the embedded demo model (tiny, trained on synthetic shapes VQA)")
    group.add_argument("--gguf_path", help="read the weights from GGUF (a .gguf file, the first of a split, or a "
                                           "directory of them); config, tokenizer and processor come from --model_path "
                                           "as in KTransformers, or without it from the GGUF's own metadata (with "
                                           "--mmproj_path; `vismmoe-kt convert` writes such a pair)")
    group.add_argument("--mmproj_path", help="with --gguf_path: the vision tower from llama.cpp's mmproj GGUF file "
                                             "(default: the safetensors in --model_path)")
    rules = group.add_mutually_exclusive_group()
    rules.add_argument("--optimize_config_path", help="injection rule file (YAML), e.g. optimize_rules/qwen3vl.yaml")
    rules.add_argument("--placement", help=PLACEMENT_FLAG_HELP)
    group.add_argument("--generate_device", help="put every module on this device for decode (overrides the rules)")
    group.add_argument("--prefill_device", help="put every module on this device for prefill (overrides the rules)")
    group.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="replace a kwarg in every rule that has it (repeatable)")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="convert weights (default: the checkpoint's dtype; GGUF: float32 for an all-F32 file, else bfloat16)")
    group.add_argument("--cpu_infer", type=int, help=CPU_INFER_HELP)
    add_engine_flags(group)
    add_parallel_flags(group)


def add_engine_flags(group) -> None:
    group.add_argument("--decode", choices=DECODE_MODES,
                       help="lean: our decode path where the rules have a VisDecoder (default) | hf: transformers' loop")
    group.add_argument("--graphs", choices=GRAPH_MODES,
                       help="CUDA graphs of the lean decode step: auto (default: on a CUDA device) | cuda | "
                            "replay (the CPU twin) | off")


def add_parallel_flags(group) -> None:
    group.add_argument("--ep_size", type=int,
                       help="expert-parallel group size: the torchrun process count (rank 0 serves, the others follow)")
    group.add_argument("--ep_timeout", type=POSITIVE, default=300.0,
                       help="seconds a rank waits for the others before it stops with an error (torchrun launches)")


def resolve_model_path(args: argparse.Namespace) -> Path:
    if args.demo and args.model_path:
        raise InputError("give either --demo or --model_path, not both")
    if args.demo:
        from ..demo.tiny import demo_model_dir

        print("demo model: a tiny model trained on synthetic shapes (try python -m vismmoe_kt.demo.pictures);"
              " it answers questions about coloured shapes, nothing else", file=sys.stderr)
        return demo_model_dir()
    if not args.model_path and getattr(args, "gguf_path", None):  # a model from its GGUF files alone
        from ..core.gguf_model import model_dir_from_gguf

        # the directory rebuilt from the files' metadata stands for --model_path from here on (serve names
        # the model after it)
        args.model_path = str(model_dir_from_gguf(args.gguf_path, getattr(args, "mmproj_path", None)))
    if not args.model_path:
        raise InputError("no model: pass --model_path DIR (a local Hugging Face model directory), --gguf_path FILE "
                         "--mmproj_path FILE, or --demo")
    return Path(args.model_path)


DEVICE_KEYS = ("generate_device", "prefill_device")


def check_device(value: Any, where: str) -> str:
    """A device the user named: one torch knows and this machine has, else an InputError naming it."""
    import torch

    try:
        if not isinstance(value, str):  # e.g. `--set generate_device=0`: an int would pass torch.device as cuda:0
            raise TypeError
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"{where}: {value!r} is not a device (expected e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(f"{where}: {value} is not available: this machine has no CUDA device")
        if device.index is not None and device.index >= count:
            raise InputError(f"{where}: {value} is not available: this machine has {count} CUDA "
                             f"device{'s' if count > 1 else ''}")
    return value


def load_from_args(args: argparse.Namespace, default_rules: Path | None = None):
    """The model and processor the flags name, under `--optimize_config_path` (else `default_rules`,
    else the stock modules)."""
    import torch

    from ..core.loader import load

    if args.cpu_infer is not None and args.cpu_infer < 1:
        raise InputError(f"--cpu_infer must be at least 1, got {args.cpu_infer}")
    torch.set_num_threads(args.cpu_infer or default_cpu_threads())
    overrides = parse_set(args.set)  # bad flags fail before the (demo) model is assembled or loaded
    rule_kwargs = sorted(set(overrides) - set(DEVICE_KEYS))  # what --set gives the rules themselves
    if args.cpu_infer is not None:
        overrides["cpu_infer"] = args.cpu_infer
    for flag in DEVICE_KEYS:
        if flag in overrides:
            check_device(overrides[flag], f"--set {flag}")
        if getattr(args, flag):
            overrides[flag] = check_device(getattr(args, flag), f"--{flag}")
    named_device = any(flag in overrides for flag in DEVICE_KEYS)
    for option in ("decode", "graphs"):  # the engine's options (load() tells them from rule kwargs)
        if getattr(args, option, None):
            overrides[option] = getattr(args, option)
    model_path = resolve_model_path(args)
    if args.optimize_config_path and not Path(args.optimize_config_path).is_file():
        raise InputError(f"--optimize_config_path {args.optimize_config_path}: no such rule file")
    rules, placement = args.optimize_config_path, getattr(args, "placement", None)
    if rule_kwargs and not (rules or placement or default_rules):  # else the loader's "not a kwarg of any rule"
        raise InputError(f"--set {rule_kwargs[0]}: no rules to set it in (the stock modules take no kwargs); name a "
                         f"rule file with --optimize_config_path (e.g. optimize_rules/qwen3vl.yaml) or --placement")
    if placement:  # the family from the checkpoint (the demo's is Qwen3-VL-MoE), before anything loads
        from ..core.placements import family_of_model, placement_rules

        family = family_of_model(model_path)
        try:
            rules = placement_rules(family, placement)
        except InputError as exc:
            raise InputError(f"--placement {placement}: {exc}") from None
    from ..parallel import launch

    group = launch.join_from_env(args.ep_size, args.ep_timeout)
    if group is not None and group.device != "cpu":  # each torchrun rank on its own GPU
        overrides.setdefault("generate_device", group.device)
        overrides.setdefault("prefill_device", group.device)
    # Only when the user named no device (flag or --set): a device they named is theirs, checked above.
    fallback = not torch.cuda.is_available() and not named_device
    if fallback:  # rule files name cuda:0; without CUDA the command line runs them on the CPU (the API stays strict)
        overrides.update(generate_device="cpu", prefill_device="cpu")
    gguf = {"gguf_path": args.gguf_path} if getattr(args, "gguf_path", None) else {}
    if getattr(args, "mmproj_path", None):
        gguf["mmproj_path"] = args.mmproj_path
    loaded = load(model_path, rules or default_rules, dtype=args.dtype, **gguf, **overrides)
    if placement:  # `--stats` and eval's record name the placement, as they name a rule file
        loaded[0].vismmoe.rules = f"--placement {placement} ({family})"
    if fallback and (group is None or group.leader):
        print("no CUDA device: running every module on the CPU (choose with --generate_device/--prefill_device)",
              file=sys.stderr)
    if group is not None and not getattr(args, "data_parallel", False):  # data parallel: every rank leads
        launch.start(loaded[0], group)  # a follower stays there until rank 0 is done (FollowerDone)
    return loaded
