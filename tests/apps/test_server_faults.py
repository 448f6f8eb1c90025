"""The server under faults, load and hostile input: real sockets that close, an event loop that stays
free, stop strings across pieces, the error contract for odd bodies, the queue, and access control.

The server runs in this process on a free loopback port with the demo model's processor and a stand-in
for the engine's runner (`SlowWords`: one word a step, every few milliseconds, until the limit or a cancellation),
so that whether a generation was cancelled, and when, is observed rather than timed.
"""

import base64
import io
import json
import socket
import struct
import threading
import time
import zlib

import httpx
import pytest
import torch

from conftest import make_image, running_app
from vismmoe_kt import load
from vismmoe_kt.apps.serve.app import create_app
from vismmoe_kt.apps.serve.engine import Engine
from vismmoe_kt.apps.serve.guard import LOOPBACK_HOSTS, bearer_token, host_name
from vismmoe_kt.apps.serve.inputs import Limits
from vismmoe_kt.apps.serve.runners import Run
from vismmoe_kt.apps.serve.stops import StopMatcher
from vismmoe_kt.demo.tiny import demo_model_dir

WORDS = "alpha beta gamma delta epsilon zeta eta theta "
HOLD = "HOLD"  # a prompt containing this makes SlowWords wait for a cancellation before its first word


class SlowWords:
    """Stands in for the engine's runner (apps/serve/runners.py's interface): one request at a time, in the
    order added, one token of WORDS per step every `pace` seconds until its limit or a cancellation. A
    prompt containing HOLD gets no token until it is cancelled. Records every request it started running
    (its prompt, limit, tokens, cancellation); `fail` set: the steps raise it (a generation that fails)."""

    def __init__(self, tokenizer, pace=0.01):  # a request left to run takes ~20 s: far longer than a cancellation
        self.tokenizer, self.pace = tokenizer, pace
        self.ids = tokenizer(WORDS, add_special_tokens=False)["input_ids"]
        self.calls, self.queue, self.cancelled = [], [], set()
        self.current = None  # (request, its call, the deadline of its HOLD)
        self.fail = None

    @property
    def idle(self):
        return not self.queue and self.current is None

    def stats(self):
        return {"calls": len(self.calls)}

    def add(self, request):
        request.sequence = Run()
        self.queue.append(request)
        return request.sequence

    def cancel(self, request):
        self.cancelled.add(request)

    def step(self):
        ended = [r for r in self.queue if r in self.cancelled]  # cancelled while waiting: never started
        self.queue = [r for r in self.queue if r not in self.cancelled]
        if self.current is None and self.queue:
            request = self.queue.pop(0)
            call = {"prompt": self.tokenizer.decode(request.inputs["input_ids"][0]), "limit": request.max_new_tokens,
                    "produced": 0, "cancelled": False}
            self.calls.append(call)
            self.current = (request, call, time.monotonic() + 60)  # bounded: a test that forgets to cancel ends
        if self.current is None:
            return 0, ended
        request, call, deadline = self.current
        if request in self.cancelled:
            call["cancelled"] = True
            self.current = None
            return 0, ended + [request]
        if self.fail is not None:
            self.current = None
            raise self.fail
        if HOLD in call["prompt"] and time.monotonic() < deadline:
            time.sleep(0.01)
            return 0, ended
        token = self.ids[call["produced"] % len(self.ids)]
        request.sequence.generated.append(token)
        request.on_token(token)
        call["produced"] += 1
        time.sleep(self.pace)
        if call["produced"] >= request.max_new_tokens:
            self.current = None
            ended.append(request)
        return 1, ended


class Spy:
    """The processor, counting calls and optionally blocking them until released."""

    def __init__(self, processor):
        self.processor, self.calls, self.gate = processor, 0, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(30), "the test never released the processor"
        return self.processor(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.processor, name)


def running(app):
    return running_app(app, log_level="critical")


