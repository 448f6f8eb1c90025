"""The setup the prompt benchmarks share (tiles_ab, prompt_timeline): one configuration's model, or a tiny random
one for a sanity run on the CPU, and the prompts to time (a picture's and/or a text one)."""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import types

import torch

from benchmarks.bench.inputs import make_request, text_request
from benchmarks.configurations import parse_configuration
from benchmarks.decode_bench import family_of, load_model
from benchmarks.models.synthetic import DEFAULT_MODEL
from vismmoe_kt.demo.tiny import save_tiny_model
from vismmoe_kt.errors import VismmoeError


def add_prompt_flags(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """The prompt benchmarks' flags; `several`: `--configs`, two or more configurations, instead of `--config`."""
    if several:
        parser.add_argument("--configs", nargs="+", required=True, metavar="CONFIG",
                            help="two or more decode_bench configurations (NAME[:key=value,...]), the first the baseline")
    else:
        parser.add_argument("--config", required=True, help="one decode_bench configuration (NAME[:key=value,...])")
    parser.add_argument("--image-size", type=int, default=448, help="the picture prompt's size in pixels (0: none)")
    parser.add_argument("--text-tokens", type=int, default=0, help="also a text-only prompt of this many tokens")
    parser.add_argument("--routing", default="synthetic", help="as decode_bench's --routing (default synthetic)")
    parser.add_argument("--tiny", help="a tiny random model instead of the configuration's (a sanity run)")
    parser.add_argument("--device", default="cuda:0", help="where the model runs (cpu with --tiny)")
    parser.add_argument("--layers", type=int, help="the synthetic model (a configuration without gguf_path): keep the "
                                                   "first N decoder layers (default: all)")


def check_prompt_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A clear error (through the parser) for a run with nothing to time or a GPU the machine lacks."""
    if not args.image_size and not args.text_tokens:
        parser.error("--image-size 0 and no --text-tokens: no prompt to time")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (--device cpu with --tiny for a sanity run)")


def load_prompt_model(parser: argparse.ArgumentParser, args: argparse.Namespace, prefix: str,
                      configuration: str | None = None):
    """(model, processor) of the configuration (`configuration`, else `args.config`; a tiny model saved under a
    temporary folder with `--tiny`); a configuration the loader refuses ends the run through the parser."""
    # the synthetic model's full depth in BF16, where the configuration names no GGUF (decode_bench's defaults)
    bench_args = types.SimpleNamespace(device=args.device, routing=args.routing, tiny=args.tiny, model=DEFAULT_MODEL,
                                       tiny_dir=None, layers=args.layers, dtype="bfloat16", narrow=False)
    if args.tiny:
        root = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        bench_args.tiny_dir = save_tiny_model(root, args.tiny, seed=0)
    try:
        config = parse_configuration(configuration or args.config, family_of(bench_args))
        return load_model(bench_args, config)
    except VismmoeError as exc:
        parser.error(str(exc))


def prompt_requests(processor, args: argparse.Namespace) -> dict[str, dict]:
    """{label: request}: "<size> px" for the picture, "text <tokens>" for the text prompt."""
    requests = {}
    if args.image_size:
        requests[f"{args.image_size} px"] = make_request(processor, args.image_size, args.device)
    if args.text_tokens:
        requests[f"text {args.text_tokens}"] = text_request(processor, args.text_tokens, args.device)
    return requests
