"""`python -m benchmarks.bench`: every configuration side by side, same machine, same run, same inputs.

    configs.py             the configurations (baselines and VisMMOE's ablation) as rule lists
    source.py              the model: a directory, the demo model, or synthetic full-size shapes
    inputs.py, timing.py   the requests; prefill latency and decode speed, median and spread
    bandwidth.py           the copy bandwidth of this machine, measured in the run
    figures.py             hit rates, bytes moved, copy time hidden, CPU share, the copy bound
    accelerate_offload.py  the accelerate `device_map` baseline
    runner.py              one configuration at one budget
    concurrency.py         --concurrency N: N requests with images decoded together (batched generation);
                           under torchrun, N on every rank (data parallel + expert parallelism)
    report.py              table, JSON, PNG
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from vismmoe_kt.errors import InputError
from vismmoe_kt.runtime.budget import BudgetError, human_bytes, parse_budget, resolve_budget

PROG = "python -m benchmarks.bench"
DEFAULT_BUDGETS = ("16GiB", "32GiB")       # expert budgets standing for a 24 GB and a 40 GB card (rule files)
DEFAULT_DEMO_BUDGETS = ("5MiB", "7MiB")  # the demo model (2.25 MiB of experts a layer): 1 pinned layer + 1 or 2 of slabs


def parse_budgets(values: list[str] | None, demo: bool) -> list[str]:
    budgets = list(values or (DEFAULT_DEMO_BUDGETS if demo else DEFAULT_BUDGETS))
    for value in budgets:
        try:
            parse_budget(value)
        except BudgetError as exc:
            raise InputError(f"--budgets {value!r}: {exc}") from None
    return budgets


def check_flags(args) -> None:
    for flag, value, least in (("--decode-tokens", args.decode_tokens, 1), ("--repeats", args.repeats, 1),
                               ("--warmup", args.warmup, 0), ("--cpu_infer", args.cpu_infer, 1),
                               ("--concurrency", min(args.concurrency or [2]), 2)):
        if value is not None and value < least:
            raise InputError(f"{flag} must be at least {least}, got {value}")
    bad = [s for s in args.image_sizes if s < 32]
    if bad:
        raise InputError(f"--image-sizes must be at least 32 px, got {bad[0]}")
    if args.prefill_chunk < 0 or args.prefill_chunk == 1:
        raise InputError(f"--prefill-chunk must be 0 (whole prompts) or at least 2, got {args.prefill_chunk}")
    if args.concurrency and args.decode_tokens < 2:
        raise InputError("--concurrency measures inter-token latency: --decode-tokens must be at least 2")
    if args.profile and not args.output:
        raise InputError("--profile writes profile.json into the --output directory: give --output DIR")
    if args.predictor:
        check_predictor(args.predictor)


def check_predictor(path: str) -> None:
    """Readable before any model loads (a predictor of another model is refused at load, per row)."""
    from vismmoe_kt.predictor.model import LookaheadPredictor

    if not Path(path).is_file():
        raise InputError(f"--predictor {path}: no such file (vismmoe-kt calibrate writes predictor.pt)")
    try:
        LookaheadPredictor.load(path)
    except ValueError as exc:
        raise InputError(f"--predictor: {exc}") from None


def routing_of(args) -> str:
    """--routing, defaulting to the synthetic router for random-weight (--synthetic) models."""
    from vismmoe_kt.operators.routing_source import parse_spec

    routing = args.routing or ("synthetic" if args.synthetic else "model")
    parse_spec(routing)  # a bad value fails before anything loads
    return routing


def run_meta(args, source, budgets: list[str], bandwidth: dict, cuda: bool) -> dict[str, Any]:
    """What a reader needs beside the rows: model, machine, inputs, the measured bandwidth, caveats."""
    import torch

    from benchmarks.bench.configs import ladder_compresses, rule_file
    from benchmarks.bench.inputs import PROMPT

    notes = ["budgets are the offload runtime's expert budgets (GPU memory for routed experts); accelerate's "
             "GPU cap is the budget plus the non-expert weights",
             "hit rates count offloaded layers only (a pinned layer always hits): across configurations with "
             "different pinned prefixes compare bytes moved, not hit rates"]
    total = source.expert_bytes() if any(isinstance(parse_budget(b), str) for b in budgets) else None
    for budget in budgets:  # a share of the experts: say what it is in bytes on this model
        share = parse_budget(budget)
        if isinstance(share, str) and total:
            notes.append(f"budget {budget} = {human_bytes(resolve_budget(share, total))} of the model's "
                         f"{human_bytes(total)} of routed experts")
    family = source.family
    if not ladder_compresses(family):
        notes.append(f"{family}'s ladder rule file ({rule_file(family, 'ladder')}) prunes no visual tokens: "
                     "+compress adds nothing to -base, and -full is the deep prefetch alone")
    routing = routing_of(args)
    if routing != "model":
        notes.append(f"routing: {routing} replaces every router's choice (experts still compute on the model's "
                     f"weights); Belady decode is the optimal offline hit rate of a per-layer cache of the "
                     f"same size on the same requests")
    elif source.random_weights:
        notes.append("random weights with --routing model: routing is near-uniform, so hit rates, bytes moved, CPU "
                     "share and the copy bound are not a trained model's")
    if not cuda:
        notes.append("no CUDA: every configuration runs on the CPU; copies are synchronous there, so 'copy "
                     "hidden' counts prefetch copies the compute thread itself ran")
    device = torch.cuda.get_device_name(0) if cuda else \
        f"CPU only ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {
        "model": source.describe(), "layers": args.layers, "routing": routing, "device": device, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "prompt": PROMPT,
        "image_sizes": list(args.image_sizes), "decode_tokens": args.decode_tokens, "warmup": args.warmup,
        "repeats": args.repeats, "budgets": budgets, "predictor": args.predictor, "copy_bandwidth": bandwidth,
        "load_average": [round(os.getloadavg()[0], 2)],  # other work on the host makes timings noisy
        "command": PROG + " " + " ".join(getattr(args, "argv", [])), "notes": notes}


def run(args) -> int:
    """Validate everything, then measure, print and write."""
    import torch
    from tqdm import tqdm

    from benchmarks.bench.bandwidth import measure_copy_bandwidth
    from benchmarks.bench.configs import parse_configs, run_label
    from benchmarks.bench.report import concurrency_table, describe_meta, markdown_table, write_outputs
    from benchmarks.bench.runner import Settings, run_config
    from benchmarks.bench.source import model_source

    from vismmoe_kt.parallel import launch
    from vismmoe_kt.apps.flags import default_cpu_threads

    group = launch.join_from_env(args.ep_size, args.ep_timeout)
    configs = parse_configs(args.configs, in_group=group is not None)
    budgets = parse_budgets(args.budgets, args.demo)
    check_flags(args)
    routing_of(args)
    source = model_source(args)
    torch.set_num_threads(args.cpu_infer or default_cpu_threads())
    cuda = torch.cuda.is_available()
    device = group.device if group is not None else "cuda:0" if cuda else "cpu"
    bandwidth = measure_copy_bandwidth(torch.device(device))
    settings = Settings(tuple(args.image_sizes), args.decode_tokens, args.warmup, args.repeats,
                        bandwidth["bytes_per_s"], args.predictor, args.profile, group, routing_of(args),
                        args.cpu_infer, tuple(args.concurrency or ()), args.prefill_chunk or None)
    leader = group is None or group.leader  # only rank 0 reports
    meta = run_meta(args, source, budgets, bandwidth, cuda)
    if group is not None:
        meta["ep_size"] = group.world
        meta["notes"].append(f"expert parallel over {group.world} processes: one request at a time is rank 0's, the "
                             "other ranks serving their experts to it" + ("; --concurrency N is data parallel: N "
                             "requests on every rank" if args.concurrency else ""))
    if leader:
        print(describe_meta(meta), file=sys.stderr)
    runs = [(c, b) for c in configs for b in (budgets if c.takes_budget else [None])]
    steps = len(runs) * len(args.image_sizes) * (args.warmup + args.repeats)
    rows, profile = [], {}
    with tqdm(total=steps, desc="bench", unit="run", disable=not leader) as progress:
        for config, budget in runs:
            progress.set_postfix_str(run_label(config.name, budget))
            config_rows, config_profile = run_config(config, budget, source, settings, progress)
            rows += config_rows
            if config_profile is not None:
                profile[run_label(config.name, budget)] = config_profile
    if not leader:
        return 0
    meta["load_average"].append(round(os.getloadavg()[0], 2))
    print(describe_meta(meta))
    print(markdown_table(rows))
    if settings.concurrency:
        print("\n" + concurrency_table(rows))
    if args.output:
        written = write_outputs(Path(args.output), meta, rows, profile if args.profile else None)
        print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def build_parser():
    """`python -m benchmarks.bench`'s flags, from the same shared flag helpers as the `vismmoe-kt` commands."""
    from benchmarks.models.synthetic import SYNTHETIC_MODELS
    from vismmoe_kt.apps.arguments import ALIAS_NOTE, FlagParser
    from vismmoe_kt.apps.flags import CPU_INFER_HELP, add_engine_flags, add_parallel_flags
    from benchmarks.bench.configs import CONFIGS

    bench = FlagParser(
        prog=PROG, epilog=ALIAS_NOTE,
        description="Prefill latency and decode speed of the baselines (all-on-GPU, accelerate offload, "
                    "KTransformers-style CPU experts, LRU) and VisMMOE's ablation steps, same run, same inputs. "
                    "Configurations: " + ", ".join(CONFIGS) + ". benchmarks/bench/configs.py says what each is.")
    group = bench.add_argument_group("model")
    group.add_argument("--model_path", help="local Hugging Face model directory")
    group.add_argument("--gguf_path", help="the weights from GGUF (a .gguf file, the first of a split, or a directory "
                                           "of them); without --model_path, config, tokenizer and processor from its "
                                           "metadata too (with --mmproj_path), as `vismmoe-kt chat`")
    group.add_argument("--mmproj_path", help="with --gguf_path: the vision tower from llama.cpp's mmproj GGUF file")
    group.add_argument("--demo", action="store_true", help="the embedded demo model (tiny, trained on synthetic shapes; CPU-sized)")
    group.add_argument("--synthetic", choices=sorted(SYNTHETIC_MODELS), metavar="NAME",
                       help="a full-size model with random weights built in host memory (nothing downloaded): "
                            + ", ".join(sorted(SYNTHETIC_MODELS)) + " (benchmarks/models/synthetic.py); the family "
                            "picks the configurations' rule files")
    group.add_argument("--layers", type=int, help="--synthetic only: keep the first N decoder layers")
    group.add_argument("--narrow", action="store_true",
                       help="--synthetic only: the family's layout (experts, top-k, dense and MoE layers, vision "
                            "pipeline) at CPU-sized widths (deepseek-ocr2), for sanity runs")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="convert weights (default: the checkpoint's; bfloat16 for --synthetic)")
    group.add_argument("--cpu_infer", type=int, help=CPU_INFER_HELP)
    group.add_argument("--predictor", help="a predictor.pt from `vismmoe-kt calibrate` for the +predict and -full "
                                           "steps (default: the runtime's history prefetch policy)")
    add_engine_flags(group)
    add_parallel_flags(group)
    run = bench.add_argument_group("what to measure")
    run.add_argument("--configs", nargs="+", metavar="NAME", help="configurations to run (default: all)")
    run.add_argument("--budgets", nargs="+", metavar="SIZE",
                     help="expert budgets, the runtime's GPU memory for routed experts: sizes, or shares of the "
                          "model's routed experts such as 30%% (default: 16GiB 32GiB, standing for 24 GB and 40 GB "
                          "cards; --demo: 5MiB 7MiB)")
    run.add_argument("--image_sizes", type=int, nargs="+", default=[448, 896],
                     metavar="PX", help="square image sizes, one short prompt each (default: 448 896)")
    run.add_argument("--decode_tokens", type=int, default=16,
                     help="decoded tokens timed per run (default: 16)")
    run.add_argument("--warmup", type=int, default=1,
                     help="untimed runs per image size before measuring, and up to two more while they capture decode "
                          "graphs, so no timed run pays a capture (default: 1; 0: none)")
    run.add_argument("--repeats", type=int, default=3, help="timed runs per image size; median and spread (default: 3)")
    run.add_argument("--routing", help="which experts tokens go to: model (the router's own choice), synthetic[:SEED] "
                                       "(the calibrated synthetic router) or trace:PATH (replay); default: synthetic "
                                       "for --synthetic models, model otherwise")
    run.add_argument("--output", help="directory for bench.json and bench.png")
    run.add_argument("--concurrency", type=int, nargs="+", metavar="N",
                     help="also decode N requests with images together, for each N (>= 2; batched generation, lean "
                          "decode configurations): aggregate and per-request tokens/s, time to first token and "
                          "inter-token latency p50 / p95, PCIe bytes per generated token. Under torchrun (the ep "
                          "configurations): N requests on every rank, data parallel, the group's figures")
    run.add_argument("--prefill_chunk", type=int, default=0,
                     help="with --concurrency: prompt tokens prefilled per step beside the running requests' decode, "
                          "as `serve --prefill_chunk` (default 0: whole prompts)")
    run.add_argument("--profile", action="store_true",
                     help="also write profile.json: every operator's counters (per layer and phase) per configuration, "
                          "and time each lean decode piece per layer in one extra request (decode_profile)")
    return bench
