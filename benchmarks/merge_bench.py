"""One table and chart from several `python -m benchmarks.bench` runs (the parts of scripts/bench_h200.sh).

    python3 -m benchmarks.merge_bench OUT_DIR part1/bench.json part2/bench.json ...

Rows keep their order; each part's measured copy bandwidth is printed, since every part measured its
own. Writes OUT_DIR/bench.json ({"parts": [meta, ...], "rows": [...]}) and OUT_DIR/bench.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.bench.report import describe_meta, markdown_table, write_outputs
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("out", help="directory for the merged bench.json and bench.png")
    parser.add_argument("parts", nargs="+", help="bench.json files")
    args = parser.parse_args(argv)
    metas, rows = [], []
    for path in args.parts:
        try:
            part = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 2
        metas.append(part["meta"])
        rows += [dict(row, part=path) for row in part["rows"]]
    for path, meta in zip(args.parts, metas):
        print(f"## {path}\n{describe_meta(meta)}\n")
    print(markdown_table(rows))
    write_outputs(Path(args.out), metas[0], rows, None)
    merged = Path(args.out) / "bench.json"
    merged.write_text(json.dumps({"parts": metas, "rows": rows}, indent=2))
    print(f"wrote {merged} and {Path(args.out) / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
