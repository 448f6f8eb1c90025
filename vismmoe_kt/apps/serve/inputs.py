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

from ...errors import InputError
from ..images import decode
from .errors import ApiError
from .tools import parse_assistant_calls, parse_tool_choice, parse_tools

# The chat-completions fields this server implements. `user` only labels a request for the provider
# (it changes no answer), so it is accepted as OpenAI accepts it.
OPENAI_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream",
                 "stream_options", "n", "user", "tools", "tool_choice", "parallel_tool_calls")
# Fields it does not implement, accepted only at the value that means "off": some clients send the
# defaults explicitly (frequency_penalty 0, logprobs false, functions []), which ask for nothing. Any
# other value, and any field in neither list, is a 400 naming the field: silently ignoring `logprobs`
# or `response_format` would hand back an answer the client did not ask for.
OPENAI_NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (False,), "top_logprobs": (0,),
                  "logit_bias": ({},), "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},),
                  "store": (False,), "modalities": (["text"],)}
# OpenAI's newer name for the system role (o1 and later): the chat template knows only "system"
ROLE_ALIASES = {"developer": "system"}

# Qwen3-VL's processor shrinks anything above 16.8 M pixels anyway; far larger images only cost memory.
DEFAULT_MAX_IMAGE_PIXELS = 16_777_216
TEXT_OVERHEAD_BYTES = 8 * 2**20  # room for the text and JSON around the images in a request body


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
    tools: list[dict[str, Any]] = field(default_factory=list)  # those the prompt offers (tool_choice applied)
    max_tool_calls: int | None = None  # parallel_tool_calls false: 1

    def texts(self) -> list[tuple[str, str]]:
        """(field, text) of every text the prompt shows, for the engine's checks."""
        texts = [(f"messages[{i}].content[{j}]", part["text"]) for i, message in enumerate(self.messages)
                 for j, part in enumerate(message["content"]) if part.get("type") == "text"]
        texts += [(f"messages[{i}].tool_calls[{k}]", json.dumps(call["function"], ensure_ascii=False))
                  for i, message in enumerate(self.messages) for k, call in enumerate(message.get("tool_calls", ()))]
        return texts + [(f"tools[{k}]", json.dumps(tool, ensure_ascii=False)) for k, tool in enumerate(self.tools)]


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
    try:  # the CLI's checks and conversion (apps/images.py): a 16-bit PNG is not white here either
        return decode(source, limits.max_image_pixels)
    except InputError as exc:
        code = "image_too_large" if "-pixel limit" in str(exc) else None
        raise ApiError(400, f"{where}: {exc}", param=where, code=code) from None


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


# A message's fields and the JSON types they may have, for both APIs; a field of another type is a 400
# naming it, checked before any value is used (a list as a role is unhashable: a 500 deep in the parsing).
MESSAGE_FIELDS = {"role": ((str,), "a string"), "name": ((str,), "a string"),
                  "images": ((list,), "a list of base64-encoded images"), "tool_call_id": ((str,), "a string"),
                  "tool_calls": ((list,), "a list of tool calls"), "tool_name": ((str,), "a string")}
CONTENT_TYPES = {str: "a string", list: "a list of parts"}


