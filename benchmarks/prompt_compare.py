"""Several configurations' prompts side by side, layer by layer: where one falls behind another.

    python -m benchmarks.prompt_compare DIR [DIR ...] [--prompt "448 px"] [--layers 0 1 2 4 8 16 32 47]

Each DIR holds a `prompt_timeline.json` (benchmarks/prompt_timeline.py, one configuration). For the prompt named
(default: the first each file has), the median prefill over the timed runs, then for a few layers when the host
finished issuing the layer and when the GPU finished running it (ms from the prompt's start, the last timed
run's marks). A configuration whose GPU ends fall behind another's from some layer on loses its time there; one
whose host ends come close to its GPU ends is bound by the host there (its slower host work is the thing to
shorten), one far behind its GPU by the GPU (copies or kernels).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.results import print_table
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

LAYERS = (0, 1, 2, 4, 8, 16, 24, 32, 40, 47)
# the link's figures (prompt_timeline's `link` of each run, medians over the runs), as the table names them
LINK_ROWS = {"first_copy_ms": "link: first copy starts", "last_copy_end_ms": "link: last copy ends",
             "busy_ms": "link: busy", "idle_host_ms": "link: idle, next copy not issued yet",
             "idle_waiting_ms": "link: idle, next copy waiting on compute"}


def layer_ends(path: str | Path, prompt: str | None = None) -> tuple[str, dict]:
    """(the configuration's name, {"prefill_ms": median, "ends": {stage: (host ms, GPU ms or None)}}) from one
    prompt_timeline.json; `prompt`: which of its prompts (default its first)."""
    file = Path(path) / "prompt_timeline.json" if Path(path).is_dir() else Path(path)
    if not file.exists():
        raise SystemExit(f"{path}: no prompt_timeline.json (run benchmarks.prompt_timeline --out {path} first)")
    result = json.loads(file.read_text())
    prompts = result["prompts"]
    label = prompt or next(iter(prompts), None)
    if label not in prompts:
        raise SystemExit(f"{file}: no prompt {label!r} (it has {', '.join(prompts) or 'none'})")
    timed = prompts[label]
    ends = {m["stage"]: (m["host_ms"], m["gpu_ms"]) for m in timed["last_marks"] if m["edge"] == "end"}
    links = [r["link"] for r in timed["runs"] if r.get("link", {}).get("batches")]
    link = {key: statistics.median(link[key] for link in links) for key in LINK_ROWS} if links else {}
    return result.get("config", str(path)), {"prefill_ms": statistics.median(r["prefill_ms"] for r in timed["runs"]),
                                             "ends": ends, "link": link}


def compare(paths: list[str], prompt: str | None = None,
            layers: tuple[int, ...] = LAYERS) -> tuple[list[str], list[list[str]]]:
    """(the configurations' names, the table's rows: the prefill, then each layer's host and GPU ends per
    configuration; "-" where a configuration has no such layer, or no GPU times: a CPU run)."""
    runs = [layer_ends(path, prompt) for path in paths]
    rows = [["prefill (median)"] + [f"{run['prefill_ms']:.1f}" for _, run in runs]]
    for layer in layers:
        stage = f"layer {layer}"
        cells = []
        for _, run in runs:
            host, gpu = run["ends"].get(stage, (None, None))
            cells.append("-" if host is None else f"{host:.1f} / {gpu:.1f}" if gpu is not None else f"{host:.1f} / -")
        rows.append([f"{stage} ends, host / GPU"] + cells)
    if any(run["link"] for _, run in runs):  # streamed or fetched experts: where the link sat idle
        for key, label in LINK_ROWS.items():
            rows.append([label] + [f"{run['link'][key]:.1f}" if run["link"] else "-" for _, run in runs])
    return [name for name, _ in runs], rows


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="prompt_timeline output directories (or their prompt_timeline.json)")
    parser.add_argument("--prompt", help="which prompt (e.g. \"448 px\", \"text 508\"; default: each file's first)")
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS), help="layers to show (ms at their end)")
    args = parser.parse_args(argv)
    names, rows = compare(args.dirs, args.prompt, tuple(args.layers))
    print_table(["ms from the prompt's start"] + names, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
