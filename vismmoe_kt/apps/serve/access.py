"""One access-log line per request, through the `logging` module (logger `vismmoe_kt.serve.access`).

    127.0.0.1:53412 POST /v1/chat/completions 200 tokens=41+8 0.412s

The client, method, path, status, the request's tokens (prompt + generated, `-` for a request that
generated nothing) and its duration until the last byte was sent; never the prompt or the answer.
An ASGI middleware outside the guard, so refusals (401, 413, 415) are logged too. A route that
generates puts its `Usage` in `request.state.usage`; it is final when the response has been sent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("vismmoe_kt.serve.access")


class AccessLog:
    def __init__(self, app: Any):
        self.app = app

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
        finally:
            usage = state.get("usage")
            tokens = f"{usage.prompt_tokens}+{usage.completion_tokens}" if usage is not None and usage.prompt_tokens else "-"
            client = scope.get("client")
            log.info("%s %s %s %s tokens=%s %.3fs", f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                     scope["path"], status[0], tokens, time.perf_counter() - start)
