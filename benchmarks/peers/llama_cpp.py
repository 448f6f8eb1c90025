"""llama.cpp's `llama-bench` beside our decode benchmark: the same GGUF file, the GPU memory for experts matched.

    PYTHONPATH=. python3 -m benchmarks.peers.llama_cpp FILE.gguf [--budgets 6GiB 16GiB] [--ncmoe 0,12,24,29,36,48]
        prints, per budget, the `-ncmoe` split whose GPU expert bytes fit it, and per split the budget it is

llama.cpp places routed experts statically by layer: `-ncmoe N` (`--n-cpu-moe N`) keeps the expert tensors
of the FIRST N layers in host memory, computed by the CPU, and the rest on the GPU (its tensor-override
pattern `blk\\.<i>\\.ffn_(up|down|gate|gate_up)_(ch|)exps` for i < N). An expert_budget of ours (bytes of
routed experts on the GPU) therefore maps to the smallest N whose layers N..L-1 fit in it, and a split N to
the bytes of layers N..L-1. A share budget (30%) is that share of the file's expert bytes. Where a
configuration keeps no experts on the GPU (kt-cpu: every routed expert on the CPU) the split is N = L;
where it has no budget at all (hf, gpu) it is N = 0.

`decode_bench --peer llama.cpp --peer_gguf FILE [--llama_bench PATH]` (benchmarks/decode_bench.py) runs
llama-bench after its configurations, at each configuration's split and at 0 and L, with our prompt length
as `-p` and as the decode depth `-d`, our decoded tokens as `-n`, and writes peer_llama_cpp.json and
peer_llama_cpp.md: our decode and prefill tokens/s beside llama.cpp's tg and pp at the matching split.

llama-bench's `-o json` is a list of records, one per test; the fields read here (test::get_fields() and
json_printer in llama.cpp's tools/llama-bench/llama-bench.cpp): n_prompt, n_gen, n_depth (a pp test has
n_gen 0, a tg test n_prompt 0), n_cpu_moe, avg_ts and stddev_ts (tokens/s over the repetitions),
samples_ts, and build_commit, gpu_info, model_type, n_threads for the record.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from vismmoe_kt.core.inject import read_rules
from vismmoe_kt.errors import InputError
from vismmoe_kt.runtime.budget import BudgetError, human_bytes, parse_budget, resolve_budget

# llama.cpp's LLM_FFN_EXPS_REGEX behind `blk\.<i>` (common/common.h): what -ncmoe moves to the CPU
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\b")
ENV = "LLAMA_BENCH"
RECORD_FIELDS = ("n_prompt", "n_gen", "n_depth", "n_cpu_moe", "avg_ts", "stddev_ts")
PEER_ROUTING = ("llama.cpp: the random weights' own router; experts placed statically per layer "
                "(the first N layers' on the CPU)")
STDERR_TAIL = 2000  # characters of a failed llama-bench's stderr shown in the error


class PeerError(InputError):
    """llama-bench or its model file cannot be used: the message names the problem."""


@dataclass(frozen=True)
class ExpertLayout:
    """A GGUF's routed experts per layer, as llama.cpp's -ncmoe sees them."""
    path: str
    arch: str
    per_layer: tuple[int, ...]  # bytes of layer i's expert tensors (0: a layer without experts)

    @property
    def layers(self) -> int:
        return len(self.per_layer)

    @property
    def total(self) -> int:
        return sum(self.per_layer)


def read_expert_layout(path: str | Path) -> ExpertLayout:
    """The expert bytes per layer of a GGUF file, from its header and tensor table (GGUFReader maps the
    file; no tensor data is read). The layer count is `<arch>.block_count`, else the highest block + 1."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise PeerError(f"{path}: reading a GGUF needs the gguf package (pip install gguf==0.19.0)") from None
    file = Path(path)
    if not file.is_file():
        raise PeerError(f"{path}: no such file")
    try:
        reader = GGUFReader(str(file))
    except (ValueError, OSError) as exc:  # a bad magic or a truncated header
        raise PeerError(f"{path}: not a readable GGUF file ({exc})") from None
    arch = _string_field(reader, "general.architecture") or "?"
    per_layer: dict[int, int] = {}
    for tensor in reader.tensors:
        match = EXPERT_TENSOR.match(tensor.name)
        if match:
            per_layer[int(match.group(1))] = per_layer.get(int(match.group(1)), 0) + int(tensor.n_bytes)
    if not per_layer:
        raise PeerError(f"{path}: no routed expert tensors (blk.N.ffn_*_exps) in it: not a MoE model")
    blocks = _int_field(reader, f"{arch}.block_count")
    layers = max(blocks or 0, max(per_layer) + 1)
    return ExpertLayout(str(file), arch, tuple(per_layer.get(i, 0) for i in range(layers)))


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None or not field.data else field.parts[field.data[0]]


