"""Request bodies -> chat messages and image references, with OpenAI-style errors (vLLM's shapes and codes).

Parsing here is cheap and runs on the event loop: it checks the body's shape and values and records
where each image comes from, but decodes nothing. Decoding images (`decode_image`, with the pixel
limit read from the header before any pixel is decoded) and tokenising happen later, off the event
loop, after the request got a place in the queue (`engine.py`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAMPLING_KEYS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream", "n", "seed",
                 "model", "messages", "stream_options", "user", "presence_penalty", "frequency_penalty"}

# Qwen3-VL's processor shrinks anything above 16.8 M pixels anyway; far larger images only cost memory.
DEFAULT_MAX_IMAGE_PIXELS = 16_777_216
TEXT_OVERHEAD_BYTES = 8 * 2**20  # room for the text and JSON around the images in a request body


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    max_images: int = 4
    max_image_bytes: int = 20 * 2**20
    allowed_local_media_path: str | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_body_bytes: int | None = None  # None: room for max_images base64 images plus the text

    @property
    def body_limit(self) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return self.max_images * (self.max_image_bytes * 4 // 3 + 4) + TEXT_OVERHEAD_BYTES


@dataclass(frozen=True)
class ImageRef:
    """Where an image of the request comes from (a data URL or a local path), not yet decoded."""

    url: str
    where: str  # the request field, for error messages


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)  # ImageRef (decoded by the engine) or PIL images
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False

    def texts(self) -> list[tuple[str, str]]:
        """(field, text) of every text part, for the engine's checks."""
        return [(f"messages[{i}].content[{j}]", part["text"]) for i, message in enumerate(self.messages)
                for j, part in enumerate(message["content"]) if part.get("type") == "text"]


def parse_json(raw: bytes) -> Any:
    """A request body -> JSON value, or a 400 naming what is wrong (never a RecursionError's 500)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise ApiError(400, "the request body is not valid JSON") from None


def checked_text(value: str, where: str) -> str:
    """Text that the tokenizer can encode: JSON allows lone surrogates ("\\ud800"), UTF-8 does not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where}: the text is not valid Unicode (a lone surrogate escape such as \\ud800)",
                       param=where) from None
    return value


def decode_image(ref: ImageRef, limits: Limits):
    """A data URL, or a local file under the allowed path; never a remote fetch. Runs off the event loop."""
    from PIL import Image, UnidentifiedImageError

    url, where = ref.url, ref.where
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ApiError(400, f"{where}: only base64 data URLs are accepted", param=where)
        if len(payload) * 3 // 4 > limits.max_image_bytes:
            raise ApiError(400, f"{where}: image is over the {limits.max_image_bytes / 2**20:g} MiB limit", param=where)
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where}: the data URL is not valid base64", param=where) from None
        source: Any = io.BytesIO(raw)
    else:
        source = local_image(url, limits, where)
    try:
        with Image.open(source) as image:
            width, height = image.size  # from the header: nothing decoded yet
            if width * height > limits.max_image_pixels:
                raise ApiError(400, f"{where}: {width}x{height} pixels is over the {limits.max_image_pixels:,}-pixel "
                                    f"limit", param=where, code="image_too_large")
            image.load()
            return image.convert("RGB")
    except ApiError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise ApiError(400, f"{where}: not a readable image", param=where) from None


def local_image(url: str, limits: Limits, where: str) -> str:
    if "\x00" in url:
        raise ApiError(400, f"{where}: the path contains a NUL character", param=where)
    path = Path(url.removeprefix("file://"))
    root = limits.allowed_local_media_path
    if root is None or not path.resolve().is_relative_to(Path(root).resolve()):
        raise ApiError(400, f"{where}: local image paths are allowed only under --allowed_local_media_path", param=where)
    if not path.is_file():
        raise ApiError(400, f"{where}: no such file {path}", param=where)
    if path.stat().st_size > limits.max_image_bytes:
        raise ApiError(400, f"{where}: image is over the {limits.max_image_bytes / 2**20:g} MiB limit", param=where)
    return str(path)


def _number(body: dict, key: str, low: float, high: float, integer: bool = False):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ApiError(400, f"'{key}' must be a {'whole ' if integer else ''}number, got {value!r}", param=key)
    if not low <= value <= high:
        raise ApiError(400, f"'{key}' must be between {low} and {high}, got {value}", param=key)
    return value


def _image_url(part: dict, where: str, limits: Limits, count: int) -> ImageRef:
    url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else part.get("image_url")
    if not isinstance(url, str):
        raise ApiError(400, f"{where}.image_url.url must be a string", param=where)
    if count >= limits.max_images:
        raise ApiError(400, f"at most {limits.max_images} images per request", param=where)
    if url.startswith(("http://", "https://")):
        raise ApiError(400, f"{where}: remote image URLs are not fetched by this server; send the image as a "
                            f"data URL (data:image/png;base64,...)", param=where)
    return ImageRef(url, where)


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
    """OpenAI chat-completions body -> ChatRequest (messages in the processor's chat-template form)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if body.get("n", 1) != 1:
        raise ApiError(400, "'n' other than 1 is not supported", param="n")
    out, images = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user or assistant", param=f"messages[{i}]")
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list) or not parts:
            raise ApiError(400, f"messages[{i}].content must be a string or a non-empty list of parts",
                           param=f"messages[{i}].content")
        converted = []
        for j, part in enumerate(parts):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                converted.append({"type": "text", "text": checked_text(part["text"], where)})
            elif kind == "image_url":
                images.append(_image_url(part, where, limits, len(images)))
                converted.append({"type": "image"})
            else:
                raise ApiError(400, f"{where}: unsupported content part (text and image_url are)", param=where)
        out.append({"role": message["role"], "content": converted})
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of non-empty strings", param="stop")
    stop = [checked_text(s, "stop") for s in stop]
    max_tokens = _number(body, "max_completion_tokens", 1, 1 << 20, integer=True) or _number(body, "max_tokens", 1, 1 << 20, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    return ChatRequest(out, images, max_tokens, _number(body, "temperature", 0, 2), _number(body, "top_p", 0, 1),
                       stop, stream)


def parse_ollama(body: Any, limits: Limits, generate: bool) -> ChatRequest:
    """Ollama /api/chat or /api/generate -> ChatRequest (images are base64 strings)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if generate:
        if not isinstance(body.get("prompt"), str):
            raise ApiError(400, "'prompt' must be a string", param="prompt")
        messages = [{"role": "user", "content": body["prompt"], "images": body.get("images")}]
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    converted = []
    for i, m in enumerate(messages):
        where = "images" if generate else f"messages[{i}].images"
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ApiError(400, f"messages[{i}] needs a string content", param=f"messages[{i}]")
        images = m.get("images") or []
        if not isinstance(images, list) or not all(isinstance(img, str) for img in images):
            raise ApiError(400, f"'{where}' must be a list of base64-encoded images", param=where)
        parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{img}"}} for img in images]
        converted.append({"role": m.get("role", "user"), "content": parts + [{"type": "text", "text": m["content"]}]})
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object such as {\"temperature\": 0.7, \"num_predict\": 64}",
                       param="options")
    stream = body.get("stream", True)  # Ollama streams unless told not to
    num_predict = options.get("num_predict")
    if num_predict in (-1, -2):  # Ollama's "no limit" / "fill the context": the server's limit applies
        num_predict = None
    return parse_chat({"messages": converted, "stream": stream, "temperature": options.get("temperature"),
                       "top_p": options.get("top_p"), "max_tokens": num_predict, "stop": options.get("stop")}, limits)
