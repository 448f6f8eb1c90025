"""Who may call the server, and how much they may send: checks before any route runs.

An ASGI middleware, so every route is covered, including FastAPI's own (/openapi.json):
- Host: with `allowed_hosts` (default for a loopback bind: localhost, 127.0.0.1, ::1) a request whose
  Host header names another host is refused. A web page on another site can otherwise reach a
  loopback server by pointing its own domain name at 127.0.0.1 (DNS rebinding).
- API key: with `api_key`, every path but the open ones needs `Authorization: Bearer KEY` (the scheme
  in any case, RFC 9110), compared in constant time.
- Content type: request bodies must be JSON (`application/json` or `application/*+json`). A cross-site
  page may send `text/plain` or form bodies without asking the browser's CORS preflight; JSON it may not.
- Size: a body over `max_body_bytes` is refused with 413, from Content-Length when there is one, while
  it is read otherwise, before it is held in memory whole.
- Time: a body that stalls (no bytes for `body_timeout` seconds) gets 408. A body refused part way is
  not read to its end: the response closes the connection (its unread rest would be taken for the next request).
Refusals use the error body of the API the path belongs to, like every other error (errors.py).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .errors import ApiError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/")  # the web page is static (it asks for the key itself); health checks carry no key
BODY_TIMEOUT = 30.0  # seconds a request body may stall; headers have their own deadline (listen.py)
CLOSE = (b"connection", b"close")


def default_allowed_hosts(bind_host: str) -> list[str]:
    """Loopback binds accept loopback names only; other binds accept any Host unless told."""
    return list(LOOPBACK_HOSTS) if bind_host in LOOPBACK_HOSTS or bind_host.startswith("127.") else ["*"]


def host_name(host_header: str) -> str:
    """'example.com:8080' -> 'example.com', '[::1]:80' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def bearer_token(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over the {limit / 2**20:g} MiB limit", type_="invalid_request_error",
                         code="body_too_large")


class BodyTimeout(ApiError):
    def __init__(self, seconds: float):
        super().__init__(408, f"the request body stalled: no bytes arrived for {seconds:g} s (--body_timeout)",
                         code="request_timeout")


class Guard:
    def __init__(self, app: Any, *, api_key: str | None, allowed_hosts: list[str] | None, max_body_bytes: int,
                 body_timeout: float = BODY_TIMEOUT):
        """Refusals are counted by the access log around it (access.py), like every other response."""
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.body_timeout = body_timeout
        self.allowed_hosts = None if not allowed_hosts or "*" in allowed_hosts else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self.check(scope, Headers(scope=scope))
        except ApiError as refusal:
            return await JSONResponse(refusal.body(scope["path"]), status_code=refusal.status)(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            refused: list[ApiError] = []
            receive, send = self.limited(receive, refused), closing(send, refused)
        await self.app(scope, receive, send)

    def check(self, scope, headers: Headers) -> None:
        if self.allowed_hosts is not None and host_name(headers.get("host", "")) not in self.allowed_hosts:
            raise ApiError(400, f"the Host header {headers.get('host', '')!r} is not one this server answers to "
                                f"(--allowed_hosts)", type_="invalid_request_error", code="host_not_allowed")
        if self.api_key and scope["path"] not in OPEN_PATHS:
            token = bearer_token(headers.get("authorization"))
            if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", type_="authentication_error")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
                raise ApiError(415, f"the body must be JSON sent with 'Content-Type: application/json' (got "
                                    f"{media or 'no content type'!r}; curl: -H 'Content-Type: application/json')",
                               code="unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                raise BodyTooLarge(self.max_body_bytes)

    def limited(self, receive, refused: list):
        """`receive` that counts body bytes and stops a body that grows past the limit (chunked uploads) or
        stalls; a refusal is noted in `refused`. Once the body is in, the app's receive (waiting for a
        disconnect while it generates) has no deadline."""
        seen, complete = 0, False

        async def wrapped():
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                refused.append(BodyTimeout(self.body_timeout))
                raise refused[-1] from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    refused.append(BodyTooLarge(self.max_body_bytes))
                    raise refused[-1]
            return message
        return wrapped


def closing(send, refused: list):
    """`send` that closes the connection after the response to a body refused part way."""
    async def wrapped(message):
        if message["type"] == "http.response.start" and refused and CLOSE not in message.get("headers", []):
            message = {**message, "headers": [*message.get("headers", []), CLOSE]}
        await send(message)
    return wrapped