def _string_field(reader: Any, key: str) -> str | None:
    value = _field(reader, key)
    return None if value is None else bytes(value).decode("utf-8", errors="replace")


def _int_field(reader: Any, key: str) -> int | None:
    value = _field(reader, key)
    return None if value is None else int(value[0])


def gpu_expert_bytes(per_layer: Sequence[int], ncmoe: int) -> int:
    """Bytes of routed experts llama.cpp keeps on the GPU at `-ncmoe ncmoe`: layers ncmoe..L-1's."""
    if ncmoe < 0:
        raise ValueError(f"-ncmoe must not be negative, got {ncmoe}")
    return sum(per_layer[ncmoe:])


def ncmoe_for_budget(per_layer: Sequence[int], budget_bytes: int) -> int:
    """The smallest N whose layers N..L-1 fit in `budget_bytes` (llama.cpp keeps the first N layers' experts
    on the CPU): L when not even the last layer fits, 0 when all fit."""
    on_gpu = 0
    for n in range(len(per_layer), 0, -1):  # the suffix grows one layer at a time, from the last
        if on_gpu + per_layer[n - 1] > budget_bytes:
            return n
        on_gpu += per_layer[n - 1]
    return 0


def budget_bytes(value: Any, layout: ExpertLayout) -> int:
    """An expert_budget (16GiB, 30%) in bytes; a share is of the file's expert bytes."""
    try:
        return resolve_budget(parse_budget(value), layout.total)
    except BudgetError as exc:
        raise PeerError(f"expert_budget {value!r}: {exc}") from None


def split_for(config: Any, layout: ExpertLayout) -> tuple[int, str]:
    """(-ncmoe, why) for a benchmark configuration (benchmarks/configurations.Configuration): its
    expert_budget's split; every expert on the CPU (a CPU backend and no budget: kt-cpu) is L; no budget
    and no CPU experts (hf, gpu) is 0."""
    kwargs: dict[str, Any] = {}
    for rule in read_rules(config.rules) if config.rules is not None else []:
        kwargs.update(rule.kwargs)
    kwargs.update(config.settings)
    if "expert_budget" in kwargs:
        budget = budget_bytes(kwargs["expert_budget"], layout)
        return ncmoe_for_budget(layout.per_layer, budget), f"expert_budget={kwargs['expert_budget']}"
    if "cpu_backend" in kwargs:
        return layout.layers, "every routed expert on the CPU"
    return 0, "every expert on the GPU"


def find_llama_bench(path: str | None) -> str:
    """The llama-bench to run: `path` (--llama_bench), else $LLAMA_BENCH, else `llama-bench` on PATH."""
    given = path or os.environ.get(ENV)
    if not given:
        found = shutil.which("llama-bench")
        if found is None:
            raise PeerError(f"no llama-bench: give --llama_bench PATH or set {ENV} (none on PATH either)")
        return found
    origin = "--llama_bench" if path else ENV
    if not Path(given).is_file():
        raise PeerError(f"{origin} {given}: no such file")
    if not os.access(given, os.X_OK):
        raise PeerError(f"{origin} {given}: not executable (chmod +x it)")
    return str(given)


def bench_command(binary: str, gguf: str, splits: Iterable[int], threads: int, prompt: int, gen: int,
                  depths: Iterable[int], reps: int) -> list[str]:
    """llama-bench's command line: every layer on the GPU (-ngl 99) but the first N layers' experts
    (-ncmoe, one test set per split), flash attention, JSON records on stdout."""
    join = lambda values: ",".join(str(v) for v in sorted(set(values)))  # noqa: E731
    return [binary, "-m", str(gguf), "-ngl", "99", "-ncmoe", join(splits), "-fa", "1", "-t", str(threads),
            "-p", str(prompt), "-n", str(gen), "-d", join(depths), "-r", str(reps), "-o", "json"]


def run_llama_bench(command: list[str], timeout: float) -> list[dict]:
    """Run llama-bench, return its JSON records; a failure is a PeerError with llama-bench's own words."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = _tail(exc.stderr)
        raise PeerError(f"llama-bench ran past {timeout:g} s and was stopped{': ' + tail if tail else ''}") from None
    except OSError as exc:  # e.g. a file that is not a program for this machine
        raise PeerError(f"llama-bench {command[0]} could not start: {exc.strerror or exc}") from None
    if done.returncode:
        raise PeerError(f"llama-bench exited with status {done.returncode}; its stderr ends:\n{_tail(done.stderr) or '(empty)'}")
    return parse_records(done.stdout)


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return (text or "").strip()[-STDERR_TAIL:]


def parse_records(stdout: str) -> list[dict]:
    """llama-bench's `-o json` output -> its records (the list may follow other lines: from the first
    line that opens it). Anything else is a PeerError that shows the output's start."""
    text = stdout.strip()
    start = 0 if text.startswith("[") else text.find("\n[") + 1  # 0 also when no line opens a list
    try:
        records = json.loads(text[start:]) if text[start:start + 1] == "[" else None
    except json.JSONDecodeError:
        records = None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise PeerError(f"llama-bench printed no JSON list of records (is it llama-bench, run with -o json?); "
                        f"its output starts: {text[:300]!r}")
    for record in records:
        missing = [f for f in RECORD_FIELDS if f not in record]
        if missing:
            raise PeerError(f"a llama-bench record lacks {', '.join(missing)}: {json.dumps(record)[:300]}")
    return records


