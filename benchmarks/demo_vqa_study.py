"""Accuracy studies on the trained demo model (synthetic shapes VQA; not MME or POPE).

    python3 -m benchmarks.demo_vqa_study --out benchmarks/results/YYYY-MM-DD/demo-vqa [--limit 200] [--split test] [--calibrate 120]

Runs `vismmoe-kt eval --demo` (in process, the same code path as the command line) for:
  compression  none at keep ratio 1.0, and random / saliency / affinity at 0.7 and 0.5, with
               optimize_rules/qwen3vl.yaml and prune_layer=1 (the 4-layer demo model fits on any GPU, so
               the pinned prefix would cover every layer and nothing would be pruned; one layer of prefix
               is the smallest that lets affinity see routing); accuracy per question type and the mean
               number of distinct experts each layer uses in a prefill (the expert working set);
  precision    optimize_rules/qwen3vl-realb.yaml with mode bf16 (no quantisation; the reference),
               all (every expert in emulated NVFP4), realb (AIMD M_d) and fixed M_d = 0.5, with
               lb_gate_tokens=64 so that ReaLB acts on these ~100-token prompts (half of them visual:
               the default M_d of 0.9 rarely finds a rank that vision-heavy);
and, with --calibrate N, `vismmoe-kt calibrate` on N VQA images and their questions, for the Hot Recall of
a lookahead predictor trained on this model's routing. Writes one JSON per run, summary.json and
summary.md (the tables for BENCHMARKS.md).
"""

import json
import sys
import time
from pathlib import Path


from vismmoe_kt.apps.cli import main as cli
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

COMPRESSION = [("none", 1.0)] + [(m, k) for k in (0.7, 0.5) for m in ("random", "saliency", "affinity")]
PRECISION = {"bf16": ["mode=bf16"], "fp4-all": ["mode=all"], "realb": ["mode=realb", "lb_gate_tokens=64"],
             "realb-fixed-0.5": ["mode=fixed", "fixed_threshold=0.5", "lb_gate_tokens=64"]}


def eval_args(rules: str, sets: list[str], args, out: Path) -> list[str]:
    flags = [f for s in sets for f in ("--set", s)]
    return ["eval", "--demo", "--optimize_config_path", rules, *flags, "--split", args.split, "--limit", str(args.limit),
            "--cpu_infer", str(args.threads), "--output", str(out)]


def run(name: str, argv: list[str], out: Path) -> dict:
    print(f"== {name}: vismmoe-kt {' '.join(argv)}", flush=True)
    if cli(argv) != 0:
        raise SystemExit(f"{name} failed")
    result = json.loads(out.read_text())
    result["command"] = "vismmoe-kt " + " ".join(argv)
    return result


def working_set(result: dict) -> str:
    return ", ".join(f"{v:.1f}" for v in result["experts_per_layer_prefill"])


def low_precision_share(result: dict) -> str:
    ops = result["stats"]["operators"]["MixedPrecisionExperts"]
    return f"{100 * ops['lowprec_pairs'] / max(ops['pairs'], 1):.1f}%"


def table(rows: list[tuple[str, dict]], first: str, last: str, cell) -> list[str]:
    """Accuracy overall and per question type, one row per run, and a last column from `cell(result)`."""
    types = sorted(rows[0][1]["per_type"])
    lines = [f"| {first} | all | " + " | ".join(types) + f" | {last} |", "|" + "---|" * (len(types) + 3)]
    for label, r in rows:
        cells = [f"{r['per_type'][t]['accuracy']:.3f}" for t in types]
        lines.append(f"| {label} | {r['accuracy']:.3f} | " + " | ".join(cells) + f" | {cell(r)} |")
    return lines


def calibrate(args, out: Path) -> dict:
    from vismmoe_kt.demo.vqa import make_example

    data = out / "calibration-data"
    (data / "images").mkdir(parents=True, exist_ok=True)
    questions = []
    for index in range(args.calibrate):
        example = make_example(3, index)  # seed 3: neither the training split nor the test split
        example.image.save(data / "images" / f"{index:04d}.png")
        questions.append(example.question.text)
    (data / "prompts.txt").write_text("\n".join(questions) + "\n")
    argv = ["calibrate", "--demo", "--images", str(data / "images"), "--prompts", str(data / "prompts.txt"),
            "--decode_tokens", "4", "--out", str(out / "calibration"), "--cpu_infer", str(args.threads)]
    print(f"== calibrate: vismmoe-kt {' '.join(argv)}", flush=True)
    if cli(argv) != 0:
        raise SystemExit("calibrate failed")
    report = json.loads((out / "calibration" / "calibration.json").read_text())
    report["command"] = "vismmoe-kt " + " ".join(argv)
    return report


def main():
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for one JSON per run, summary.json and summary.md")
    parser.add_argument("--split", default="test", help="VQA split evaluated (`vismmoe-kt eval --split`)")
    parser.add_argument("--limit", type=int, default=200, help="questions per run")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (`--cpu_infer` of each run)")
    parser.add_argument("--calibrate", type=int, default=0, metavar="N", help="also calibrate a predictor on N requests")
    parser.add_argument("--only", choices=["compression", "precision"], help="run one study")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary, md = {}, [f"Synthetic shapes VQA, split {args.split}, {args.limit} questions per row (types cycled)."]
    if args.only in (None, "compression"):
        rows = []
        for method, keep in COMPRESSION:
            sets = [f"compression={method}", f"keep_ratio={keep}", "prune_layer=1"]
            path = out / f"compression-{method}-{keep}.json"
            rows.append((f"{method} {keep}", run(f"{method} {keep}", eval_args("optimize_rules/qwen3vl.yaml", sets, args, path), path)))
        summary["compression"] = {label: {k: r[k] for k in ("accuracy", "per_type", "experts_per_layer_prefill", "command")}
                                  for label, r in rows}
        md += ["", "Compression (keep ratio of visual tokens after layer 1):", ""]
        md += table(rows, "method, keep ratio", "distinct experts per layer in a prefill (mean)", working_set)
    if args.only in (None, "precision"):
        rows = []
        for name, sets in PRECISION.items():
            path = out / f"precision-{name}.json"
            result = run(name, eval_args("optimize_rules/qwen3vl-realb.yaml", sets, args, path), path)
            rows.append((name, result))
        summary["precision"] = {label: {**{k: r[k] for k in ("accuracy", "per_type", "command")},
                                        "low_precision_share": low_precision_share(r)} for label, r in rows}
        md += ["", "Expert precision (emulated NVFP4 on the CPU):", ""]
        md += table(rows, "mode", "token-expert pairs in NVFP4", low_precision_share)
    if args.calibrate:
        report = calibrate(args, out)
        summary["calibration"] = report
        md += ["", f"Hot Recall on validation requests ({report['requests']} requests, 80/20 split), @10/@20/@30 of 32 experts:", "",
               "| predictor | all | prefill | decode |", "|---|---|---|---|"]
        for name in ("predictor", "history_only", "random"):
            cells = ["/".join(f"{100 * v:.1f}" for v in report[name].get(p, {}).values()) or "-" for p in ("all", "prefill", "decode")]
            md.append(f"| {name} | " + " | ".join(cells) + " |")
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