@pytest.fixture(scope="module")
def demo():
    return load(demo_model_dir(), None, generate_device="cpu", prefill_device="cpu", progress=False)


def make_server(demo, tmp_path_factory=None, max_queue=2, api_key=None, max_body=None, **engine_kwargs):
    model, processor = demo
    media = str(tmp_path_factory.mktemp("media")) if tmp_path_factory else None
    limits = Limits(4, 2**20, media, 4_000_000, max_body)
    engine = Engine(model, Spy(processor), "vismmoe-demo", max_new_tokens=2000, max_queue=max_queue, limits=limits,
                    runner=SlowWords(processor.tokenizer), **engine_kwargs)
    return engine, create_app(engine, limits, api_key, list(LOOPBACK_HOSTS)), media


@pytest.fixture(scope="module")
def served(demo, tmp_path_factory):
    engine, app, media = make_server(demo, tmp_path_factory)
    with running(app) as port:
        yield engine, f"http://127.0.0.1:{port}", port, media


def until(predicate, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def idle(engine) -> bool:
    return until(lambda: engine._running == 0 and engine._waiting == 0)


def chat_body(text="hello", stream=False, max_tokens=None, **extra):
    body = {"messages": [{"role": "user", "content": text}], "stream": stream, **extra}
    if max_tokens:
        body["max_tokens"] = max_tokens
    return body


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=30, **kwargs)


def raw_post(port, path, body: bytes, content_type="application/json"):
    """A client on a plain socket: it can leave at any moment, as real clients do."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), port, content_type.encode(), len(body)) + body)
    return s


def read_until(s, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = s.recv(4096)
        assert chunk, f"connection closed before {marker!r}: {data[-300:]!r}"
        data += chunk
    return data


def png_header_only(width, height) -> bytes:
    """A PNG whose header claims width x height pixels: a size check must not need to decode it."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def png(width, height) -> bytes:
    buffer = io.BytesIO()
    make_image(width, height).save(buffer, format="PNG")
    return buffer.getvalue()


