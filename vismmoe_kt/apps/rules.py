"""`vismmoe-kt rules`: the generated rule files. `list` shows every family's placements, `show` prints one as
YAML (the family named, or read from a checkpoint's config.json, or the demo's), `write` regenerates
optimize_rules/ (what the checked-in files are; a test checks they agree with the generator)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.placements import (FAMILIES, PLACEMENT_HELP, PLACEMENTS, facts_of, family_of_model, placements_of,
                               rule_file_name)
from ..core.rule_text import rule_text
from ..operators.routing_source import parse_spec
from .arguments import RawHelpFormatter

RULES_DIR = Path(__file__).resolve().parents[2] / "optimize_rules"


def add_parser(commands) -> None:
    rules = commands.add_parser("rules", help="list the placements, print one's rule file, regenerate them",
                                description=__doc__, formatter_class=RawHelpFormatter)
    actions = rules.add_subparsers(dest="rules_command", required=True, metavar="ACTION",
                                   help="list | show | write")
    actions.add_parser("list", help="every family and its placements (each one a rule file under optimize_rules/)")
    show = actions.add_parser("show", help="print a placement's rules as YAML (a starting point for your own file)")
    show.add_argument("--placement", required=True,
                      help=f"one of: {', '.join(PLACEMENTS)} (`vismmoe-kt rules list` shows each family's)")
    which = show.add_mutually_exclusive_group(required=True)
    which.add_argument("--model_path", help="the family of this checkpoint (its config.json's model_type)")
    which.add_argument("--demo", action="store_true", help="the embedded demo model's family (qwen3vl)")
    which.add_argument("--family", help=f"a family by name: {', '.join(FAMILIES)}")
    show.add_argument("--routing", metavar="SOURCE",
                      help="put a routing source on the routers first (benchmarks on random weights: synthetic[:SEED] "
                           "or trace:PATH replace the routers' choice; model keeps it)")
    write = actions.add_parser("write", help="regenerate every family's rule files")
    write.add_argument("--out", default=str(RULES_DIR), help="the folder to write them to")


def family_of(args) -> str:
    if args.family:
        return facts_of(args.family).family
    if args.demo:
        return "qwen3vl"  # the demo model is a tiny Qwen3-VL-MoE
    return family_of_model(args.model_path)


def run(args) -> int:
    if args.rules_command == "list":
        width = max(map(len, FAMILIES))
        for family in FAMILIES:
            print(f"{family:<{width}}  {' '.join(placements_of(family))}")
        print("\nplacements:")
        for name in PLACEMENTS:
            print(f"  {name:<8} {PLACEMENT_HELP[name]}")
        print(f"\n{FAMILIES['qwen3vl'].family}'s vismmoe is optimize_rules/qwen3vl.yaml, its lru "
              "optimize_rules/qwen3vl-lru.yaml, and so on; `vismmoe-kt rules show --placement NAME --family F` "
              "prints one")
        return 0
    if args.rules_command == "show":
        if args.routing is not None:
            parse_spec(args.routing)  # a clear error for a bad source, before any output
        sys.stdout.write(rule_text(family_of(args), args.placement, args.routing))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for family in FAMILIES:
        for placement in placements_of(family):
            (out / rule_file_name(family, placement)).write_text(rule_text(family, placement), encoding="utf-8")
    print(f"wrote {sum(len(placements_of(f)) for f in FAMILIES)} rule files to {out}", file=sys.stderr)
    return 0
