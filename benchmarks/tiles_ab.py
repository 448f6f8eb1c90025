"""A prompt timed under kernel-tuning alternatives in turn, in one process with one model load.

    PYTHONPATH=. python3 -m benchmarks.tiles_ab --config CONFIG --out FILE [--rounds 4] [--image-size 448]
        [--text-tokens 508] [--alt NAME=KEY:JSON ...] [--tiny NAME --device cpu]

Each alternative overrides tuning.json keys (`tuning.overridden`) while the same request is prefilled. The rounds
go A B, then B A, and so on, so a machine whose speed drifts moves every alternative alike: on a shared H100 the
same code's resident 448 px prompt took 0.057 s in one process and 0.116 s in the next, which separate processes
ordered A, B would have carried into the comparison. Each alternative is warmed once per request first (its
kernels compiled, the vision tower's graph captured). The default alternatives (`default_alternatives`): the
device's committed quantized_prefill tiles, the tokens-first tiles the H100's entry held before the weights-first
ones, the weights-first tiles (the device's, else the H100's), and those prefetching a step ahead
("weights-ahead"), each only where it differs from the ones before it.

`--launches`: instead, the committed tiles with the Triton kernels launched through their compiled launcher
(kernel_launch, as the package runs) against every launch through Triton's own path, alternated the same way.

Routing of every figure: the configuration's, synthetic unless --routing says otherwise (printed beside the
results). Measurement only: nothing here changes tuning.json.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path
from typing import Iterator

import torch

import kernel_launch
from benchmarks.bench.prompt_setup import add_prompt_flags, check_prompt_flags, load_prompt_model, prompt_requests
from benchmarks.bench.timing import timed_generate
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.runtime.kernels import quantized_major, tuning

COMMITTED = "committed"
THROUGH_TRITON = "through Triton"  # --launches: the alternative whose launches take Triton's own path
# what the H100's quantized_prefill held before the weights-first tiles (benchmarks/results/kernel-tuning.md)
TOKENS_FIRST = {"block_m": 32, "gate_up": [64, 4, 1], "down": [128, 4, 1]}
# the H100's weights-first tiles (kernel-tuning.md), for a device whose entry has none
WEIGHTS_FIRST = {"block_m": 32, "gate_up": [128, 4, 1, 64, "weights"], "down": [128, 4, 1, 64, "weights"],
                 "long": {"from_pairs_per_expert": 32, "block_m": 64, "gate_up": [128, 4, 1, 64, "weights"],
                          "down": [128, 4, 1, 64, "weights"]}}


def weights_first_tiles(entry: dict) -> list[list]:
    """The tiles of a quantized_prefill entry (its `long` ones too) whose order puts the weights first."""
    return [tiles[part] for tiles in (entry, entry.get("long") or {}) for part in ("gate_up", "down")
            if len(tiles.get(part, ())) == 5 and tiles[part][4] in quantized_major.WEIGHTS_FIRST]


def in_order(entry: dict, order: str) -> dict:
    """A quantized_prefill entry with every weights-first tile in `order`."""
    out = json.loads(json.dumps(entry))
    for tile in weights_first_tiles(out):
        tile[4] = order
    return out


def default_alternatives(committed: dict) -> dict[str, tuple[str, dict] | None]:
    """The device's committed quantized_prefill, the tokens-first tiles, the weights-first ones (the device's
    own, else the H100's) and the same prefetching a step ahead: those that differ from one before them."""
    committed = json.loads(json.dumps(committed))  # tuples as JSON's lists, as the others are written
    weights = in_order(committed if weights_first_tiles(committed) else WEIGHTS_FIRST, "weights")
    candidates = {COMMITTED: committed, "tokens first": TOKENS_FIRST, "weights first": weights,
                  "weights ahead": in_order(weights, "weights-ahead")}
    alternatives, seen = {}, set()
    for name, entry in candidates.items():
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            alternatives[name] = None if name == COMMITTED else ("quantized_prefill", entry)
    return alternatives