def assert_serves(engine, url):
    assert idle(engine), f"the server did not become idle: running {engine._running}, waiting {engine._waiting}"
    r = post(url, "/v1/chat/completions", chat_body("hi", max_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "alpha beta "[: len(r.json()["choices"][0]["message"]["content"])]


# -- 1. clients that disconnect ---------------------------------------------------------------------

STREAMS = {
    "/v1/chat/completions": (chat_body("tell me", stream=True), b"data: "),
    "/api/chat": ({"messages": [{"role": "user", "content": "tell me"}]}, b"\"done\""),
    "/api/generate": ({"prompt": "tell me"}, b"\"done\""),
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_streaming_client_that_disconnects_mid_stream_frees_the_server(served, path):
    engine, url, port, _ = served
    body, marker = STREAMS[path]
    calls = len(engine.runner.calls)
    s = raw_post(port, path, json.dumps(body).encode())
    read_until(s, marker)  # streaming has begun
    s.close()
    assert until(lambda: len(engine.runner.calls) > calls and engine.runner.calls[calls]["cancelled"])
    call = engine.runner.calls[calls]
    assert call["produced"] < call["limit"]  # stopped, not run to max_tokens for nobody
    assert_serves(engine, url)
    assert 'vismmoe_num_requests_running 0.0' in httpx.get(url + "/metrics").text


def test_a_client_that_disconnects_before_the_first_byte_frees_the_server(served):
    engine, url, port, _ = served
    calls = len(engine.runner.calls)
    s = raw_post(port, "/v1/chat/completions", json.dumps(chat_body(HOLD, stream=True)).encode())
    assert until(lambda: len(engine.runner.calls) > calls)  # generating, nothing sent yet
    s.close()
    assert until(lambda: engine.runner.calls[calls]["cancelled"])
    assert engine.runner.calls[calls]["produced"] == 0
    assert_serves(engine, url)


def test_a_client_that_disconnects_while_queued_never_runs(served):
    engine, url, port, _ = served
    calls = len(engine.runner.calls)
    holder = raw_post(port, "/v1/chat/completions", json.dumps(chat_body(HOLD, stream=True)).encode())
    assert until(lambda: len(engine.runner.calls) > calls and engine._running == 1)
    queued = raw_post(port, "/v1/chat/completions", json.dumps(chat_body("queued one", stream=True)).encode())
    assert until(lambda: engine._waiting == 1)
    queued.close()
    assert until(lambda: engine._waiting == 0)  # it left the queue
    holder.close()
    assert idle(engine)
    assert not any("queued one" in call["prompt"] for call in engine.runner.calls[calls:])
    assert_serves(engine, url)


def test_a_non_streaming_client_that_leaves_stops_its_generation(served):
    engine, url, port, _ = served
    calls = len(engine.runner.calls)
    s = raw_post(port, "/v1/chat/completions", json.dumps(chat_body("a long one", max_tokens=2000)).encode())
    assert until(lambda: len(engine.runner.calls) > calls and engine.runner.calls[calls]["produced"] > 5)
    s.close()
    assert until(lambda: engine.runner.calls[calls]["cancelled"])
    assert engine.runner.calls[calls]["produced"] < 2000
    assert_serves(engine, url)


def test_many_streams_some_of_which_time_out(served):
    """20 concurrent streaming clients, 4 of which give up early: every other one gets its whole answer
    or a clean 429, and the server is idle and serving afterwards."""
    import concurrent.futures

    engine, url, port, _ = served

    def client(i):
        impatient = i % 5 == 0
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=chat_body(f"client {i}", True, 12),
                              timeout=httpx.Timeout(0.05 if impatient else 60)) as r:
                if r.status_code != 200:
                    return r.status_code, None
                text = ""
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                return 200, text
        except httpx.TimeoutException:
            return "timeout", None

    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(client, range(20)))
    patient = [r for i, r in enumerate(results) if i % 5]
    assert all(status in (200, 429) for status, _ in patient), results
    assert all(text == (WORDS * 2)[:len(text)] and len(text) > 0 for status, text in patient if status == 200)
    assert_serves(engine, url)


# -- 2. the event loop stays free ------------------------------------------------------------------

def test_health_answers_while_a_request_is_being_prepared(served):
    engine, url, port, _ = served
    spy = engine.processor
    spy.gate = threading.Event()
    try:
        calls = spy.calls
        pending = raw_post(port, "/v1/chat/completions", json.dumps(chat_body("slow to prepare", max_tokens=2)).encode())
        assert until(lambda: spy.calls > calls)  # the processor is running (and blocked) now
        # an event loop busy with the request would not answer at all: the client's timeout bounds the wait
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200
    finally:
        spy.gate.set()
        spy.gate = None
    assert read_until(pending, b"\r\n\r\n").startswith(b"HTTP/1.1 200")
    pending.close()
    assert_serves(engine, url)


def test_a_body_over_the_limit_is_refused_before_it_is_read(demo):
    engine, app, _ = make_server(demo, max_body=64 * 1024)
    with running(app) as port:
        url = f"http://127.0.0.1:{port}"
        big = json.dumps(chat_body("x" * 200_000)).encode()
        r = httpx.post(url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and "over the 0.0625 MiB limit" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit applies while reading
            for _ in range(50):
                yield b" " * 4096
        r = httpx.post(url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert engine.processor.calls == 0
        assert_serves(engine, url)


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(served):
    engine, url, _, _ = served
    calls = engine.processor.calls
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_header_only(13000, 13000))}},
                                            {"type": "text", "text": "what is it?"}]}]
    r = post(url, "/v1/chat/completions", {"messages": message})
    assert r.status_code == 400 and "13000x13000 pixels is over the 4,000,000-pixel limit" in r.json()["error"]["message"]
    assert engine.processor.calls == calls
    assert_serves(engine, url)