def check_message(message: Any, i: int, content: tuple[type, ...]) -> None:
    """messages[i] is an object whose fields have their types (`content`: the API's content types)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with a role and content, got {_json_type(message)}",
                       param=where)
    kinds = {**MESSAGE_FIELDS, "content": (content, " or ".join(CONTENT_TYPES[t] for t in content))}
    for key, (types, expected) in kinds.items():
        value = message.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise ApiError(400, f"'{where}.{key}' must be {expected}, got {_json_type(value)}",
                           param=f"{where}.{key}")


def _json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _number(body: dict, key: str, low: float, high: float, integer: bool = False, where: str | None = None):
    """`body[key]` checked; errors name `where` (the field as the client wrote it: `options.num_predict`)."""
    value, where = body.get(key), where or key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ApiError(400, f"'{where}' must be a {'whole ' if integer else ''}number, got {value!r}", param=where)
    if not low <= value <= high:
        raise ApiError(400, f"'{where}' must be between {low} and {high}, got {value}", param=where)
    return value


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: 0 and 0.0 are the same number, but false is not 0 (Python's True == 1 is not JSON's)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def check_openai_fields(body: dict) -> None:
    """400 for a field this server does not implement (see OPENAI_NEUTRAL), naming it in `param`."""
    for key, value in body.items():
        if key in OPENAI_FIELDS or value is None:  # null is "not given" in OpenAI's API
            continue
        if key in OPENAI_NEUTRAL:
            if any(_same(value, neutral) for neutral in OPENAI_NEUTRAL[key]):
                continue
            raise ApiError(400, f"'{key}' is not supported by this server (only {json.dumps(OPENAI_NEUTRAL[key][0])}, "
                                f"which asks for nothing, is accepted)", param=key, code="unsupported_parameter")
        raise ApiError(400, f"unknown or unsupported parameter '{key}'; this server implements "
                            f"{', '.join(OPENAI_FIELDS)}", param=key, code="unsupported_parameter")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be {\"include_usage\": true or false}", param="stream_options")


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
    check_openai_fields(body)
    return _chat_request(body, limits)


def _chat_request(body: dict, limits: Limits) -> ChatRequest:
    """A chat-completions-shaped body (the client's, or one built from Ollama's) -> ChatRequest."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if _number(body, "n", 1, 1 << 20, integer=True) not in (None, 1):  # _number refuses `true` (not 1)
        raise ApiError(400, "'n' other than 1 is not supported", param="n")
    tools = parse_tools(body.get("tools"))
    for k, tool in enumerate(tools):  # names, descriptions and schemas reach the tokenizer too
        checked_text(json.dumps(tool, ensure_ascii=False), f"tools[{k}]")
    offered = parse_tool_choice(body.get("tool_choice"), tools).offered(tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    out, images = [], []
    for i, message in enumerate(messages):
        check_message(message, i, content=(str, list))
        role = ROLE_ALIASES.get(message.get("role"), message.get("role"))
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}] needs a role of system, developer, user, assistant or tool",
                           param=f"messages[{i}].role")
        extra = _tool_fields(message, role, i)
        content = message.get("content")
        if content in (None, "") and extra.get("tool_calls"):  # an assistant turn that only called tools
            content = []
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list) or not (parts or extra.get("tool_calls")):
            raise ApiError(400, f"messages[{i}].content must be a string or a non-empty list of parts",
                           param=f"messages[{i}].content")
        converted = []
        for j, part in enumerate(parts):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                converted.append({"type": "text", "text": checked_text(part["text"], where)})
            elif kind == "image_url" and role != "tool":
                images.append(_image_url(part, where, limits, len(images)))
                converted.append({"type": "image"})
            else:
                raise ApiError(400, f"{where}: unsupported content part (text and image_url are; text only in a "
                                    f"tool result)", param=where)
        out.append({"role": role, "content": converted, **extra})
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
                       stop, stream, offered, 1 if parallel is False else None)


def _tool_fields(message: dict, role: str, i: int) -> dict[str, Any]:
    """A tool result's `tool_call_id` (required), an assistant turn's `tool_calls`, checked."""
    where = f"messages[{i}]"
    if role == "tool":
        if not message.get("tool_call_id"):
            raise ApiError(400, f"'{where}.tool_call_id' is required in a message of role tool (the id of the call "
                                f"it answers)", param=f"{where}.tool_call_id")
        return {"tool_call_id": message["tool_call_id"]}
    if message.get("tool_calls"):  # an empty list asks for nothing
        if role != "assistant":
            raise ApiError(400, f"'{where}.tool_calls' belongs in an assistant message", param=f"{where}.tool_calls")
        calls = parse_assistant_calls(message["tool_calls"], f"{where}.tool_calls")
        for k, call in enumerate(calls):
            checked_text(json.dumps(call["function"], ensure_ascii=False), f"{where}.tool_calls[{k}]")
        return {"tool_calls": calls}
    return {}


