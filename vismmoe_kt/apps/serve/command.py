"""`vismmoe-kt serve`: the flags, the app they describe, and uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ...engine.runner import PREFILL_BUDGET
from ...errors import InputError
from ..flags import POSITIVE, PORT, TEMPERATURE, TOP_P, add_model_flags, at_least, checked, load_from_args


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="OpenAI- and Ollama-compatible HTTP server with a web chat page")
    add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=PORT, default=10002, help="TCP port to listen on")
    serve.add_argument("--api_key", help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--max_new_tokens", type=int, default=1000,
                       help="longest answer a request may ask for (max_tokens, options.num_predict) and the default")
    serve.add_argument("--temperature", type=TEMPERATURE, help="default sampling temperature when a request gives none "
                                                                "(0 or unset: greedy)")
    serve.add_argument("--top_p", type=TOP_P, help="default nucleus sampling mass when a request gives none (unset: 1.0)")
    serve.add_argument("--max_queue", type=at_least(0), default=8, help="requests that may wait (for a slot, beside the --max_batch running ones); more get 429")
    serve.add_argument("--max_batch", type=at_least(1), default=1,
                       help="requests decoded together (continuous batching); more than 1 needs the lean decode path, "
                            "i.e. rules with a VisDecoder, which --demo without rules brings (default 1: one at a time; "
                            "a model without that path runs transformers' loop, one at a time)")
    serve.add_argument("--slot_tokens", type=at_least(2), default=4096,
                       help="on the lean decode path: the tokens (prompt and answer) each running request's KV slot "
                            "holds, --max_batch 1 included (default: %(default)s; at most the model's context)")
    serve.add_argument("--prefill_chunk", type=checked(int, lambda v: v == 0 or v >= 2, "0 (whole prompts) or at least 2"),
                       default=0,
                       help="on the lean decode path: prompt tokens prefilled per step beside the running requests' "
                            "decode (default 0: whole prompts, which measured faster on an H200: an eager prefill "
                            "forward costs about the same for 128 tokens as for 800; rules that prune visual tokens "
                            "prefill whole)")
    serve.add_argument("--prefill_budget", type=at_least(0), default=PREFILL_BUDGET,
                       help="on the lean decode path, with whole prompts: new prompts waiting together are prefilled in "
                            "one forward, their images through one vision-tower call, up to this many tokens "
                            "(default: %(default)s; 0: one prompt per step)")
    serve.add_argument("--data_parallel", action="store_true",
                       help="under torchrun with the expert-parallel rules: every rank serves requests of its own "
                            "on --port + its rank (continuous batching on each), the ranks' passes in step; without "
                            "it rank 0 serves and the other ranks lend it their experts")
    serve.add_argument("--limit_mm_per_prompt", type=at_least(0), default=4, help="images per request")
    serve.add_argument("--max_image_mb", type=POSITIVE, default=20, help="largest image a request may carry, in MB")
    serve.add_argument("--allowed_local_media_path", help="serve image_url file paths under this directory")
    serve.add_argument("--max_image_pixels", type=at_least(1), default=16_777_216,
                       help="larger images are refused before they are decoded (default: 16.8 M, the processor's own maximum)")
    serve.add_argument("--max_body_mb", type=POSITIVE,
                       help="larger request bodies get 413 (default: room for the images allowed plus 8 MiB of text)")
    serve.add_argument("--no_access_log", action="store_true",
                       help="do not print the access log (one line per request on stderr: client, method, path, "
                            "status, tokens, duration; never the prompt)")
    serve.add_argument("--header_timeout", type=POSITIVE, default=10.0,
                       help="seconds a client may take to send a request's headers, from connecting (or from its next "
                            "request's first byte); then 408 and the connection closes (uvicorn has no such limit)")
    serve.add_argument("--body_timeout", type=POSITIVE, default=30.0,
                       help="seconds a request body may stall (no bytes arriving) before 408 and the connection closes")
    serve.add_argument("--shutdown_timeout", type=POSITIVE, default=5.0,
                       help="seconds SIGTERM waits for running requests before it cancels them and exits")
    serve.add_argument("--allowed_hosts", nargs="+", metavar="HOST",
                       help="Host header names to answer, '*' for any (default: loopback names when --host is "
                            "loopback, which stops DNS-rebinding pages; any otherwise)")


def build_server(args: argparse.Namespace):
    """The app for these flags (tests start it on a free port)."""
    from ...demo.tiny import BATCHING_RULES
    from .app import create_app
    from .engine import Engine
    from .guard import default_allowed_hosts
    from .inputs import Limits

    if args.max_new_tokens < 1:  # as chat and eval say it
        raise InputError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    batching_demo = args.demo and args.max_batch > 1 and not args.optimize_config_path
    model, processor = load_from_args(args, BATCHING_RULES if batching_demo else None)
    from ...parallel import launch

    group = launch.joined if args.data_parallel else None
    if args.data_parallel and group is None:
        raise InputError("--data_parallel needs a torchrun launch with the expert-parallel rules: "
                         "torchrun --nproc-per-node N -m vismmoe_kt serve --data_parallel ...")
    name = "vismmoe-demo" if args.demo else Path(args.model_path).name
    limits = Limits(args.limit_mm_per_prompt, int(args.max_image_mb * 2**20), args.allowed_local_media_path,
                    args.max_image_pixels, int(args.max_body_mb * 2**20) if args.max_body_mb else None)
    try:
        engine = Engine(model, processor, name, args.max_new_tokens, args.temperature, args.top_p, args.max_queue,
                        limits, max_batch=args.max_batch, slot_tokens=args.slot_tokens,
                        prefill_chunk=args.prefill_chunk or None, prefill_budget=args.prefill_budget, group=group)
    except ValueError as exc:  # batching asked of a model without the lean decode path
        if args.max_batch == 1 and group is None:
            raise
        raise InputError(f"{f'--max_batch {args.max_batch}' if args.max_batch > 1 else '--data_parallel'}: {exc}") \
            from None
    hosts = args.allowed_hosts or default_allowed_hosts(args.host)
    return create_app(engine, limits, args.api_key, hosts, body_timeout=args.body_timeout)


def log_access(enabled: bool) -> None:
    """The access log (apps/serve/access.py) on stderr; uvicorn's own access log stays off (log_level warning)."""
    access = logging.getLogger("vismmoe_kt.serve.access")
    access.propagate = False
    if not enabled:
        access.disabled = True
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    from . import listen

    # data parallel: a port per rank; the rank is torchrun's RANK, known before the group is joined
    rank = int(os.environ.get("RANK", "0")) if args.data_parallel else 0
    sockets = listen.bind(args.host, args.port + rank)  # before the model loads: a port in use fails at once
    try:
        app = build_server(args)
        log_access(not args.no_access_log)
        port = sockets[0].getsockname()[1]  # --port 0: the one the system chose
        where = f"rank {rank} " if args.data_parallel else ""
        print(f"{where}serving on http://{listen.address(args.host, port)}  (web chat at /, OpenAI API at /v1)",
              file=sys.stderr)
        try:
            listen.server(app, header_timeout=args.header_timeout,
                          shutdown_timeout=args.shutdown_timeout).run(sockets=sockets)
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on: a clean stop, as uvicorn.run has it
            pass
        finally:
            leave = getattr(app.state.engine, "leave_group", None)
            if leave is not None:  # every rank leaves at one round of the group, before it is torn down
                leave()
    finally:
        for sock in sockets:
            sock.close()
    return 0
