"""`python -m benchmarks.bench`: the flags (`--help`), then `run`, with the `vismmoe-kt` commands' exit statuses."""

from __future__ import annotations

import sys

from vismmoe_kt.apps.cli import run_command

from benchmarks.bench import build_parser, run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded beside the results
    return run_command(run, args)


if __name__ == "__main__":
    sys.exit(main())
