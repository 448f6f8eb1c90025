"""Configurations' prompts (and decodes) in turn, in one process: which is faster, free of the host's drift between
processes.

    PYTHONPATH=. python3 -m benchmarks.prompt_ab --configs BASELINE OTHER [...] --out FILE [--rounds 4]
        [--image-size 896] [--text-tokens 0] [--decode-tokens 127] [--tiny NAME --device cpu] [--layers N]

Every configuration's model is loaded once, side by side (the host must hold each one's expert store, the GPU each
one's budget: two Q4_K stores of Qwen3-VL-30B-A3B fit a 128 GB host, two BF16 ones do not), and warmed at the
decodes' length. Then in each round every configuration in turn (A B, then B A, and so on) runs a request decoding
`--decode-tokens` tokens (its decode rate kept) and then the prompt to its first token, timed: the prompt starts
from the cache a decode left, as decode_bench's repetitions do. Why one process: the shared
GPU machines' hosts ran the same code's prompt up to 1.6x slower in one process than in the next, while the default
rules and `lru` differ by about 1%; here both see the same host at the same minutes. Every configuration runs the same
requests in the same order, so the synthetic routing (seeded per request) routes each alike.

Prints and writes, per prompt and configuration: the prompt's median (min, max) seconds, the decode's median
tokens/s, and against the first configuration the median of the rounds' paired ratios (the two ran next to each
other in a round). Routing: the configurations', synthetic unless --routing says otherwise.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from benchmarks.bench.prompt_setup import add_prompt_flags, check_prompt_flags, load_prompt_model, prompt_requests
from benchmarks.bench.timing import timed_generate, warm_up
from benchmarks.tiles_ab import rounds_order
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter


def paired_ratios(runs: list[dict], baseline: str) -> dict[str, dict[str, float]]:
    """Per configuration other than `baseline`: the median over rounds of its prompt's seconds over the baseline's in
    the same round, and of its decode's tokens/s over the baseline's (None where no decode ran)."""
    by_round: dict[int, dict[str, dict]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["config"]] = run
    out = {}
    for name in dict.fromkeys(run["config"] for run in runs):
        if name == baseline:
            continue
        pairs = [(turns[name], turns[baseline]) for turns in by_round.values() if name in turns and baseline in turns]
        decode = [ours["decode_tok_s"] / base["decode_tok_s"] for ours, base in pairs
                  if ours["decode_tok_s"] and base["decode_tok_s"]]
        out[name] = {"prefill_ratio": statistics.median(ours["prefill_s"] / base["prefill_s"] for ours, base in pairs),
                     "decode_ratio": statistics.median(decode) if decode else None, "rounds": len(pairs)}
    return out


def summarize(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per configuration: the prompt's median, min and max seconds and the decode's median tokens/s."""
    out = {}
    for name in dict.fromkeys(run["config"] for run in runs):
        prefill = [run["prefill_s"] for run in runs if run["config"] == name]
        decode = [run["decode_tok_s"] for run in runs if run["config"] == name and run["decode_tok_s"]]
        out[name] = {"prefill_median_s": statistics.median(prefill), "prefill_min_s": min(prefill),
                     "prefill_max_s": max(prefill), "decode_median_tok_s": statistics.median(decode) if decode else None,
                     "n": len(prefill)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    add_prompt_flags(parser, several=True)
    parser.add_argument("--out", required=True, help="the JSON file for the results")
    parser.add_argument("--rounds", type=int, default=4, help="turns of every configuration per prompt (default 4)")
    parser.add_argument("--decode-tokens", type=int, default=127,
                        help="tokens each turn decodes before its timed prompt (default 127; 0: prompts back to back)")
    args = parser.parse_args(argv)
    if len(args.configs) < 2:
        parser.error("--configs: at least two configurations to compare")
    if len(set(args.configs)) < len(args.configs):
        parser.error("--configs: a configuration is named twice")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    if args.decode_tokens < 0:
        parser.error(f"--decode-tokens {args.decode_tokens}: a count of tokens, 0 or more")
    check_prompt_flags(parser, args)
    models = {}
    for name in args.configs:
        models[name], processor = load_prompt_model(parser, args, "prompt-ab-", name)
        print(f"loaded {name}", flush=True)
    requests = prompt_requests(processor, args)  # the same picture and text whichever processor made them
    runs = []
    for label, request in requests.items():
        for name, model in models.items():  # each warmed at the decodes' length, its routing where the others' is
            if args.decode_tokens:
                warm_up(model, request, args.decode_tokens)
            else:
                timed_generate(model, request, 1)
        for turn, name in enumerate(rounds_order(list(models), args.rounds)):
            model = models[name]
            decode = timed_generate(model, request, args.decode_tokens).decode_tok_s if args.decode_tokens else None
            prefill = timed_generate(model, request, 1).prefill_s
            runs.append({"prompt": label, "round": turn // len(models), "config": name, "prefill_s": prefill,
                         "decode_tok_s": decode})
            print(f"{label}, round {turn // len(models) + 1}, {name}: prompt {prefill * 1e3:.1f} ms"
                  + (f", decode {decode:.2f} tok/s" if decode else ""), flush=True)
    baseline = args.configs[0]
    result = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device,
              "configs": args.configs, "routing": args.routing, "rounds": args.rounds,
              "decode_tokens": args.decode_tokens, "prompts": {}, "runs": runs}
    for label in requests:
        ran = [run for run in runs if run["prompt"] == label]
        result["prompts"][label] = {"summary": summarize(ran), "against_baseline": paired_ratios(ran, baseline)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for label, rows in result["prompts"].items():
        print(f"{label} (routing {args.routing}; {args.rounds} rounds, {args.decode_tokens} tokens decoded before each):")
        for name, row in rows["summary"].items():
            against = rows["against_baseline"].get(name)
            versus = "the baseline" if against is None else (
                f"prompt {against['prefill_ratio']:.3f}x the baseline's"
                + (f", decode {against['decode_ratio']:.3f}x" if against["decode_ratio"] else "") + " (paired medians)")
            decode = f", decode {row['decode_median_tok_s']:.2f} tok/s" if row["decode_median_tok_s"] else ""
            print(f"  {name}: prompt {row['prefill_median_s'] * 1e3:.1f} ms (min {row['prefill_min_s'] * 1e3:.1f}, "
                  f"max {row['prefill_max_s'] * 1e3:.1f}){decode}; {versus}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
