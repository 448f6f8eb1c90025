"""Load test: `vismmoe-kt serve` driven by the official `openai` client at several concurrencies.

    python -m benchmarks.load_test --out DIR [--concurrency 1 2 4 8] [--requests 16]
        [--max_tokens 32] [--url http://127.0.0.1:PORT/v1 | --serve_args "--demo --port 10002 ..."]

Without `--url` it starts `vismmoe-kt serve` itself on a free loopback port (`--serve_args`, default
the demo model on the CPU), waits for /health and stops it at the end; every wait is bounded.
Each request asks about its own picture from the demo's synthetic VQA task (greedy, streamed) and
the same requests go out at every concurrency, so an answer that changes with the load is a request
mixed with another's (counted as `changed_answers`); each answer is also checked against its picture's
known answer (`correct`: the demo model's accuracy, which must not move with the load), and every
request must get exactly one answer (`lost`: none came back). Per concurrency: requests and tokens per second
in aggregate, time to first token and time per output token after it (p50, p95), errors (a 429 from
a full queue counts there). Writes load_test.json, load_test.md (the table) and load_test.png
(matplotlib). Tokens are the server's count (`stream_options.include_usage`); a stream may carry
several in one chunk.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import shlex
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter


@dataclass
class RequestResult:
    index: int
    answer: str = ""
    error: str | None = None
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since the request started, per content chunk
    tokens: int = 0                                          # the server's completion_tokens
    seconds: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens or chunks)."""
        if self.tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)


def demo_requests(count: int) -> list[tuple[str, str, str]]:
    """(question, PNG data URL, known answer): the demo task's held-out colour questions, each with its picture."""
    from vismmoe_kt.apps.evaluate import synthetic_items

    out = []
    for item in synthetic_items("test", count, ["colour"]):
        buffer = io.BytesIO()
        item.image.save(buffer, format="PNG")
        out.append((item.question, "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(),
                    item.answer))
    return out