@contextlib.contextmanager
def launches_through_triton() -> Iterator[None]:
    """Within the block every kernel launcher made so far takes Triton's own path (the warm-up, run first under the
    direct launches, made them all)."""
    launchers = list(kernel_launch._LAUNCHERS.values())
    direct = [launcher.direct for launcher in launchers]
    for launcher in launchers:
        launcher.direct = False
    try:
        yield
    finally:
        for launcher, was in zip(launchers, direct):
            launcher.direct = was


def parse_alternative(text: str) -> tuple[str, str, object]:
    """`NAME=KEY:JSON` -> (name, tuning key, value); a wrong one raises ValueError naming what is wrong."""
    name, equals, rest = text.partition("=")
    key, colon, value = rest.partition(":")
    if not (name and equals and key and colon):
        raise ValueError(f"--alt {text!r}: expected NAME=KEY:JSON, e.g. before=quantized_prefill:{json.dumps(TOKENS_FIRST)}")
    known = tuning.entry(tuning.DEFAULT)
    if key not in known:
        raise ValueError(f"--alt {text!r}: {key!r} is not a tuning key ({', '.join(sorted(known))})")
    try:
        return name, key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--alt {text!r}: its value is not JSON ({exc.msg} at column {exc.colno})") from None


def rounds_order(names: list[str], rounds: int) -> list[str]:
    """The alternatives' turns: every round each once, in order, reversed every other round (A B, B A, ...)."""
    return [name for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def summarize(times: list[tuple[str, str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """(alternative, request, seconds) rows -> per request, per alternative: median, min, max, count."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for request in dict.fromkeys(r for _, r, _ in times):
        out[request] = {}
        for name in dict.fromkeys(n for n, _, _ in times):
            seconds = [s for n, r, s in times if n == name and r == request]
            if not seconds:  # not timed on this request
                continue
            out[request][name] = {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
                                  "n": len(seconds)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    add_prompt_flags(parser)
    parser.add_argument("--out", required=True, help="the JSON file for the results")
    parser.add_argument("--rounds", type=int, default=4, help="turns of every alternative per request (default 4)")
    parser.add_argument("--alt", action="append", default=[], metavar="NAME=KEY:JSON",
                        help="an alternative: tuning key KEY set to JSON (repeatable; default: the committed "
                             "quantized_prefill, the tokens-first, weights-first and weights-ahead tiles: default_alternatives)")
    parser.add_argument("--launches", action="store_true",
                        help="instead of tiles: the kernels launched through their compiled launcher against through "
                             "Triton's own path, the committed tiles")
    args = parser.parse_args(argv)
    if args.launches and args.alt:
        parser.error("--launches times the launch paths with the committed tiles: give no --alt beside it")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    check_prompt_flags(parser, args)
    try:
        alternatives = {name: (key, value) for name, key, value in map(parse_alternative, args.alt)}
    except ValueError as exc:
        parser.error(str(exc))
    if args.launches:
        alternatives = {"direct launches": None, THROUGH_TRITON: THROUGH_TRITON}
    elif not alternatives:
        alternatives = default_alternatives(tuning.get("quantized_prefill", args.device))
    model, processor = load_prompt_model(parser, args, "tiles-ab-")
    requests = prompt_requests(processor, args)

    def prefill(name: str, request: dict) -> float:
        override = alternatives[name]
        with launches_through_triton() if override == THROUGH_TRITON else \
                tuning.overridden(**({override[0]: override[1]} if override else {})):
            return timed_generate(model, request, 1).prefill_s

    times = []
    for label, request in requests.items():
        for name in alternatives:  # warm: compiled, captured
            prefill(name, request)
        for name in rounds_order(list(alternatives), args.rounds):
            times.append((name, label, prefill(name, request)))
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    result = {"device": device, "config": args.config, "routing": args.routing, "rounds": args.rounds,
              "alternatives": {name: "tuning.json as committed, every launch through Triton" if override == THROUGH_TRITON
                               else list(override) if override else "tuning.json as committed"
                               for name, override in alternatives.items()},
              "committed_quantized_prefill": tuning.get("quantized_prefill", args.device),
              "prefill_s": summarize(times), "runs": times}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for label, rows in result["prefill_s"].items():
        print(f"{label} (routing {args.routing}): " + "; ".join(
            f"{name} {row['median']:.4f} s (min {row['min']:.4f}, max {row['max']:.4f}, n {row['n']})"
            for name, row in rows.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
