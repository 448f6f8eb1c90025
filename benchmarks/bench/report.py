"""The benchmark's outputs: a Markdown table on stdout, and with --output the JSON and a PNG chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vismmoe_kt.apps.plots import hbars_png
from vismmoe_kt.runtime.budget import human_bytes
from benchmarks.bench.configs import run_label

COLUMNS = ("config", "budget", "image px (tokens, visual)", "prefill s median (min-max)",
           "decode tok/s median (min-max)", "hit rate prefill / decode (Belady decode)", "bytes/decode token",
           "copy hidden", "prefetch precision (wasted per request)",
           "CPU experts", "peak GPU (load)", "host RSS", "copy bound: prefill s / decode tok/s", "notes")


def _spread(value: dict | None, digits: str) -> str:
    if value is None:
        return "-"
    return f"{value['median']:{digits}} ({value['min']:{digits}}-{value['max']:{digits}})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None, digits: str = ".3g") -> str:
    return "-" if value is None else f"{value:{digits}}"


def _bytes(value: float | None) -> str:
    return "-" if value is None else human_bytes(value)


def table_row(row: dict[str, Any]) -> list[str]:
    tokens = "-" if row["prompt_tokens"] is None else f"{row['prompt_tokens']}, {row['visual_tokens']}"
    if row["visual_tokens_kept"] is not None:
        tokens += f" -> {row['visual_tokens_kept']:.0f} kept"
    notes = [n for n in (row["placement"], row.get("decode_graphs"),
                         row["cpu_backend"] and f"CPU backend {row['cpu_backend']}",
                         row["reason"] and f"skipped: {row['reason']}") if n]
    if row["pinned_layers"] is not None:
        notes.insert(0, f"{row['pinned_layers']} pinned layers, {row['slabs']} slabs")
    return [row["config"], row["budget"] or "-", f"{row['image_size']} ({tokens})", _spread(row["prefill_s"], ".3f"),
            _spread(row["decode_tok_s"], ".2f"), f"{_pct(row['hit_rate_prefill'])} / {_pct(row['hit_rate_decode'])}"
            + (f" ({_pct(row['belady_hit_rate_decode'])})" if row.get("belady_hit_rate_decode") is not None else ""),
            _bytes(row["bytes_per_decode_token"]), _pct(row["copy_hidden_fraction"]),
            f"{_pct(row.get('prefetch_precision'))} ({_bytes(row.get('prefetch_wasted_bytes'))})",
            _pct(row["cpu_expert_share"]),
            _bytes(row["peak_gpu_bytes"]) + (f" ({_bytes(row['peak_gpu_load_bytes'])})"
                                             if row.get("peak_gpu_load_bytes") is not None else ""),
            _bytes(row.get("host_rss_bytes")),
            f"{_num(row['copy_bound_prefill_s'])} / {_num(row['copy_bound_decode_tok_s'])}", "; ".join(notes) or "-"]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(row)) + " |" for row in rows]
    return "\n".join(lines)


CONCURRENCY_COLUMNS = ("config", "budget", "image px", "requests together", "aggregate tok/s (x one request)",
                       "while all decode tok/s", "per request tok/s", "TTFT p50 / p95 s", "inter-token p50 / p95 ms",
                       "bytes/decode token (x one request)", "steps graphed", "EP straggler ms (share of compute)")


def concurrency_rows(row: dict[str, Any]) -> list[list[str]]:
    """--concurrency: a line per level of one configuration and image size, against its batch-1 figures."""
    single = row["decode_tok_s"] and row["decode_tok_s"]["median"]
    out = []
    for level in row.get("concurrency") or []:
        together = f"{level['requests_per_rank']} on each of {level['ranks']} ranks" if level.get("ranks") \
            else str(level["requests"])
        head = [row["config"], row["budget"] or "-", str(row["image_size"]), together]
        if level["status"] != "ok":
            out.append(head + [f"skipped: {level['reason']}"] + ["-"] * (len(CONCURRENCY_COLUMNS) - 5))
            continue
        ratio = lambda value, base: f" ({value / base:.2f}x)" if value is not None and base else ""  # noqa: E731
        bytes_per = level["decode_bytes_per_token"]
        ms = lambda v: _num(v * 1e3 if v is not None else None, ".1f")  # noqa: E731
        out.append(head + [
            f"{level['aggregate_tok_s']:.1f}{ratio(level['aggregate_tok_s'], single)}",
            _num(level["full_batch_decode_tok_s"], ".1f"), _num(level["per_request_tok_s"], ".1f"),
            f"{_num(level['ttft_p50_s'], '.3f')} / {_num(level['ttft_p95_s'], '.3f')}",
            f"{ms(level['itl_p50_s'])} / {ms(level['itl_p95_s'])}",
            _bytes(bytes_per) + ratio(bytes_per, row.get("bytes_per_decode_token")),
            f"{level['graphed_steps']}/{level['steps']}",
            f"{level['straggler_s'] * 1e3:.1f} ({level['straggler_share']:.0%})" if "straggler_s" in level else "-"])
    return out


def concurrency_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(CONCURRENCY_COLUMNS) + " |", "|" + "---|" * len(CONCURRENCY_COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for row in rows for cells in concurrency_rows(row)]
    return "\n".join(lines)


def describe_meta(meta: dict[str, Any]) -> str:
    bandwidth = meta["copy_bandwidth"]
    lines = [f"model: {meta['model']}", f"device: {meta['device']}; torch {meta['torch']}; {meta['date']}",
             f"batch 1, prompt {meta['prompt']!r}, images {meta['image_sizes']} px; {meta['warmup']} warm-up "
             f"(more while capturing) and {meta['repeats']} measured runs of prefill + {meta['decode_tokens']} decoded tokens per image size",
             f"copy bandwidth ({bandwidth['kind']}): {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s",
             f"routing: {meta.get('routing', 'model')}",
             f"host load average (1 min) at start / end: {' / '.join(map(str, meta['load_average']))}"]
    lines += [f"note: {note}" for note in meta["notes"]]
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    return f"{run_label(row['config'], row['budget'])}, {row['image_size']} px"


def write_outputs(out_dir: Path, meta: dict[str, Any], rows: list[dict[str, Any]],
                  profile: dict[str, Any] | None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "bench.json", out_dir / "bench.png"]
    written[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    decode = [(_label(r), r["decode_tok_s"] and r["decode_tok_s"]["median"]) for r in rows]
    prefill = [(_label(r), r["prefill_s"] and r["prefill_s"]["median"]) for r in rows]
    hbars_png([("decode tokens/s (median, higher is better)", decode),
               ("prefill seconds (median, lower is better)", prefill)], written[1])
    if profile is not None:
        written.append(out_dir / "profile.json")
        written[-1].write_text(json.dumps(profile, indent=2))
    return written
