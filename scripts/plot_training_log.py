"""Draw the demo model's loss curve from the logs of scripts/train_demo_model.py, stages end to end.

    python scripts/plot_training_log.py --out benchmarks/results/YYYY-MM-DD/demo_training_loss.png STAGE1.log[:LAST_STEP] STAGE2.log ...

Each log's "step N/M  loss X ..." lines (a 20-step mean) are drawn after the previous stage's last step;
`:LAST_STEP` cuts a stage at the checkpoint the next stage started from.
"""

import re
import sys
from pathlib import Path


from vismmoe_kt.apps.plots import line_png
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

STEP_LINE = re.compile(r"^step (\d+)/\d+\s+loss ([0-9.]+)")


def read_stage(spec: str) -> list[tuple[int, float]]:
    path, _, last = spec.partition(":")
    points = [(int(m.group(1)), float(m.group(2))) for m in map(STEP_LINE.match, Path(path).read_text().splitlines()) if m]
    return [p for p in points if not last or p[0] <= int(last)]


def main():
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--title", default="demo model training loss (answer tokens + router aux loss), 20-step means",
                        help="the plot's title")
    parser.add_argument("logs", nargs="+", metavar="LOG[:LAST_STEP]",
                        help="training logs, one per stage in order; :LAST_STEP cuts a stage there")
    args = parser.parse_args()
    series, offset = {}, 0
    for number, spec in enumerate(args.logs, 1):
        points = read_stage(spec)
        if not points:
            raise SystemExit(f"{spec}: no 'step N/M loss X' lines")
        series[f"stage {number}"] = ([offset + s for s, _ in points], [loss for _, loss in points])
        offset += int(spec.partition(":")[2] or points[-1][0])
    line_png(series, args.out, args.title, x_label="steps", y_label="loss", log_y=True)
    print(args.out)


if __name__ == "__main__":
    main()
