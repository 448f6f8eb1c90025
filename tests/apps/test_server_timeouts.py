"""`vismmoe-kt serve` against clients that never finish: a stalled body gets 408 and its connection closed
within --body_timeout, headers that never end are dropped within --header_timeout, SIGTERM exits within
--shutdown_timeout with such a client connected, and a port in use fails before the model loads.

The timeouts are short (1 s) and the checks generous (closed within 3x the timeout, and not long before it):
a client is read until the server closes, never slept on.
"""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import free_port
from vismmoe_kt.apps.cli import build_parser
from vismmoe_kt.apps.serve import listen
from vismmoe_kt.apps.serve.command import build_server

TIMEOUT = 1.0
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def port():
    app = build_server(build_parser().parse_args(["serve", "--demo", "--generate_device", "cpu", "--prefill_device",
                                                  "cpu", "--max_new_tokens", "2", "--body_timeout", str(TIMEOUT)]))
    sockets = listen.bind("127.0.0.1", 0)
    server = listen.server(app, header_timeout=TIMEOUT)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(timeout=15)


def until_closed(port: int, sent: bytes, limit: float = 3 * TIMEOUT + 10) -> tuple[bytes, float]:
    """Send `sent`, read until the server closes the connection: (what came back, seconds it took)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
        if sent:
            s.sendall(sent)
        received = b""
        while chunk := s.recv(65536):  # socket.timeout (a failure) if the server keeps it open past `limit`
            received += chunk
    return received, time.monotonic() - start


def error_of(response: bytes) -> tuple[str, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), json.loads(body)["error"]


def test_a_stalled_body_gets_408_and_its_connection_closed(port):
    response, seconds = until_closed(port, CHAT + b"Content-Length: 100000\r\n\r\n" + b'{"messages":')
    status, error = error_of(response)
    assert status.startswith("HTTP/1.1 408"), response
    assert error["code"] == "request_timeout" and "--body_timeout" in error["message"]
    assert b"connection: close" in response.lower()
    assert TIMEOUT * 0.9 <= seconds <= 3 * TIMEOUT + 10  # bounded (not held forever), with room for a loaded machine
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_a_body_that_arrives_is_not_timed_out_while_its_answer_is_generated(port):
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("sent,answered", [
    (CHAT[:30], True),                          # half a request line's headers: told why, in the API's shape
    (b"GET /api/tags HTTP/1.1\r\nHost: 127", True),
    (b"", False),                               # connected, sent nothing: just closed
])
def test_headers_that_never_end_are_dropped_within_the_header_timeout(port, sent, answered):
    response, seconds = until_closed(port, sent)
    assert TIMEOUT * 0.9 <= seconds <= 3 * TIMEOUT + 10  # bounded (not held forever), with room for a loaded machine
    if not answered:
        assert response == b""
        return
    status, error = error_of(response)
    assert status.startswith("HTTP/1.1 408"), response
    assert "--header_timeout" in (error if isinstance(error, str) else error["message"])
    assert isinstance(error, str) == sent.startswith(b"GET /api/")  # Ollama's error string on /api/*


def test_a_kept_alive_connection_gets_a_new_header_deadline_per_request(port):
    with socket.create_connection(("127.0.0.1", port), timeout=3 * TIMEOUT + 10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while b'"status":"ok"' not in first and (chunk := s.recv(65536)):  # the whole first response
            first += chunk
        assert first.startswith(b"HTTP/1.1 200"), first
        start = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 12")  # the next request's headers stall
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 408") and time.monotonic() - start <= 3 * TIMEOUT + 10


def serve_process(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vismmoe_kt", "serve", "--demo", "--cpu_infer", "1",
                             "--no_access_log", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sigterm_with_a_stalled_client_connected_exits_within_10_s():
    port = free_port()
    process = serve_process("--port", str(port), "--body_timeout", "600", "--shutdown_timeout", "2")
    try:
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert process.poll() is None, process.stderr.read()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as stalled:
            stalled.sendall(CHAT + b"Content-Length: 100000\r\n\r\n" + b'{"messages":')
            time.sleep(0.5)  # the request is in the app, reading its body
            start = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=30)
            seconds = time.monotonic() - start
        # uvicorn re-raises the signal it caught once it has shut down: killed by SIGTERM, as the caller asked
        assert code in (0, -signal.SIGTERM) and seconds <= 10, (code, seconds)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = serve_process("--port", str(port))
        _, err = process.communicate(timeout=60)
    assert process.returncode == 2, err
    assert f"error: cannot listen on 127.0.0.1:{port}: " in err
    assert "demo model:" not in err and "serving on" not in err and "Traceback" not in err  # nothing was loaded


def test_a_host_that_is_not_this_machine_fails_with_the_reason(capsys):
    from vismmoe_kt.apps.cli import main

    assert main(["serve", "--demo", "--host", "192.0.2.1", "--port", "0"]) == 2  # TEST-NET-1: no local address
    err = capsys.readouterr().err
    assert "error: cannot listen on 192.0.2.1:0: " in err and "demo model:" not in err
