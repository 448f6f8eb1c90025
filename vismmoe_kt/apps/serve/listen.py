"""Where the server listens, and how long a client may take before its request has arrived.

- The listening sockets are bound before the model loads: a port in use or a host that is not this
  machine's fails at once (`error: cannot listen on HOST:PORT: reason`, exit 2) rather than after a
  load of minutes. uvicorn is handed the bound sockets, so nothing can take the port in between.
- uvicorn's h11 protocol has no limit on the time a request's headers take (its keep-alive timer runs
  only after a response): a client that connects and sends half a request line holds its connection
  forever. `header_timeout` closes it, with a 408 when some of a request arrived. The body's own limit
  is the guard's (guard.py), which can answer in the API's error shape.
- `shutdown_timeout`: SIGTERM waits that long for running requests, then cancels them (uvicorn waits
  for every connection to close otherwise, so one stalled client kept the process alive).
"""

from __future__ import annotations

import asyncio
import json
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...errors import InputError
from .errors import ApiError

HEADER_TIMEOUT = 10.0    # seconds from a connection (or the first byte of its next request) to the headers' end
SHUTDOWN_TIMEOUT = 5.0   # seconds SIGTERM waits for running requests


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address `host` resolves to (as asyncio's create_server binds them), not yet
    listening: connections are refused, not queued, while the model loads. An InputError if any fails."""
    def fail(reason) -> InputError:
        return InputError(f"cannot listen on {address(host, port)}: {reason}")

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise fail(getattr(exc, "strerror", None) or exc) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, where in dict.fromkeys((f, k, p, "", w) for f, k, p, _, w in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
            if family == socket.AF_INET6:  # ::1 and 127.0.0.1 of "localhost" are two sockets, not one dual one
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # port 0: every address on the port the first one was given
                where = (where[0], sockets[0].getsockname()[1], *where[2:])
            sock.bind(where)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise fail(exc.strerror or exc) from None
    return sockets


class HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: armed when a connection opens and
    when the first bytes of its next request arrive, cleared once the headers are complete."""

    header_timeout = HEADER_TIMEOUT  # a server's value: header_timeout_protocol()
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # parses what it can; a complete request head moves the client on from IDLE
        if self.conn.their_state is h11.IDLE:
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():  # the deadline runs from the first byte
            self._header_timer = self.loop.call_later(self.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        pending = self.conn.trailing_data[0]
        if pending:  # part of a request came: say why it is dropped (an idle connection is just closed)
            target = pending.split(b" ", 2)[1] if pending.count(b" ") >= 2 else b"/"
            error = ApiError(408, f"the request headers did not arrive within {self.header_timeout:g} s "
                                  f"(--header_timeout)", code="request_timeout")
            body = json.dumps(error.body(target.decode("latin-1"))).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeout]:
    """The protocol class for uvicorn's Config(http=...): it constructs it with uvicorn's arguments only."""
    return type("HeaderTimeoutProtocol", (HeaderTimeout,), {"header_timeout": seconds})


def server(app, *, header_timeout: float = HEADER_TIMEOUT, shutdown_timeout: float = SHUTDOWN_TIMEOUT,
           log_level: str = "warning") -> uvicorn.Server:
    """The uvicorn server for `app`; run it with the sockets of bind(): `server.run(sockets)`."""
    return uvicorn.Server(uvicorn.Config(app, http=header_timeout_protocol(header_timeout), log_level=log_level,
                                         timeout_graceful_shutdown=shutdown_timeout))
