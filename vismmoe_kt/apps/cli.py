"""`vismmoe-kt` command line. Flags follow ktransformers' local_chat where they mean the same thing."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from ..errors import FollowerDone, InputError, PeerLostError, VismmoeError

MULTILINE = '"""'


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def parse_set(values: list[str]) -> dict[str, Any]:
    """`--set key=value` pairs; values are parsed as YAML scalars (numbers, booleans, strings)."""
    import yaml

    from ..core.inject import check_yaml_size

    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set {item!r}: expected key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise InputError(f"--set {item}: the value is not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
        except RecursionError:
            raise InputError(f"--set {item}: the value is nested too deeply") from None
        check_yaml_size(parsed, f"--set {key.strip()}", InputError)
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
POSITIVE = checked(float, lambda v: math.isfinite(v) and v > 0, "a number > 0")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model_path", help="local Hugging Face model directory (config, safetensors, processor)")
    group.add_argument("--demo", action="store_true", help="use the embedded demo model (tiny, trained on synthetic shapes VQA)")
    group.add_argument("--optimize_config_path", help="injection rule file (YAML), e.g. optimize_rules/qwen3vl.yaml")
    group.add_argument("--generate_device", help="put every module on this device for decode (overrides the rules)")
    group.add_argument("--prefill_device", help="put every module on this device for prefill (overrides the rules)")
    group.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="replace a kwarg in every rule that has it (repeatable)")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="convert weights (default: checkpoint dtype)")
    group.add_argument("--cpu_infer", type=int, default=max(physical_cores() - 3, 1),
                       help="CPU threads for CPU compute (default: physical cores - 3)")
    add_parallel_flags(group)