# Ollama request fields that ask for something this server does not do, with the value meaning "off".
# Other top-level fields (keep_alive: the model stays loaded anyway) and other `options` (num_ctx,
# top_k, ...) are ignored, as Ollama itself ignores options it does not know.
OLLAMA_NEUTRAL = {"format": ("",), "suffix": ("",), "template": ("",), "context": ([],),
                  "raw": (False,), "think": (False,)}
# Options this server ignores but Ollama types: a value of another type is an error there ("must be of type
# integer"), so it is one here too, not a silently accepted `"seed": true`.
OLLAMA_TYPED_OPTIONS = {"num_ctx": True, "num_keep": True, "seed": True, "top_k": True, "repeat_last_n": True,
                        "num_batch": True, "num_gpu": True, "main_gpu": True, "num_thread": True, "min_p": False,
                        "typical_p": False, "repeat_penalty": False, "presence_penalty": False,
                        "frequency_penalty": False}  # option -> whether it is an integer


def parse_ollama(body: Any, limits: Limits, generate: bool) -> ChatRequest:
    """Ollama /api/chat or /api/generate -> ChatRequest (images are base64 strings). Errors name the
    fields as Ollama's clients send them (`options.num_predict`, not `max_tokens`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, neutral in OLLAMA_NEUTRAL.items():
        if body.get(key) is not None and not any(_same(body[key], n) for n in neutral):
            raise ApiError(400, f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")
    if generate:
        if body.get("tools") not in (None, []):  # generate has no tools; chat's are checked as OpenAI's
            raise ApiError(400, "'tools' is not supported by /api/generate (/api/chat takes them)", param="tools",
                           code="unsupported_parameter")
        if not isinstance(body.get("prompt"), str):
            raise ApiError(400, "'prompt' must be a string", param="prompt")
        messages = [{"role": "user", "content": body["prompt"], "images": body.get("images")}]
        if body.get("system") is not None:
            if not isinstance(body["system"], str):
                raise ApiError(400, "'system' must be a string", param="system")
            messages.insert(0, {"role": "system", "content": body["system"]})
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    converted = []
    for i, m in enumerate(messages):
        where = "images" if generate else f"messages[{i}].images"
        if not generate:  # generate's one message is built from `prompt`, `system` and `images`, checked by name
            check_message(m, i, content=(str,))
        if not isinstance(m.get("content"), str):
            raise ApiError(400, f"messages[{i}] needs a string content", param=f"messages[{i}].content")
        images = m.get("images") or []
        if not isinstance(images, list) or not all(isinstance(img, str) for img in images):
            raise ApiError(400, f"'{where}' must be a list of base64-encoded images", param=where)
        parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{img}"}} for img in images]
        message = {"role": m.get("role", "user"), "content": parts + [{"type": "text", "text": m["content"]}]}
        if m.get("tool_calls"):
            message["tool_calls"] = m["tool_calls"]
        if message["role"] == "tool":  # Ollama names the function answered, not a call id
            message["tool_call_id"] = m.get("tool_call_id") or m.get("tool_name") or "tool"
        converted.append(message)
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object such as {\"temperature\": 0.7, \"num_predict\": 64}",
                       param="options")
    for key, integer in OLLAMA_TYPED_OPTIONS.items():
        _number(options, key, -2.0**63, 2.0**63, integer=integer, where=f"options.{key}")
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    num_predict = options.get("num_predict")
    if num_predict in (-1, -2) and not isinstance(num_predict, bool):  # "no limit" / "fill the context": the server's limit
        num_predict = None
    stop = options.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'options.stop' must be a list of non-empty strings", param="options.stop")
    # checked here under Ollama's names, so the chat-completions checks below find nothing to refuse
    values = {"max_tokens": _number({"n": num_predict}, "n", 1, 1 << 20, integer=True, where="options.num_predict"),
              "temperature": _number(options, "temperature", 0, 2, where="options.temperature"),
              "top_p": _number(options, "top_p", 0, 1, where="options.top_p")}
    return _chat_request({"messages": converted, "stream": stream, "stop": stop, "tools": body.get("tools"), **values},
                         limits)