def pick(records: list[dict], ncmoe: int, *, prompt: int = 0, gen: int = 0, depth: int = 0) -> dict | None:
    """The record of one test: a pp test (prompt > 0, gen 0) or a tg test (gen > 0, prompt 0)."""
    return next((r for r in records if r["n_cpu_moe"] == ncmoe and r["n_prompt"] == prompt
                 and r["n_gen"] == gen and r["n_depth"] == depth), None)


def side_by_side(rows: list[dict], splits: dict[str, tuple[int, str]], records: list[dict], layout: ExpertLayout,
                 routing: str, gen: int, extra_splits: Iterable[int] = ()) -> list[dict]:
    """One entry per configuration row: our decode and prefill tokens/s, llama.cpp's tg (at our prompt's
    depth) and pp (our prompt's length, depth 0) at the configuration's split, and the ratios; then
    llama.cpp alone at each of `extra_splits` no configuration matched."""
    table = []
    for row in rows:
        ncmoe, why = splits[row["config"]]
        prompt = row["prompt_tokens"]
        ours_prefill = prompt / row["prefill_s_median"] if row.get("prefill_s_median") else None
        table.append({"config": row["config"], "routing": routing, "decode_tok_s": row["decode_tok_s_median"],
                      "prefill_tok_s": ours_prefill, "prompt_tokens": prompt,
                      **_peer(records, layout, ncmoe, why, prompt, gen, row["decode_tok_s_median"], ours_prefill)})
    matched = {entry["ncmoe"] for entry in table}
    prompts = sorted({row["prompt_tokens"] for row in rows})
    for ncmoe in sorted(set(extra_splits) - matched):
        for prompt in prompts:
            why = "every expert on the GPU" if ncmoe == 0 else "every routed expert on the CPU" \
                if ncmoe == layout.layers else "a split of its own"
            table.append({"config": f"llama.cpp -ncmoe {ncmoe}", "routing": None, "decode_tok_s": None,
                          "prefill_tok_s": None, "prompt_tokens": prompt,
                          **_peer(records, layout, ncmoe, why, prompt, gen, None, None)})
    return table


def _peer(records, layout, ncmoe, why, prompt, gen, ours_decode, ours_prefill) -> dict:
    tg = pick(records, ncmoe, gen=gen, depth=prompt)
    pp = pick(records, ncmoe, prompt=prompt)
    ratio = lambda ours, theirs: ours / theirs["avg_ts"] if ours and theirs and theirs["avg_ts"] else None  # noqa: E731
    return {"ncmoe": ncmoe, "split": why, "peer_gpu_expert_bytes": gpu_expert_bytes(layout.per_layer, ncmoe),
            "peer_gpu_layers": sum(1 for b in layout.per_layer[ncmoe:] if b),
            "peer_tg_tok_s": tg["avg_ts"] if tg else None, "peer_tg_stddev": tg["stddev_ts"] if tg else None,
            "peer_pp_tok_s": pp["avg_ts"] if pp else None, "peer_pp_stddev": pp["stddev_ts"] if pp else None,
            "decode_ratio": ratio(ours_decode, tg), "prefill_ratio": ratio(ours_prefill, pp),
            "peer_routing": PEER_ROUTING}


