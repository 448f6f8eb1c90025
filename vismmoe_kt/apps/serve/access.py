"""The books of every request: one access-log line and one `vismmoe_requests_total` count, when it ends.

    127.0.0.1:53412 POST /v1/chat/completions 200 tokens=41+8 0.412s

The log line (logger `vismmoe_kt.serve.access`) has the client, method, path, status, the request's
tokens (prompt + generated, `-` for a request that generated nothing) and its duration until the last
byte was sent; never the prompt or the answer. An ASGI middleware outside the guard, so refusals (401,
413, 415) are in the books too, and in one place, so every request is counted once.

- The status is the request's outcome, written when the response has ended: the status sent, unless
  the route put another in `request.state.outcome` (a stream that began with 200 and ended with an
  error chunk is a 500; a client that left mid-stream is a 499), and 500 for a handler that raised
  (Starlette sends that 500 outside this middleware, so it never passes `send`).
- The metric's endpoint label is the route's template (`/v1/models/{model}`), also for a request the
  guard refused before routing, and `unmatched` for a path no route has: what clients send can add no
  series, so the number of series is bounded by routes x statuses.
- Client-controlled fields are escaped (`escape`): the path is percent-decoded by then, so `%0a` would
  otherwise end the line and forge a second one, and raw ANSI escapes would reach the operator's terminal.

A route that generates puts its `Usage` in `request.state.usage`; it is final when the response has been sent.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

from starlette.routing import Match

log = logging.getLogger("vismmoe_kt.serve.access")
UNMATCHED = "unmatched"  # the one endpoint label of every path that no route has
_CONVERTER = re.compile(r"\{(\w+):\w+\}")  # '/v1/models/{model:path}' -> '/v1/models/{model}'
_SAFE = re.compile(r"[\x21-\x5b\x5d-\x7e]*")  # printable ASCII but space and backslash: left as it is


def escape(text: str) -> str:
    """`text` as one log field: no space, control or non-printable character left raw (\\xNN, \\uNNNN), backslash doubled."""
    if _SAFE.fullmatch(text):
        return text
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c == " " or not c.isprintable():
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
        else:
            out.append(c)
    return "".join(out)


def endpoint(scope) -> str:
    """The template of the route that answered (or would have, for a request refused before routing), else `unmatched`."""
    route = scope.get("route")
    if route is None and "router" not in scope:  # refused by the guard: the router never ran
        router = getattr(scope.get("app"), "router", None)
        route = next((r for r in getattr(router, "routes", ()) if r.matches(scope)[0] is not Match.NONE), None)
    path = getattr(route, "path", None)
    return _CONVERTER.sub(r"{\1}", path) if isinstance(path, str) else UNMATCHED


class AccessLog:
    """`count(endpoint, status)`: called once per request when it ended (ServerMetrics.count)."""

    def __init__(self, app: Any, count: Callable[[str, int], None] = lambda endpoint, status: None):
        self.app, self.count = app, count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), ["-"]
        state = scope.setdefault("state", {})  # request.state reads and writes this dict

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        except Exception:
            status[0] = 500  # what the server error handler sends (or, mid-stream, what broke the response)
            raise
        finally:
            outcome = state.get("outcome", status[0])
            if outcome != "-":  # "-": cancelled before any answer (server shutdown); there is nothing to count
                self.count(endpoint(scope), outcome)
            usage = state.get("usage")
            tokens = f"{usage.prompt_tokens}+{usage.completion_tokens}" if usage is not None and usage.prompt_tokens else "-"
            client = scope.get("client")
            log.info("%s %s %s %s tokens=%s %.3fs", escape(f"{client[0]}:{client[1]}") if client else "-",
                     escape(scope["method"]), escape(scope["path"]), outcome, tokens, time.perf_counter() - start)