def ask(client, model: str, index: int, question: str, url: str, max_tokens: int) -> RequestResult:
    result = RequestResult(index)
    start = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": question}]}])
        for chunk in stream:
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                result.chunk_times.append(time.perf_counter() - start)
                result.answer += text
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
    except Exception as exc:  # a refused or failed request is a result too (counted as an error)
        result.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    result.seconds = time.perf_counter() - start
    result.ttft_s = result.chunk_times[0] if result.chunk_times else None
    return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_level(client, model: str, requests: list[tuple[str, str, str]], concurrency: int, max_tokens: int,
              timeout_s: float) -> tuple[dict, list[RequestResult]]:
    from vismmoe_kt.apps.evaluate import normalise

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(ask, client, model, i, q, url, max_tokens) for i, (q, url, _) in enumerate(requests)]
        results = [f.result(timeout=timeout_s) for f in futures]
    wall = time.perf_counter() - start
    done = [r for r in results if r.error is None]
    known = [answer for _, _, answer in requests]
    tokens = sum(r.tokens for r in done)
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    row = {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(done),
           "lost": sum(1 for r in done if not r.answer),  # a 200 with no text: a request that got nothing
           "correct": sum(1 for r in done if normalise(r.answer) == normalise(known[r.index])), "wall_s": wall,
           "requests_per_s": len(done) / wall, "tokens_per_s": tokens / wall, "tokens": tokens,
           "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
           "tpot_p50_s": percentile(tpots, 0.5), "tpot_p95_s": percentile(tpots, 0.95)}
    return row, results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], startup_s: float) -> tuple[subprocess.Popen, str]:
    """`vismmoe-kt serve` on a free loopback port; returns the process and its /v1 base URL once /health
    answers (the process is stopped and an error raised if it does not within `startup_s`)."""
    import httpx

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "vismmoe_kt.apps.cli", "serve", *serve_args,
                                "--host", "127.0.0.1", "--port", str(port)])
    deadline = time.time() + startup_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode} before answering /health")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise SystemExit(f"the server did not answer /health within {startup_s:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def write_report(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_test.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    ms = lambda v: f"{v * 1000:.0f}" if v is not None else "-"  # noqa: E731
    lines = [f"{meta['server']}, {meta['requests']} requests per concurrency, max_tokens {meta['max_tokens']}, "
             f"{meta['date']}", "",
             "| concurrency | tokens/s (aggregate) | requests/s | TTFT p50 / p95 ms | TPOT p50 / p95 ms | errors "
             "| lost | changed answers | known answer |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | {ms(r['ttft_p50_s'])} / "
              f"{ms(r['ttft_p95_s'])} | {ms(r['tpot_p50_s'])} / {ms(r['tpot_p95_s'])} | {r['errors']} | {r['lost']} | "
              f"{r['changed_answers']} | {r['correct']}/{r['requests']} |" for r in rows]
    (out / "load_test.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullLocator

    levels = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    left.plot(levels, [r["tokens_per_s"] for r in rows], marker="o")
    left.set(xlabel="concurrent requests", ylabel="tokens / s (aggregate)", title="throughput", xscale="log", xticks=levels)
    left.set_xticklabels([str(c) for c in levels])
    left.xaxis.set_minor_locator(NullLocator())
    for key, label in (("tpot_p50_s", "per output token p50"), ("tpot_p95_s", "per output token p95"),
                       ("ttft_p95_s", "first token p95")):
        right.plot(levels, [1000 * r[key] if r[key] is not None else float("nan") for r in rows], marker="o", label=label)
    right.set(xlabel="concurrent requests", ylabel="ms", title="latency", xscale="log", xticks=levels, ylim=(0, None))
    right.set_xticklabels([str(c) for c in levels])
    right.xaxis.set_minor_locator(NullLocator())
    right.legend()
    fig.suptitle("\n".join(textwrap.wrap(meta["server"], 120)), fontsize=9)  # a server's flags run long
    fig.savefig(out / "load_test.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for load_test.json, .md and .png")
    parser.add_argument("--url", help="a running server's OpenAI base URL (default: start one, see --serve_args)")
    parser.add_argument("--serve_args", default="--demo --generate_device cpu --prefill_device cpu",
                        help="arguments for the `vismmoe-kt serve` this starts (default: %(default)s)")
    parser.add_argument("--api_key", default="none", help="the server's --api_key, if it has one (default: none)")
    parser.add_argument("--model", help="the model name sent (default: the first one /v1/models lists)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="default: %(default)s")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency (default: %(default)s)")
    parser.add_argument("--max_tokens", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--timeout_s", type=float, default=600, help="per request (default: %(default)s)")
    parser.add_argument("--startup_s", type=float, default=300, help="for the server to come up (default: %(default)s)")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error("--concurrency, --requests and --max_tokens must be at least 1")
    from openai import OpenAI

    process = None
    url = args.url
    if url is None:
        process, url = start_server(shlex.split(args.serve_args), args.startup_s)
    try:
        client = OpenAI(base_url=url, api_key=args.api_key, timeout=args.timeout_s, max_retries=0)
        model = args.model or client.models.list().data[0].id
        requests = demo_requests(args.requests)
        rows, first_answers = [], None
        for level in args.concurrency:
            row, results = run_level(client, model, requests, level, args.max_tokens, args.timeout_s)
            answers = {r.index: r.answer for r in results if r.error is None}
            first_answers = first_answers if first_answers is not None else answers
            row["changed_answers"] = sum(1 for i, a in answers.items() if i in first_answers and a != first_answers[i])
            row["error_messages"] = sorted({r.error for r in results if r.error})[:5]
            rows.append(row)
            print(f"concurrency {level}: {row['tokens_per_s']:.1f} tokens/s, {row['errors']} errors, {row['lost']} lost, "
                  f"{row['changed_answers']} changed answers, {row['correct']}/{row['requests']} known answers",
                  flush=True)
    finally:
        if process is not None:
            stop_server(process)
    meta = {"server": f"vismmoe-kt serve {args.serve_args}" if args.url is None else args.url,
            "requests": args.requests, "max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%d")}
    write_report(Path(args.out), meta, rows)
    print((Path(args.out) / "load_test.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