def markdown(table: list[dict], meta: dict) -> str:
    """The side-by-side table, with what each side's routing was."""
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    gen, layers = meta["decode_tokens"], meta["layers"]
    lines = [f"| config | our routing | our decode tok/s | llama.cpp -ncmoe (experts on the GPU) | llama.cpp tg{gen} "
             f"tok/s at our prompt's depth | ours / llama.cpp decode | our prefill tok/s | llama.cpp pp tok/s "
             f"| ours / llama.cpp prefill | llama.cpp routing |", "|---" * 10 + "|"]
    for e in table:
        tg = f"{fmt(e['peer_tg_tok_s'])} ± {fmt(e['peer_tg_stddev'])}" if e["peer_tg_tok_s"] is not None else "-"
        pp = f"pp{e['prompt_tokens']}: {fmt(e['peer_pp_tok_s'], '.0f')}" if e["peer_pp_tok_s"] is not None else "-"
        split = f"{e['ncmoe']} ({e['peer_gpu_layers']} of {layers} layers, {human_bytes(e['peer_gpu_expert_bytes'])})"
        lines.append(f"| {e['config']} | {e['routing'] or '-'} | {fmt(e['decode_tok_s'])} | {split} | {tg} "
                     f"| {fmt(e['decode_ratio'])} | {fmt(e['prefill_tok_s'], '.0f')} | {pp} | {fmt(e['prefill_ratio'])} "
                     f"| random weights' own router, static per layer |")
    lines += ["", f"- {PEER_ROUTING}: its speed does not depend on which experts are chosen. Our rows carry "
              f"their routing source ({meta['routing']}).",
              ("- Our prefill is the image prompt's (vision tower included); llama.cpp's pp is text tokens of the "
               "same count" if meta.get("our_prompt", "image") == "image" else
               "- Both prefills are text prompts of the same length; llama.cpp's pp") +
              " at depth 0; its tg decodes after that many tokens (-d).",
              f"- llama-bench: `{' '.join(meta['command'])}` (build {meta.get('build_commit', '?')}, "
              f"{meta.get('gpu_info', '?')})."]
    return "\n".join(lines) + "\n"


def peer_report(configs: list, rows: list[dict], layout: ExpertLayout, binary: str, out_dir: str | Path, *,
                routing: str, decode_tokens: int, threads: int, reps: int = 3, timeout: float = 300) -> list[dict]:
    """Run llama-bench at each configuration's split and at 0 and L, print the side-by-side table and
    write it to out_dir/peer_llama_cpp.{json,md}. Raises PeerError (nothing written) when llama-bench fails."""
    by_label = {c.label: c for c in configs}
    splits = {row["config"]: split_for(by_label[row["config"]], layout) for row in rows}
    prompts = sorted({row["prompt_tokens"] for row in rows})
    if len(prompts) != 1:  # every configuration times the same request; one -p for llama-bench
        raise PeerError(f"the configurations' prompts differ in length ({prompts}): no single -p for llama-bench")
    wanted = {n for n, _ in splits.values()} | {0, layout.layers}
    command = bench_command(binary, layout.path, wanted, threads, prompts[0], decode_tokens - 1, [0, prompts[0]], reps)
    print(f"--peer llama.cpp: {' '.join(command)}", flush=True)
    records = run_llama_bench(command, timeout)
    # our decode_tok_s is over decode_tokens - 1 steps (the first token is the prefill's): tg of as many
    table = side_by_side(rows, splits, records, layout, routing, decode_tokens - 1, extra_splits=(0, layout.layers))
    first = records[0] if records else {}
    meta = {"command": command, "gguf": layout.path, "layers": layout.layers, "expert_bytes_per_layer": list(layout.per_layer),
            "decode_tokens": decode_tokens - 1, "routing": routing, "peer_routing": PEER_ROUTING,
            # a text prompt has no vision tower's time in our prefill (`prefill_vision_s` stays 0)
            "our_prompt": "image" if any(row.get("prefill_vision_s") for row in rows) else "text",
            **{k: first[k] for k in ("build_commit", "gpu_info", "model_type", "n_threads") if k in first}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_llama_cpp.json").write_text(json.dumps({"meta": meta, "table": table, "records": records}, indent=2))
    report = markdown(table, meta)
    (out / "peer_llama_cpp.md").write_text(report)
    print("\n" + report, flush=True)
    return table


def main(argv: list[str] | None = None) -> int:
    from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("gguf", help="the GGUF model file llama-bench loads")
    parser.add_argument("--budgets", nargs="*", default=[], metavar="SIZE", help="expert budgets to map (16GiB, 30%%)")
    parser.add_argument("--ncmoe", default="0,12,24,29,36,48", help="llama.cpp splits to map to budgets")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d+(,\d+)*", args.ncmoe):
        parser.error(f"--ncmoe {args.ncmoe!r}: not a list of layer counts (e.g. 0,12,24)")
    try:
        layout = read_expert_layout(args.gguf)
        budgets = [(b, budget_bytes(b, layout)) for b in args.budgets]
    except PeerError as exc:
        parser.error(str(exc))
    splits = [min(int(n), layout.layers) for n in args.ncmoe.split(",")]
    print(f"{layout.path}: {layout.arch}, {layout.layers} layers, {human_bytes(layout.total)} of routed experts")
    for label, size in budgets:
        n = ncmoe_for_budget(layout.per_layer, size)
        print(f"expert_budget={label} -> -ncmoe {n} ({human_bytes(gpu_expert_bytes(layout.per_layer, n))} on the GPU)")
    for n in splits:
        print(f"-ncmoe {n} -> expert_budget={gpu_expert_bytes(layout.per_layer, n)} "
              f"({human_bytes(gpu_expert_bytes(layout.per_layer, n))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
