"""Errors as each API's own clients expect them.

OpenAI's clients (and the `/v1/*` routes) read `{"error": {"message", "type", "param", "code"}}`;
Ollama's clients (`/api/*`) read `{"error": "message"}` and show that string as it is. One exception
type carries everything; the path of the request picks the shape, so a route, the guard in front of
it and the handlers for unknown routes all answer alike.
"""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self, path: str = "/v1") -> dict:
        """The error body for a request to `path`: Ollama's on /api/*, OpenAI's everywhere else."""
        if is_ollama(path):
            return {"error": self.message}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def is_ollama(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


# HTTP statuses that Starlette raises itself (unknown route, wrong method) -> OpenAI's error types
STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error"}


def http_error(status: int, method: str, path: str) -> ApiError:
    """Starlette's own 404/405 as an ApiError naming what was asked for."""
    if status == 404:
        routes = ("GET /api/tags, POST /api/chat, POST /api/generate, POST /api/show, GET /api/ps, GET /api/version"
                  if is_ollama(path) else "GET /v1/models, POST /v1/chat/completions")
        return ApiError(404, f"no route {path} on this server (its routes: {routes})", type_="not_found_error",
                        code="not_found")
    if status == 405:
        return ApiError(405, f"{path} does not answer {method}", type_="invalid_request_error",
                        code="method_not_allowed")
    return ApiError(status, f"HTTP {status} for {method} {path}", type_=STATUS_TYPES.get(status, "api_error"))