def test_a_text_too_long_for_the_context_is_refused_before_tokenising(served):
    engine, url, _, _ = served
    calls = engine.processor.calls
    r = post(url, "/v1/chat/completions", chat_body("x" * 1_000_000))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.processor.calls == calls  # decided from the length, nothing tokenised


# -- 3. stop strings across pieces -------------------------------------------------------------------

@pytest.mark.parametrize("pieces,stops,expected", [
    (["a", " gr", "een", " square"], ["a gr"], ""),
    (["a", " gr", "een", " square"], ["n sq"], "a gree"),
    (["a", " gr", "een", " square"], ["een s", "gr"], "a "),  # the earliest stop wins
    (["ab", "cd"], ["zz"], "abcd"),                          # no stop: everything, the tail at the end
    (["abc"], [], "abc"),
])
def test_stop_matcher_cuts_at_stops_that_span_pieces(pieces, stops, expected):
    matcher = StopMatcher(stops)
    sent = "".join(matcher.feed(p) for p in pieces) + matcher.flush()
    assert sent == expected == matcher.answer


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop,expected", [("a gam", "alpha bet"), ("ta ga", "alpha be"), ("eta th", "alpha beta gamma delta epsilon zeta ")])
def test_stop_strings_spanning_streamed_pieces_cut_in_the_right_place(served, stream, stop, expected):
    engine, url, _, _ = served
    r = post(url, "/v1/chat/completions", chat_body("words", stream, 60, stop=[stop]))
    assert r.status_code == 200
    if stream:
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in r.text.splitlines() if line.startswith("data: {"))
    else:
        text = r.json()["choices"][0]["message"]["content"]
    assert text == expected
    assert idle(engine)


# -- 4. odd bodies get the error contract, never a text/plain 500 -------------------------------------

def odd_bodies(media):
    image = {"type": "image_url", "image_url": {"url": data_url(png(32, 32))}}
    return {
        "deep_arrays": (b"[" * 100_000 + b"]" * 100_000, "/v1/chat/completions", "nested too deeply"),
        "lone_surrogate": (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "/v1/chat/completions",
                           "not valid Unicode"),
        "special_tokens": (json.dumps({"messages": [{"role": "user", "content": [
            image, {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}]}]}).encode(),
            "/v1/chat/completions", "special token"),
        "thin_image": (json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png(1, 5000))}}, {"type": "text", "text": "hi"}]}]}).encode(),
            "/v1/chat/completions", "its aspect ratio 5000:1 is over the 200:1"),
        "nul_path": (json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": media + "/a\x00b.png"}}, {"type": "text", "text": "hi"}]}]}).encode(),
            "/v1/chat/completions", "NUL"),
        "ollama_options_list": (b'{"prompt": "hi", "options": [1]}', "/api/generate", "'options' must be an object"),
        "ollama_options_str": (b'{"prompt": "hi", "options": "x"}', "/api/generate", "'options' must be an object"),
        "ollama_images_int": (b'{"prompt": "hi", "images": 5}', "/api/generate", "'images' must be a list"),
        "ollama_chat_images": (b'{"messages": [{"role": "user", "content": "hi", "images": [1]}]}', "/api/chat",
                               "must be a list of base64"),
    }


@pytest.mark.parametrize("case", ["deep_arrays", "lone_surrogate", "special_tokens", "thin_image", "nul_path",
                                  "ollama_options_list", "ollama_options_str", "ollama_images_int", "ollama_chat_images"])
def test_odd_bodies_get_a_400_in_the_error_contract(served, case):
    engine, url, _, media = served
    body, path, message = odd_bodies(media)[case]
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if path.startswith("/api/"):  # Ollama's clients read a string
        assert isinstance(error, str) and message in error
    else:
        assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert_serves(engine, url)


