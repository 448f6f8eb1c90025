"""`vismmoe-kt serve` under faults, load and bad input, against a real server process on loopback.

    .venv/bin/python3 -m benchmarks.server_faults --out DIR [--concurrency 50] [--seed 0] [--cases NAME ...]

Starts `vismmoe-kt serve --demo` (real model, real generation, CPU) on a free port and runs, in order:
  bad-input   one request per hostile or malformed case; each must get its expected status (a 4xx
              with the JSON error body, or 200 where the input is valid: a 16-bit PNG, temperature
              1e-38) and the server must answer a normal request afterwards
  load        N concurrent streaming requests of which every 10th client gives up after 0.3 s;
              status counts, latency p50/p95 of the answered ones, hung clients (none may hang)
  disconnect  N raw-socket clients that close at a seeded random moment (before sending the body's
              end, before the first byte, mid-stream, while queued); the server must then be idle
  heavy       an 8 MB text body, a 13000 x 13000 PNG header and a 2,000 px image while /health is
              polled: /health latency p50/p95/max during the heavy requests
  junk        a soak of --junk requests (unknown paths, random model ids, refused bodies, %0a and ANSI
              escapes in paths): the request metric's series stay bounded, RSS sampled along the way
  stalled-body     a POST that announces 100,000 bytes and sends 12: 408 and closed within --body_timeout
  stalled-headers  headers that never end, and a connection that sends nothing: closed within --header_timeout
  port-in-use      a second `serve` on the server's port: exit 2 with `error: cannot listen ...`, before loading
  sigterm          SIGTERM while a stream runs: seconds until the process exits
  sigterm-stalled  SIGTERM (a server of its own) with a stalled-body client connected: exits within 10 s
RSS of the server process before and after. Writes DIR/server_faults.json and prints a markdown table.
--cases runs some of them (in the order above; sigterm ends the shared server, so it runs last).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import io
import json
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import psutil
from PIL import Image
from vismmoe_kt.apps.arguments import FlagParser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def png16_bytes(size: int = 64) -> bytes:
    """A 16-bit greyscale PNG (PIL mode I;16) of mid-grey: 8-bit conversion used to make it white."""
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size), 32896, dtype=np.uint16)).save(buf, format="PNG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


CASES = ["bad_input", "load", "disconnect", "heavy", "junk", "stalled_body", "stalled_headers", "port_in_use", "sigterm",
         "sigterm_stalled"]
CLIENT_TIMEOUT = 3.0  # the shared server's --header_timeout and --body_timeout: short, so the stalled cases are quick
SERVE = [sys.executable, "-m", "vismmoe_kt.apps.cli", "serve", "--demo", "--cpu_infer", "1"]
STALLED_BODY = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{\"messages\":")


class Server:
    def __init__(self, max_new_tokens: int, max_queue: int, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [*SERVE, "--port", str(self.port), "--max_new_tokens", str(max_new_tokens), "--max_queue",
                   str(max_queue), *extra]
        # the access log goes to a file: a pipe nobody reads fills after a few thousand lines and stalls the server
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
            if self.process.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"the server exited: {self.log.read()[-2000:]}")
        raise SystemExit("the server did not start within 300 s")

    def rss_mib(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def metric(self, name: str) -> float:
        """The sum of a metric's samples whose line starts with `name` (labels included in `name` if given)."""
        lines = httpx.get(self.url + "/metrics", timeout=10).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name) and not line.startswith("#"))

    def idle(self, timeout: float = 60) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.metric("vismmoe_num_requests_running") == 0 and self.metric("vismmoe_num_requests_waiting") == 0:
                return True
            time.sleep(0.1)
        return False

    def serves(self) -> bool:
        try:
            r = httpx.post(self.url + "/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            return r.status_code == 200
        except httpx.HTTPError:
            return False


def bad_input_cases(image: str) -> list[tuple[str, str, bytes, str, int]]:
    """(name, path, body, content type, expected status)."""
    def body(value) -> bytes:
        return json.dumps(value).encode()

    def msg(*parts):
        return {"messages": [{"role": "user", "content": list(parts)}]}
    text = {"type": "text", "text": "What is this?"}
    cases = [
        ("malformed JSON", "/v1/chat/completions", b"{not json", "application/json", 400),
        ("100k-deep arrays", "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
        ("lone surrogate", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\ud800"}]}', "application/json", 400),
        ("special tokens beside an image", "/v1/chat/completions",
         body(msg({"type": "image_url", "image_url": {"url": image}},
                  {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"})), "application/json", 400),
        ("1 x 5000 PNG", "/v1/chat/completions", body(msg({"type": "image_url", "image_url": {"url": data_url(png_bytes(1, 5000))}}, text)),
         "application/json", 400),
        ("NUL in a local path", "/v1/chat/completions", body(msg({"type": "image_url", "image_url": {"url": "/tmp/a\x00b.png"}}, text)),
         "application/json", 400),
        ("corrupt image", "/v1/chat/completions", body(msg({"type": "image_url", "image_url": {"url": data_url(b"nope" * 64)}}, text)),
         "application/json", 400),
        ("remote image URL", "/v1/chat/completions", body(msg({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, text)),
         "application/json", 400),
        ("13000 x 13000 PNG header", "/v1/chat/completions", body(msg({"type": "image_url", "image_url": {"url": data_url(png_header(13000, 13000))}}, text)),
         "application/json", 400),
        ("NaN temperature", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', "application/json", 400),
        ("n = 2", "/v1/chat/completions", body({"messages": [{"role": "user", "content": "hi"}], "n": 2}), "application/json", 400),
        ("unknown model", "/v1/chat/completions", body({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}), "application/json", 404),
        ("text/plain body", "/v1/chat/completions", body({"messages": [{"role": "user", "content": "hi"}]}), "text/plain", 415),
        ("form body", "/api/generate", body({"prompt": "hi"}), "application/x-www-form-urlencoded", 415),
        ("Ollama options [1]", "/api/generate", b'{"prompt":"hi","options":[1]}', "application/json", 400),
        ("Ollama options \"x\"", "/api/generate", b'{"prompt":"hi","options":"x"}', "application/json", 400),
        ("Ollama images 5", "/api/generate", b'{"prompt":"hi","images":5}', "application/json", 400),
        ("Ollama chat without messages", "/api/chat", b'{}', "application/json", 400),
        ("over the context (5,000 characters)", "/v1/chat/completions", body({"messages": [{"role": "user", "content": "x" * 5000}]}),
         "application/json", 400),
        ("role a list", "/v1/chat/completions", body({"messages": [{"role": ["user"], "content": "hi"}]}), "application/json", 400),
        ("role a dict, Ollama", "/api/chat", body({"messages": [{"role": {"a": 1}, "content": "hi"}]}), "application/json", 400),
        ("n = true", "/v1/chat/completions", body({"messages": [{"role": "user", "content": "hi"}], "n": True}), "application/json", 400),
        ("1 x 100000 PNG", "/v1/chat/completions", body(msg({"type": "image_url", "image_url": {"url": data_url(png_bytes(1, 100000))}}, text)),
         "application/json", 400),
        ("temperature 1e-38 (greedy)", "/v1/chat/completions", body({"messages": [{"role": "user", "content": "hi"}],
                                                                   "temperature": 1e-38, "max_tokens": 2}), "application/json", 200),
        ("16-bit greyscale PNG", "/v1/chat/completions", body({**msg({"type": "image_url", "image_url": {"url": data_url(png16_bytes())}},
                                                                   text), "max_tokens": 2}), "application/json", 200),
    ]
    return cases


def run_bad_input(server: Server, image: str) -> dict:
    rows = []
    for name, path, raw, content_type, expected in bad_input_cases(image):
        r = httpx.post(server.url + path, content=raw, headers={"content-type": content_type}, timeout=60)
        try:  # OpenAI's error object, or Ollama's error string on /api/*; a valid input's answer
            if expected == 200:
                contract = bool(r.json()["choices"])
            else:
                error = r.json()["error"]
                contract = (isinstance(error, str) if path.startswith("/api/")
                            else set(error) == {"message", "type", "param", "code"})
        except (ValueError, KeyError, TypeError):
            contract = False
        rows.append({"case": name, "status": r.status_code, "expected": expected, "error_contract": contract,
                     "serves_after": server.serves()})
    return {"cases": rows, "ok": sum(r["status"] == r["expected"] and r["error_contract"] and r["serves_after"] for r in rows),
            "n": len(rows)}


def stream_client(url: str, body: dict, timeout: float) -> tuple[str, float | None]:
    start = time.perf_counter()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(timeout)) as r:
            if r.status_code != 200:
                return str(r.status_code), None
            for _ in r.iter_lines():
                pass
        return "200", time.perf_counter() - start
    except httpx.TimeoutException:
        return "client timeout", None


def run_load(server: Server, concurrency: int, image: str) -> dict:
    def client(i: int):
        impatient = i % 10 == 0
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                         {"type": "text", "text": "What colour is the circle?"}]}],
                "stream": True, "max_tokens": 16}
        return impatient, stream_client(server.url, body, 0.3 if impatient else 600)

    rss_before = server.rss_mib()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(client, range(concurrency)))
    seconds = time.perf_counter() - start
    statuses: dict[str, int] = {}
    for impatient, (status, _) in results:
        key = f"{status} (gave up at 0.3 s)" if impatient else status
        statuses[key] = statuses.get(key, 0) + 1
    latencies = [lat for impatient, (status, lat) in results if not impatient and lat is not None]
    idle = server.idle()
    return {"concurrency": concurrency, "seconds": round(seconds, 2), "statuses": statuses,
            "latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95),
            "hung": sum(1 for impatient, (status, _) in results if not impatient and status == "client timeout"),
            "idle_after": idle, "serves_after": server.serves(), "rss_mib_before": round(rss_before, 1),
            "rss_mib_after": round(server.rss_mib(), 1)}


def run_disconnects(server: Server, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    kinds = ["mid-body", "before first byte", "mid-stream", "queued"]

    def client(i: int) -> str:
        kind = kinds[i % len(kinds)]
        body = json.dumps({"messages": [{"role": "user", "content": f"tell me a story {i}"}], "stream": True,
                           "max_tokens": 200}).encode()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (server.port, len(body)))
        s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        try:
            if kind == "mid-body":
                s.sendall(head + body[: len(body) // 2])
                time.sleep(rng.uniform(0, 0.2))
            else:
                s.sendall(head + body)
                if kind == "mid-stream":
                    data = b""
                    while b"data: " not in data and (chunk := s.recv(4096)):
                        data += chunk
                time.sleep(rng.uniform(0, 0.3) if kind != "before first byte" else 0)
        finally:
            s.close()
        return kind

    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        done = list(pool.map(client, range(n)))
    idle = server.idle()
    return {"clients": n, "by_kind": {k: done.count(k) for k in kinds}, "idle_after": idle,
            "serves_after": server.serves(), "cancelled_total": server.metric("vismmoe_requests_cancelled_total"),
            "client_gone_total": server.metric('vismmoe_requests_total{endpoint="/v1/chat/completions",status="499"}')}


def run_heavy(server: Server) -> dict:
    latencies: list[float] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            start = time.perf_counter()
            httpx.get(server.url + "/health", timeout=120)
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)

    heavy = [
        ("8 MB text body", json.dumps({"messages": [{"role": "user", "content": "x" * 8_000_000}]}).encode()),
        ("13000 x 13000 PNG header", json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png_header(13000, 13000))}}, {"type": "text", "text": "hi"}]}]}).encode()),
        ("2000 x 2000 image", json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png_bytes(2000, 2000))}}, {"type": "text", "text": "hi"}]}],
            "max_tokens": 2}).encode()),
    ]
    rss_before = server.rss_mib()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    rows = []
    for name, raw in heavy:
        start = time.perf_counter()
        r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=600)
        rows.append({"case": name, "status": r.status_code, "seconds": round(time.perf_counter() - start, 2)})
    stop.set()
    poller.join()
    return {"requests": rows, "health_p50_s": percentile(latencies, 50), "health_p95_s": percentile(latencies, 95),
            "health_max_s": round(max(latencies), 3) if latencies else None, "rss_mib_before": round(rss_before, 1),
            "rss_mib_after": round(server.rss_mib(), 1)}


