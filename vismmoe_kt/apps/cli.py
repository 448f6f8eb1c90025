"""`vismmoe-kt`: parse the command line and hand it to the command's module.

Each command lives in its own module with `add_parser(commands)` and `run(args) -> int`: chat,
calibrate, serve, eval, trace, rules, convert. Errors a user can act on (`VismmoeError`) print `error: ...`
and exit with status 2; usage errors exit 2 through argparse.
"""

from __future__ import annotations

import importlib
import os
import sys

from ..errors import FollowerDone, PeerLostError, VismmoeError
from .arguments import ALIAS_NOTE, FlagParser

COMMANDS = {"chat": "chat", "calibrate": "calibrate", "serve": "serve.command", "eval": "evaluate",
            "trace": "trace", "rules": "rules", "convert": "convert"}  # command -> module under vismmoe_kt.apps


def command_module(name: str):
    return importlib.import_module(f"{__package__}.{COMMANDS[name]}")


def build_parser() -> FlagParser:
    parser = FlagParser(prog="vismmoe-kt", description="Vision-language MoE inference with VisMMOE/ReaLB operators.",
                        epilog=ALIAS_NOTE)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     help="`vismmoe-kt COMMAND --help` describes each")
    for name in COMMANDS:
        command_module(name).add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(command_module(args.command).run, args)


def run_command(run, args) -> int:
    """`run(args)` with the exit statuses above (also `python -m benchmarks.bench`'s)."""
    try:
        return run(args)
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


if __name__ == "__main__":
    sys.exit(main())