def add_parallel_flags(group) -> None:
    group.add_argument("--ep_size", "--ep-size", type=int,
                       help="expert-parallel group size: the torchrun process count (rank 0 serves, the others follow)")
    group.add_argument("--ep_timeout", type=float, default=300.0,
                       help="seconds a rank waits for the others before it stops with an error (torchrun launches)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vismmoe-kt", description="Vision-language MoE inference with VisMMOE/ReaLB operators.")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser("chat", help="chat with a model about images (interactive unless --prompt)")
    add_model_flags(chat)
    chat.add_argument("--image", action="append", default=[], help="image file for the first turn (repeatable)")
    chat.add_argument("--prompt", help="ask this and exit (non-interactive)")
    chat.add_argument("--prompt_file", help="read the (first) prompt from this file")
    chat.add_argument("--max_new_tokens", type=int, default=1000)
    chat.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    chat.add_argument("--temperature", type=TEMPERATURE)
    chat.add_argument("--top_p", type=TOP_P)
    chat.add_argument("--stats", action="store_true", help="print runtime statistics after each answer")

    calibrate = commands.add_parser("calibrate", help="record routing traces and train the lookahead predictor")
    add_model_flags(calibrate)
    calibrate.add_argument("--images", help="a directory of images or a comma-separated list of files")
    calibrate.add_argument("--prompts", help="a text file, one prompt per line (cycled over the images)")
    calibrate.add_argument("--synthetic", type=int, default=0, metavar="N", help="use N synthetic images and prompts")
    calibrate.add_argument("--image_size", type=int, default=224, help="size of synthetic images")
    calibrate.add_argument("--decode_tokens", type=int, default=8, help="tokens generated per request")
    calibrate.add_argument("--out", required=True, help="directory for traces/, predictor.pt and calibration.json")
    calibrate.add_argument("--window", type=int, default=5, help="lookahead window W (layers)")
    calibrate.add_argument("--gamma", type=float, default=0.8, help="priority decay per layer of distance")
    calibrate.add_argument("--predictor_output", choices=["window", "vector"], default="window")
    calibrate.add_argument("--epochs", type=int, default=80)
    calibrate.add_argument("--seed", type=int, default=0)

    serve = commands.add_parser("serve", help="OpenAI- and Ollama-compatible HTTP server with a web chat page")
    add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=PORT, default=10002)
    serve.add_argument("--api_key", help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--max_new_tokens", type=int, default=1000)
    serve.add_argument("--temperature", type=TEMPERATURE)
    serve.add_argument("--top_p", type=TOP_P)
    serve.add_argument("--max_queue", type=at_least(0), default=8, help="requests that may wait; more get 429")
    serve.add_argument("--limit_mm_per_prompt", type=at_least(0), default=4, help="images per request")
    serve.add_argument("--max_image_mb", type=POSITIVE, default=20)
    serve.add_argument("--allowed_local_media_path", help="serve image_url file paths under this directory")
    serve.add_argument("--max_image_pixels", type=at_least(1), default=16_777_216,
                       help="larger images are refused before they are decoded (default: 16.8 M, the processor's own maximum)")
    serve.add_argument("--max_body_mb", type=POSITIVE,
                       help="larger request bodies get 413 (default: room for the images allowed plus 8 MiB of text)")
    serve.add_argument("--allowed_hosts", nargs="+", metavar="HOST",
                       help="Host header names to answer, '*' for any (default: loopback names when --host is "
                            "loopback, which stops DNS-rebinding pages; any otherwise)")

    add_bench_parser(commands)
    evaluate = commands.add_parser("eval", help="exact-match visual QA accuracy per question type (JSON output)")
    add_model_flags(evaluate)
    evaluate.add_argument("--task", choices=["synthetic-vqa", "folder"], default="synthetic-vqa",
                          help="synthetic-vqa: the seeded shapes task; folder: --data DIR with questions.jsonl")
    evaluate.add_argument("--split", default="test", help="synthetic-vqa split: train, val, test (held out) or a seed")
    evaluate.add_argument("--limit", type=int, help="ask at most N questions (synthetic-vqa default: 200)")
    evaluate.add_argument("--types", help="synthetic-vqa question types, comma-separated (default: all, cycled)")
    evaluate.add_argument("--data", help="folder task: a directory with questions.jsonl and the images it names")
    evaluate.add_argument("--max_new_tokens", type=int, default=8)
    evaluate.add_argument("--output", help="write the results (accuracy per type, every answer) to this JSON file")

    trace = commands.add_parser("trace", help="figures from routing traces")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    plot = trace_commands.add_parser("plot", help="expert heatmap, layer similarity, per-layer Hot Recall (PNG)")
    plot.add_argument("--traces", required=True, help="the traces/ directory written by calibrate")
    plot.add_argument("--out", required=True)
    plot.add_argument("--predictor", help="predictor.pt, to add per-layer Hot Recall")
    return parser


def add_bench_parser(commands) -> None:
    from .bench.configs import CONFIGS
    from ..demo.synthetic import SYNTHETIC_MODELS

    bench = commands.add_parser(
        "bench", help="measure every configuration (baselines, VisMMOE ablation) side by side",
        description="Prefill latency and decode speed of the baselines (all-on-GPU, accelerate offload, "
                    "KTransformers-style CPU experts, LRU) and VisMMOE's ablation steps, same run, same inputs. "
                    "Configurations: " + ", ".join(CONFIGS) + ". vismmoe_kt/apps/bench/configs.py says what each is.")
    group = bench.add_argument_group("model")
    group.add_argument("--model_path", help="local Hugging Face model directory")
    group.add_argument("--demo", action="store_true", help="the embedded demo model (tiny, random weights; CPU-sized)")
    group.add_argument("--synthetic", choices=sorted(SYNTHETIC_MODELS),
                       help="a full-size model with random weights built in host memory (nothing downloaded)")
    group.add_argument("--layers", type=int, help="--synthetic only: keep the first N decoder layers")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="convert weights (default: the checkpoint's; bfloat16 for --synthetic)")
    group.add_argument("--cpu_infer", type=int, default=max(physical_cores() - 3, 1),
                       help="CPU threads for CPU compute (default: physical cores - 3)")
    group.add_argument("--predictor", help="a predictor.pt from `vismmoe-kt calibrate` for the +predict and -full "
                                           "steps (default: the runtime's history prefetch policy)")
    add_parallel_flags(group)
    run = bench.add_argument_group("what to measure")
    run.add_argument("--configs", nargs="+", metavar="NAME", help="configurations to run (default: all)")
    run.add_argument("--budgets", nargs="+", metavar="SIZE",
                     help="expert budgets, the runtime's GPU memory for routed experts (default: 16GiB 32GiB, "
                          "standing for 24 GB and 40 GB cards; --demo: 5MiB 7MiB)")
    run.add_argument("--image-sizes", "--image_sizes", dest="image_sizes", type=int, nargs="+", default=[448, 896],
                     metavar="PX", help="square image sizes, one short prompt each (default: 448 896)")
    run.add_argument("--decode-tokens", "--decode_tokens", dest="decode_tokens", type=int, default=16,
                     help="decoded tokens timed per run (default: 16)")
    run.add_argument("--warmup", type=int, default=1, help="untimed runs per image size before measuring (default: 1)")
    run.add_argument("--repeats", type=int, default=3, help="timed runs per image size; median and spread (default: 3)")
    run.add_argument("--output", help="directory for bench.json and bench.png")
    run.add_argument("--profile", action="store_true",
                     help="also write profile.json: every operator's counters (per layer and phase) per configuration, "
                          "and time each lean decode piece per layer in one extra request (decode_profile)")