def run_junk(server: Server, n: int, seed: int) -> dict:
    """A soak of `n` junk requests (unknown paths, random model ids, refused methods and bodies) from one
    keep-alive client: the metric series they may add stay bounded, RSS sampled every n / 10 requests."""
    rng = random.Random(seed)

    def series() -> int:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return sum(1 for line in text.splitlines() if line.startswith("vismmoe_requests_total{"))
    before, rss, statuses = series(), [round(server.rss_mib(), 1)], collections.Counter()
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for i in range(n):
            junk = f"{rng.getrandbits(48):012x}"
            kind = i % 3
            if kind == 0:
                r = client.get(f"/v1/models/{junk}")
            elif kind == 1:
                r = client.post(f"/x{junk}", content=b"{}", headers={"Content-Type": "text/plain"})
            else:
                r = client.get(f"/{junk}/%0a%1b[31m")
            statuses[r.status_code] += 1
            if (i + 1) % max(1, n // 10) == 0:
                rss.append(round(server.rss_mib(), 1))
    after = series()
    return {"requests": n, "statuses": dict(statuses), "series_before": before, "series_after": after,
            "rss_mib": rss, "serves_after": server.serves(), "ok": after - before <= 6 and server.serves()}


def run_sigterm(server: Server) -> dict:
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "stream": True, "max_tokens": 2000}
    thread = threading.Thread(target=stream_client, args=(server.url, body, 600), daemon=True)
    thread.start()
    time.sleep(1.0)
    start = time.perf_counter()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        return {"exited": False}
    return {"exited": True, "exit_code": code, "seconds": round(time.perf_counter() - start, 2)}


