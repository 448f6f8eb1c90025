"""The server's books (access.py): `vismmoe_requests_total` is labelled by route template, so junk
requests add no series; a request is counted with the status it ended with (a stream that ended with an
error chunk is a 500); one escaped access-log line per request, a handler's exception logged as 500.

Junk and log tests drive the app in process (httpx's ASGI transport: no sockets, deterministic); the
failing stream runs against the fault tests' uvicorn server (test_server_faults.py's `SlowWords` runner).
"""

import asyncio
import logging
import random

import httpx
import pytest

from test_server_faults import chat_body, demo, idle, make_server, post, served, until  # noqa: F401
from vismmoe_kt.apps.serve.access import escape

KEY = {"Authorization": "Bearer s3cret"}


def requests_series(engine) -> dict:
    """{(endpoint, status): count} of vismmoe_requests_total."""
    return {(s.labels["endpoint"], s.labels["status"]): s.value
            for family in engine.metrics.registry.collect() if family.name == "vismmoe_requests"
            for s in family.samples if s.name == "vismmoe_requests_total"}


def in_process(app, calls):
    """Run `calls(client)` (a coroutine function) against `app` over httpx's ASGI transport."""
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=("127.0.0.1", 5555))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await calls(client)
    return asyncio.run(go())


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vismmoe_kt.serve.access"]


def test_ten_thousand_junk_requests_leave_the_request_series_bounded(demo):
    engine, app, _ = make_server(demo, api_key="s3cret")
    rng = random.Random(0)

    def junk() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
    kinds = [
        lambda c: c.get(f"/{junk()}"),                                           # 401, no route
        lambda c: c.get(f"/v1/models/{junk()}"),                                 # 401, a route's template
        lambda c: c.get(f"/v1/models/{junk()}", headers=KEY),                    # 404 from the route
        lambda c: c.get(f"/v1/{junk()}", headers=KEY),                           # 404, no route
        lambda c: c.post(f"/x{junk()}", content=b"hi", headers={**KEY, "Content-Type": "text/plain"}),  # 415
        lambda c: c.post(f"/x{junk()}", json={}, headers=KEY),                   # 404, no route
        lambda c: c.delete("/v1/models", headers=KEY),                           # 405 on a route
    ]

    async def calls(client):
        statuses = {}
        for i in range(10_000):
            r = await kinds[i % len(kinds)](client)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        return statuses
    statuses = in_process(app, calls)
    assert set(statuses) == {401, 404, 415, 405}
    series = requests_series(engine)
    assert set(series) == {("unmatched", "401"), ("/v1/models/{model}", "401"), ("/v1/models/{model}", "404"),
                           ("unmatched", "404"), ("unmatched", "415"), ("/v1/models", "405")}, series
    assert sum(series.values()) == 10_000  # each request counted once: the guard's refusals too
    assert len(engine.metrics.text()) < 200_000


def test_a_stream_whose_generation_fails_is_counted_as_a_500(served):
    engine, url, _, _ = served
    assert idle(engine)
    for path, body, template in (("/v1/chat/completions", chat_body("hi", stream=True), "/v1/chat/completions"),
                                 ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": True},
                                  "/api/chat")):
        before = requests_series(engine)
        engine.runner.fail = RuntimeError("the device fell over")
        try:
            r = post(url, path, body)
        finally:
            engine.runner.fail = None
        assert r.status_code == 200 and "the device fell over" in r.text  # the error is in the stream

        def counted(status):
            return requests_series(engine).get((template, status), 0) - before.get((template, status), 0)
        assert until(lambda: counted("500") == 1), requests_series(engine)
        assert counted("200") == 0
    r = post(url, "/v1/chat/completions", chat_body("hi", stream=True, max_tokens=2))  # a good stream still a 200
    assert r.status_code == 200 and until(lambda: requests_series(engine).get(("/v1/chat/completions", "200"), 0)
                                          == before.get(("/v1/chat/completions", "200"), 0) + 1)


def test_a_forged_line_and_ansi_escapes_in_the_path_are_one_escaped_log_line(demo, caplog):
    _, app, _ = make_server(demo)
    caplog.set_level(logging.INFO, logger="vismmoe_kt.serve.access")
    forged = "/v1/x%0d%0a127.0.0.1:1%20GET%20/v1/models%20200%20tokens=-%200.001s%1b[2J%1b]0;owned%07\\"

    async def calls(client):
        return (await client.get(forged, headers={"User-Agent": "\x1b[31mred"})).status_code
    assert in_process(app, calls) == 404
    lines = access_lines(caplog)
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\x07" not in line
    assert line.startswith("127.0.0.1:5555 GET /v1/x\\x0d\\x0a127.0.0.1:1\\x20GET\\x20/v1/models\\x20200")
    assert "\\x1b[2J\\x1b]0;owned\\x07\\\\ 404 tokens=- " in line and len(line.split(" ")) == 6


def test_escape_leaves_ordinary_fields_alone_and_shows_every_other_character():
    assert escape("/v1/models/{model}?a=b&c=%41") == "/v1/models/{model}?a=b&c=%41"
    assert escape("/é/日本") == "/é/日本"  # printable letters are read as they are
    assert escape("a b\tc\x7f\x85\u2028\\") == "a\\x20b\\x09c\\x7f\\x85\\u2028\\\\"


def test_a_handler_exception_is_logged_and_counted_as_500(demo, caplog, monkeypatch):
    engine, app, _ = make_server(demo)
    caplog.set_level(logging.INFO, logger="vismmoe_kt.serve.access")

    async def broken(request, usage):
        raise RuntimeError("a bug in the server")
    monkeypatch.setattr(engine, "submit", broken)

    async def calls(client):
        r = await client.post("/v1/chat/completions", json=chat_body("hi"))
        return r.status_code, r.json()
    status, body = in_process(app, calls)
    assert status == 500 and "a bug in the server" in body["error"]["message"]
    assert [" POST /v1/chat/completions 500 tokens=-" in line for line in access_lines(caplog)] == [True]
    assert requests_series(engine) == {("/v1/chat/completions", "500"): 1}


@pytest.mark.parametrize("path,template", [("/v1/models/some/name", "/v1/models/{model}"), ("/health", "/health"),
                                           ("/api/tags", "/api/tags"), ("/nothing/here", "unmatched")])
def test_the_endpoint_label_is_the_route_template(demo, path, template):
    engine, app, _ = make_server(demo)

    async def calls(client):
        return (await client.get(path)).status_code
    in_process(app, calls)
    assert list(requests_series(engine)) == [(template, "404" if template in ("unmatched", "/v1/models/{model}") else "200")]