def resolve_model_path(args: argparse.Namespace) -> Path:
    if args.demo and args.model_path:
        raise InputError("give either --demo or --model_path, not both")
    if args.demo:
        from ..demo.tiny import demo_model_dir

        print("demo model: a tiny model trained on synthetic shapes (try scripts/make_demo_image.py);"
              " it answers questions about coloured shapes, nothing else", file=sys.stderr)
        return demo_model_dir()
    if not args.model_path:
        raise InputError("no model: pass --model_path DIR (a local Hugging Face model directory) or --demo")
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


def load_from_args(args: argparse.Namespace):
    import torch

    from ..core.loader import load

    if args.cpu_infer < 1:
        raise InputError(f"--cpu_infer must be at least 1, got {args.cpu_infer}")
    torch.set_num_threads(args.cpu_infer)
    overrides = parse_set(args.set)  # bad flags fail before the (demo) model is assembled or loaded
    for flag in DEVICE_KEYS:
        if flag in overrides:
            check_device(overrides[flag], f"--set {flag}")
        if getattr(args, flag):
            overrides[flag] = check_device(getattr(args, flag), f"--{flag}")
    named_device = any(flag in overrides for flag in DEVICE_KEYS)
    model_path = resolve_model_path(args)
    if args.optimize_config_path and not Path(args.optimize_config_path).is_file():
        raise InputError(f"--optimize_config_path {args.optimize_config_path}: no such rule file")
    from ..parallel import launch

    group = launch.join_from_env(args.ep_size, args.ep_timeout)
    if group is not None and group.device != "cpu":  # each torchrun rank on its own GPU
        overrides.setdefault("generate_device", group.device)
        overrides.setdefault("prefill_device", group.device)
    # Only when the user named no device (flag or --set): a device they named is theirs, checked above.
    fallback = not torch.cuda.is_available() and not named_device
    if fallback:  # rule files name cuda:0; without CUDA the command line runs them on the CPU (the API stays strict)
        overrides.update(generate_device="cpu", prefill_device="cpu")
    loaded = load(model_path, args.optimize_config_path, dtype=args.dtype, **overrides)
    if fallback and (group is None or group.leader):
        print("no CUDA device: running every module on the CPU (choose with --generate_device/--prefill_device)",
              file=sys.stderr)
    if group is not None:
        launch.start(loaded[0], group)  # a follower stays there until rank 0 is done (FollowerDone)
    return loaded


def read_user_turn(ask: Callable[[str], str]) -> str | None:
    """One turn of ktransformers' input habits: `\"\"\"` opens/closes multi-line input, a path reads a file."""
    while True:
        try:
            line = ask("Chat: ")
        except EOFError:
            return None
        path = line.strip()
        if not (path and not path.startswith(MULTILINE) and os.path.isfile(path)):
            break
        try:
            return Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:  # e.g. an image's path: say so and ask again, the conversation goes on
            print(f"error: {path} is not a UTF-8 text file (a path typed here is read as the prompt)", file=sys.stderr)
        except OSError as exc:
            print(f"error: {path}: {exc.strerror or exc}", file=sys.stderr)
    if line.strip().startswith(MULTILINE):
        lines = [line.strip()[len(MULTILINE):]]
        while not lines[-1].rstrip().endswith(MULTILINE):
            try:
                lines.append(ask(""))
            except EOFError:
                break
        lines[-1] = lines[-1].rstrip().removesuffix(MULTILINE)
        return "\n".join(lines).strip()
    return line