def until_closed(port: int, sent: bytes, limit: float) -> tuple[bytes, float | None]:
    """Send `sent` on a fresh connection and read until the server closes it: (reply, seconds; None: still
    open after `limit`)."""
    start = time.perf_counter()
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
        if sent:
            s.sendall(sent)
        try:
            while chunk := s.recv(65536):
                received += chunk
        except socket.timeout:
            return received, None
    return received, round(time.perf_counter() - start, 2)


def status_of(reply: bytes) -> str:
    return reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "none"


def run_stalled_body(server: Server) -> dict:
    reply, seconds = until_closed(server.port, STALLED_BODY, 3 * CLIENT_TIMEOUT + 5)
    ok = status_of(reply) == "408" and seconds is not None and seconds <= 3 * CLIENT_TIMEOUT
    return {"expected": f"408, closed within {3 * CLIENT_TIMEOUT:g} s (--body_timeout {CLIENT_TIMEOUT:g})",
            "status": status_of(reply), "closed_after_s": seconds, "ok": ok, "serves_after": server.serves()}


def run_stalled_headers(server: Server) -> dict:
    rows = []
    for case, sent, status in [("half a header", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 12", "408"),
                               ("nothing sent", b"", "none")]:
        reply, seconds = until_closed(server.port, sent, 3 * CLIENT_TIMEOUT + 5)
        rows.append({"case": case, "expected_status": status, "status": status_of(reply), "closed_after_s": seconds,
                     "ok": status_of(reply) == status and seconds is not None and seconds <= 3 * CLIENT_TIMEOUT})
    return {"expected": f"closed within {3 * CLIENT_TIMEOUT:g} s (--header_timeout {CLIENT_TIMEOUT:g})", "cases": rows,
            "ok": all(r["ok"] for r in rows), "serves_after": server.serves()}


def run_port_in_use(server: Server) -> dict:
    start = time.perf_counter()
    result = subprocess.run([*SERVE, "--port", str(server.port)], capture_output=True, text=True, timeout=300)
    seconds = round(time.perf_counter() - start, 2)
    refused = f"error: cannot listen on 127.0.0.1:{server.port}:" in result.stderr
    loaded = "demo model:" in result.stderr or "serving on" in result.stderr
    return {"expected": "exit 2, error: cannot listen on ..., nothing loaded", "exit_code": result.returncode,
            "error_line": refused, "loaded": loaded, "seconds": seconds,
            "ok": result.returncode == 2 and refused and not loaded, "serves_after": server.serves()}


def run_sigterm_stalled() -> dict:
    server = Server(max_new_tokens=16, max_queue=4, extra=["--body_timeout", "600", "--shutdown_timeout", "5"])
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as stalled:
            stalled.sendall(STALLED_BODY)
            time.sleep(0.5)  # the request is in the app, reading its body
            start = time.perf_counter()
            server.process.send_signal(signal.SIGTERM)
            try:
                code = server.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                return {"expected": "exits within 10 s (--shutdown_timeout 5)", "exited": False, "ok": False}
            seconds = round(time.perf_counter() - start, 2)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    return {"expected": "exits within 10 s (--shutdown_timeout 5)", "exited": True, "exit_code": code,
            "seconds": seconds, "ok": seconds <= 10}


def main() -> int:
    parser = FlagParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for server_faults.json")
    parser.add_argument("--concurrency", type=int, default=50, help="concurrent streaming requests of the load phase")
    parser.add_argument("--disconnects", type=int, default=40, help="raw-socket clients of the disconnect phase")
    parser.add_argument("--seed", type=int, default=0, help="seed of the disconnect moments and the junk paths")
    parser.add_argument("--junk", type=int, default=10_000, help="junk requests of the soak (metric series, RSS)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES, metavar="CASE",
                        help=f"the parts to run: {' '.join(CASES)} (default: all)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    image = data_url(png_bytes(224, 224))
    shared = [c for c in args.cases if c != "sigterm_stalled"]
    result: dict = {"machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"), "cases": args.cases}
    server = Server(max_new_tokens=256, max_queue=64, extra=["--header_timeout", str(CLIENT_TIMEOUT), "--body_timeout",
                                                             str(CLIENT_TIMEOUT)]) if shared else None
    try:
        if server is not None:
            result["rss_mib_start"] = round(server.rss_mib(), 1)
        steps = {"bad_input": lambda: run_bad_input(server, image),
                 "load": lambda: run_load(server, args.concurrency, image),
                 "disconnect": lambda: run_disconnects(server, args.disconnects, args.seed),
                 "heavy": lambda: run_heavy(server), "junk": lambda: run_junk(server, args.junk, args.seed),
                 "stalled_body": lambda: run_stalled_body(server),
                 "stalled_headers": lambda: run_stalled_headers(server),
                 "port_in_use": lambda: run_port_in_use(server)}
        for name in [c for c in CASES if c in steps and c in args.cases]:
            print(f"[{name}] ...", file=sys.stderr, flush=True)
            result[name] = steps[name]()
            print(json.dumps(result[name])[:400], file=sys.stderr, flush=True)
        if server is not None:
            result["rss_mib_end"] = round(server.rss_mib(), 1)
        if "sigterm" in args.cases:
            result["sigterm"] = run_sigterm(server)
    finally:
        if server is not None and server.process.poll() is None:
            server.process.kill()
    if "sigterm_stalled" in args.cases:
        print("[sigterm_stalled] ...", file=sys.stderr, flush=True)
        result["sigterm_stalled"] = run_sigterm_stalled()
    (out / "server_faults.json").write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0


def verdict(x: dict) -> str:
    return "ok" if x["ok"] else "FAIL"


ROWS = [  # (part, its row of the table from its result), for the parts that ran
    ("bad_input", lambda b: f"| bad input | {b['ok']}/{b['n']} cases got the expected status with the JSON error body, "
                            f"and the server answered after each |"),
    ("load", lambda x: f"| load | {x['concurrency']} concurrent streams: "
                       f"{', '.join(f'{k}: {v}' for k, v in sorted(x['statuses'].items()))}; answered p50 "
                       f"{x['latency_p50_s']} s, p95 {x['latency_p95_s']} s; hung {x['hung']}; idle after: {x['idle_after']} |"),
    ("disconnect", lambda d: f"| disconnects | {d['clients']} clients ({', '.join(f'{k} {v}' for k, v in d['by_kind'].items())}): "
                             f"idle after {d['idle_after']}, serves after {d['serves_after']}, requests whose client left "
                             f"{d['client_gone_total']:.0f} (generations cut short {d['cancelled_total']:.0f}; the others "
                             f"left before theirs began or after it ended) |"),
    ("heavy", lambda h: "| heavy input | " + "; ".join(f"{x['case']}: {x['status']} in {x['seconds']} s" for x in h["requests"])
                        + f"; /health p50 {h['health_p50_s']} s, p95 {h['health_p95_s']} s, max {h['health_max_s']} s meanwhile |"),
    ("junk", lambda j: f"| {j['requests']} junk requests (soak) | statuses {dict(sorted(j['statuses'].items()))}; "
                       f"request series {j['series_before']} -> {j['series_after']}; RSS {j['rss_mib'][0]} -> "
                       f"{j['rss_mib'][-1]} MiB (max {max(j['rss_mib'])}); serves after {j['serves_after']}: {verdict(j)} |"),
    ("stalled_body", lambda b: f"| stalled body | expected {b['expected']}; got {b['status']}, closed after "
                               f"{b['closed_after_s']} s; serves after {b['serves_after']}: {verdict(b)} |"),
    ("stalled_headers", lambda h: f"| stalled headers | expected {h['expected']}; " + "; ".join(
        f"{c['case']}: status {c['status']} (expected {c['expected_status']}), closed after {c['closed_after_s']} s"
        for c in h["cases"]) + f"; serves after {h['serves_after']}: {verdict(h)} |"),
    ("port_in_use", lambda p: f"| port in use at startup | expected {p['expected']}; got exit {p['exit_code']}, error line "
                              f"{p['error_line']}, loaded {p['loaded']}, in {p['seconds']} s: {verdict(p)} |"),
    ("rss_mib_end", lambda _: None),  # the memory row, from two keys: markdown()
    ("sigterm", lambda t: f"| SIGTERM while streaming | exited: {t.get('exited')} in {t.get('seconds')} s |"),
    ("sigterm_stalled", lambda t: f"| SIGTERM with a stalled client | expected {t['expected']}; exited: {t.get('exited')} "
                                  f"in {t.get('seconds')} s (exit {t.get('exit_code')}): {verdict(t)} |"),
]


def markdown(r: dict) -> str:
    lines = ["| part | outcome |", "|---|---|"]
    for part, row in ROWS:
        if part == "rss_mib_end" and part in r:
            lines.append(f"| memory | RSS {r['rss_mib_start']} MiB at start, {r['rss_mib_end']} MiB at the end |")
        elif part in r:
            lines.append(row(r[part]))
    if "bad_input" in r:
        lines += ["", "| bad-input case | status (expected) |", "|---|---|"]
        lines += [f"| {c['case']} | {c['status']} ({c['expected']}) |" for c in r["bad_input"]["cases"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