def test_an_unexpected_failure_is_a_json_500(served):
    engine, url, _, _ = served
    engine.runner.fail = RuntimeError("the device fell over")
    try:
        r = post(url, "/v1/chat/completions", chat_body("hi"))
        streamed = post(url, "/v1/chat/completions", chat_body("hi", stream=True))
    finally:
        engine.runner.fail = None
    assert r.status_code == 500 and "the device fell over" in r.json()["error"]["message"]
    assert '"error"' in streamed.text and "data: [DONE]" in streamed.text
    assert_serves(engine, url)


# -- 5. the queue -------------------------------------------------------------------------------------

def test_max_queue_zero_serves_one_at_a_time_and_refuses_before_preparing(demo):
    engine, app, _ = make_server(demo, max_queue=0)
    with running(app) as port:
        url = f"http://127.0.0.1:{port}"
        assert post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2)).status_code == 200  # idle: served
        holder = raw_post(port, "/v1/chat/completions", json.dumps(chat_body(HOLD, stream=True)).encode())
        assert until(lambda: engine._running == 1)
        calls = engine.processor.calls
        image = {"type": "image_url", "image_url": {"url": data_url(png(64, 64))}}
        r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "x"}]}]})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert engine.processor.calls == calls  # refused before any image was decoded or token made
        holder.close()
        assert_serves(engine, url)


@pytest.mark.parametrize("max_batch,max_queue", [(1, 0), (1, 2), (3, 2)])
def test_the_server_holds_max_batch_plus_max_queue_requests(demo, max_batch, max_queue):
    """The one admission rule: `max_batch` running and `max_queue` waiting; the next one is a 429 at once."""
    from vismmoe_kt.apps.serve.errors import ApiError

    engine, _, _ = make_server(demo, max_queue=max_queue, max_batch=max_batch)
    tickets = [engine.admit() for _ in range(max_batch + max_queue)]
    with pytest.raises(ApiError) as refused:
        engine.admit()
    assert refused.value.status == 429 and engine.metrics.registry.get_sample_value("vismmoe_requests_rejected_total") == 1
    tickets.pop().leave()  # a place given back is a place for the next one
    engine.admit()


# -- 6. access ----------------------------------------------------------------------------------------

def test_with_an_api_key_every_route_but_health_and_the_page_needs_it(demo, monkeypatch):
    import hmac

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    engine, app, _ = make_server(demo, api_key="s3cret")
    with running(app) as port:
        url = f"http://127.0.0.1:{port}"
        for path in ("/metrics", "/v1/models", "/api/tags", "/openapi.json"):
            r = httpx.get(url + path, timeout=10)
            error = r.json()["error"]  # Ollama's string on /api/*, OpenAI's object elsewhere
            assert r.status_code == 401 and (isinstance(error, str) if path.startswith("/api/")
                                             else error["type"] == "authentication_error"), path
            assert httpx.get(url + path, headers={"Authorization": "Bearer s3cret"}, timeout=10).status_code == 200
        assert post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2)).status_code == 401
        assert post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2),
                    headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2), headers={"Authorization": "bearer s3cret"})
        assert ok.status_code == 200  # the scheme is case-insensitive
        assert compared  # constant-time comparison
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/", timeout=10).status_code == 200


def test_non_json_bodies_and_foreign_hosts_are_refused(served):
    engine, url, port, _ = served
    body = json.dumps(chat_body("hi", max_tokens=2))
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": content_type}, timeout=10)
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json; charset=utf-8"}, timeout=10)
    assert r.status_code == 200
    r = httpx.get(url + "/v1/models", headers={"host": "evil.example:%d" % port}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
    assert engine.processor.calls >= 1 and idle(engine)


@pytest.mark.parametrize("header,name", [("127.0.0.1:8000", "127.0.0.1"), ("[::1]:80", "::1"), ("LocalHost", "localhost"),
                                         ("example.com", "example.com")])
def test_host_names(header, name):
    assert host_name(header) == name


def test_bearer_tokens():
    assert bearer_token("Bearer abc") == bearer_token("bearer abc") == bearer_token("BEARER  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer ") is None