def run_chat(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from .images import load_image

    out = out or sys.stdout

    if args.max_new_tokens < 1:
        raise InputError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.prompt is not None and args.prompt_file:
        raise InputError("give either --prompt or --prompt_file, not both")
    images = [load_image(path) for path in args.image]  # fail on a bad image before loading the model
    first_prompt = args.prompt
    if args.prompt_file:
        try:
            first_prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"--prompt_file {args.prompt_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"--prompt_file {args.prompt_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    model, processor = load_from_args(args)
    from ..engine.chat import ChatSession
    from ..core.stats import collect_stats, format_stats

    session = ChatSession(model, processor, args.max_new_tokens, args.greedy, args.temperature, args.top_p)

    def answer(text: str, turn_images: list) -> None:
        _, timings = session.ask(text, turn_images, out=out)
        print(timings.ollama_lines(), file=out)
        if args.stats:
            print(format_stats(collect_stats(model)), file=out)
        out.flush()

    if args.prompt is not None or args.prompt_file:
        answer(first_prompt, images)
        return 0
    pending = images
    while (text := read_user_turn(input)) is not None:
        if not text.strip():
            continue
        try:
            answer(text, pending)
        except InputError as exc:  # e.g. over the context: the session dropped this turn, the chat goes on
            print(f"error: {exc}", file=sys.stderr)
            continue  # the first turn's images wait for the next one
        pending = []
    return 0


def eval_items(args: argparse.Namespace) -> list:
    from .evaluate import folder_items, synthetic_items

    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be at least 1, got {args.limit}")
    if args.task == "folder":
        if not args.data:
            raise InputError("--task folder needs --data DIR (a directory with questions.jsonl)")
        return folder_items(args.data, args.limit)
    if args.data:
        raise InputError("--data is for --task folder; --task synthetic-vqa makes its own images")
    split = int(args.split) if args.split.lstrip("-").isdigit() else args.split
    types = [t.strip() for t in args.types.split(",")] if args.types else None
    return synthetic_items(split, args.limit or 200, types)


def run_eval(args: argparse.Namespace, out: TextIO | None = None) -> int:
    import json

    from ..core.stats import collect_stats
    from .evaluate import evaluate

    out = out or sys.stdout
    if args.max_new_tokens < 1:
        raise InputError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise InputError(f"--output {args.output}: its directory does not exist")
    items = eval_items(args)  # bad data fails before the model is loaded
    model, processor = load_from_args(args)
    result = evaluate(model, processor, items, args.max_new_tokens)
    source = f"--data {args.data}" if args.task == "folder" else f"split {args.split}"
    print(f"{args.task} ({source}): accuracy {result['accuracy']:.3f} ({result['correct']}/{result['n']})", file=out)
    for name, entry in result["per_type"].items():
        print(f"  {name:<10} {entry['accuracy']:.3f} ({entry['correct']}/{entry['n']})", file=out)
    if args.output:
        header = {"task": args.task, "split": args.split if args.task != "folder" else None, "data": args.data,
                  "model": str(model.vismmoe.model_dir), "rules": args.optimize_config_path,
                  "overrides": args.set, "stats": collect_stats(model)}
        Path(args.output).write_text(json.dumps({**header, **result}, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"wrote {args.output}", file=out)
    return 0


def build_server(args: argparse.Namespace):
    """The app for these flags (tests start it on a free port)."""
    from .serve.app import create_app
    from .serve.engine import Engine
    from .serve.guard import default_allowed_hosts
    from .serve.inputs import Limits

    if args.max_new_tokens < 1:  # as chat and eval say it
        raise InputError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    model, processor = load_from_args(args)
    name = "vismmoe-demo" if args.demo else Path(args.model_path).name
    limits = Limits(args.limit_mm_per_prompt, int(args.max_image_mb * 2**20), args.allowed_local_media_path,
                    args.max_image_pixels, int(args.max_body_mb * 2**20) if args.max_body_mb else None)
    engine = Engine(model, processor, name, args.max_new_tokens, args.temperature, args.top_p, args.max_queue, limits)
    hosts = args.allowed_hosts or default_allowed_hosts(args.host)
    return create_app(engine, limits, args.api_key, hosts)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_server(args)
    print(f"serving on http://{args.host}:{args.port}  (web chat at /, OpenAI API at /v1)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded by `bench` beside its results
    try:
        if args.command == "chat":
            return run_chat(args)
        if args.command == "calibrate":
            from .calibrate import run

            return run(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "bench":
            from .bench import run

            return run(args)
        if args.command == "eval":
            return run_eval(args)
        if args.command == "trace":
            from .trace import plot

            summary = plot(args.traces, args.out, args.predictor)
            print(f"wrote {', '.join(summary['files'])} to {args.out}")
            return 0
    except FollowerDone:
        return 0
    except PeerLostError as exc:  # the group cannot be torn down cleanly: leave at once
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    except VismmoeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        launch = sys.modules.get("vismmoe_kt.parallel.launch")
        if launch is not None:  # a torchrun launch: release the followers, leave the group
            launch.finish()
    return 1


if __name__ == "__main__":
    sys.exit(main())
