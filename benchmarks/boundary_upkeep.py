"""The decode boundary's host work per step, on the CPU proxy of Qwen3-VL-30B-A3B (48 layers x 128 experts,
top-8, toy widths: `proxy-48x128`), routing synthetic (seed 0), for each `reservations` order of the plan.

    python -m benchmarks.boundary_upkeep [--rules optimize_rules/qwen3vl-lru.yaml ...] [--slabs 2427]
        [--decode_tokens 48] [--out DIR]

The table step of a GPU waits in `before_step` for whatever host work runs there (the device is idle until the
next step is launched), while `after_step` runs once the step is queued, beside the device's work. This times
both hooks (median over the decode steps after the first three) and the decode hit rate, at a slab count
(2427: what 6 GiB of Q4_K slabs hold for the real model, 40% of its 6016 experts), for:

    before-step   each step's landings reserved in `before_step`, after reading the step before's records
    ahead         reserved in the `after_step` of the step before, from the records of the one before that

On this proxy a step's compute is the CPU's too, so the wall time per step is not a GPU's; the hooks' host
time is the part a GPU machine's host would spend (scaled by its faster cores). The tokens must agree.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from benchmarks import proxy
from benchmarks.results import print_table, save_json
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

MODES = ("before-step", "ahead")


class HookTimer:
    """Wall time of each DecodeBoundary hook call (a wrapper on the class's methods while it is installed)."""

    def __init__(self):
        from vismmoe_kt.runtime.decode_boundary import DecodeBoundary

        self.cls, self.times = DecodeBoundary, {"before": [], "after": []}
        self.originals = {name: getattr(DecodeBoundary, f"{name}_step") for name in self.times}

    def __enter__(self):
        for name, original in self.originals.items():
            def timed(boundary, original=original, spent=self.times[name]):
                start = time.perf_counter()
                original(boundary)
                spent.append(time.perf_counter() - start)
            setattr(self.cls, f"{name}_step", timed)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(self.cls, f"{name}_step", original)


def measure(model_dir: Path, rules: str, slabs: int, mode: str, decode_tokens: int, expert_bytes: int) -> dict:
    from vismmoe_kt import load
    from vismmoe_kt.demo.pictures import make_image
    from vismmoe_kt.engine.generation import generate
    from vismmoe_kt.engine.inputs import build_inputs, user_turn
    from vismmoe_kt.operators.source_router import install_routing

    with HookTimer() as timer:  # before the load: the runtime binds its hooks as it enables the table
        model, processor = load(str(model_dir), rules, expert_budget=slabs * expert_bytes, reservations=mode,
                                generate_device="cpu", prefill_device="cpu", progress=False)
        install_routing(model, "synthetic:0")
        runtime = model.vismmoe.context.offload_runtime
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(224, seed=1)], "cpu")
        with torch.no_grad():
            tokens = generate(model, inputs, decode_tokens + 1)
    decode = runtime.counters["decode"].values()
    pairs = sum(c.hits + c.misses + c.late for c in decode)
    skip = 3  # decode's start (the table built, the first reservations) is not a step's upkeep
    runtime.close()
    return {"rules": rules, "reservations": mode, "plan": runtime.plan.reservations, "slabs": runtime.num_slabs,
            "pinned_layers": len(runtime.pinned), "steps": len(timer.times["before"]),
            "before_step_ms": round(statistics.median(timer.times["before"][skip:]) * 1e3, 3),
            "after_step_ms": round(statistics.median(timer.times["after"][skip:]) * 1e3, 3),
            "decode_hit_rate": round(sum(c.hits for c in decode) / pairs, 4) if pairs else None,
            "tokens": tokens[0, inputs["input_ids"].shape[1]:].tolist()}


def parse_args(argv=None):
    p = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    proxy.add_arguments(p, "each with both reservation orders", "boundary_upkeep.json")
    p.add_argument("--decode_tokens", type=int, default=48, help="decoded tokens per run")
    args = p.parse_args(argv)
    if args.slabs < 128 or args.decode_tokens < 8:
        p.error("--slabs must be at least one layer's 128 experts and --decode_tokens at least 8")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with proxy.saved_proxy(args.threads) as (model_dir, expert_bytes):
        for rules in args.rules:
            for mode in MODES:
                rows.append(measure(model_dir, rules, args.slabs, mode, args.decode_tokens, expert_bytes))
    print_table(["rules", "reservations", "slabs", "pinned", "before_step ms", "after_step ms", "decode hits"],
                [[Path(r["rules"]).stem, r["plan"], r["slabs"], r["pinned_layers"], r["before_step_ms"],
                  r["after_step_ms"], r["decode_hit_rate"]] for r in rows])
    for rules in args.rules:
        runs = [r for r in rows if r["rules"] == rules]
        print(f"{Path(rules).stem}: tokens {'agree' if len({tuple(r['tokens']) for r in runs}) == 1 else 'DIFFER'}")
    save_json(args.out, "boundary_upkeep.json", {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
