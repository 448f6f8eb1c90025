"""Tool calls in the model's output: the family's call syntax, read from the text as it streams.

A family writes its calls in its own syntax; `syntax_for(family)` picks it once, from the registry
`SYNTAXES` (Qwen3-VL's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Hermes' format,
is the default: the server's fallback tool prompt asks for it, tools.py). `ToolCallReader` turns
the answer's text pieces into `Text` and `Call` events: text that might still become a call (after
`<tool_call>`, or a tail that could be its beginning) is held back until it is decided. A block that
does not parse, or calls a function that was not offered, is text, never an error: the client gets
what the model said. Streamed and whole answers go through the same reader, so they agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def ollama(self) -> dict[str, Any]:
        return {"function": {"name": self.name, "arguments": json.loads(self.arguments)}}


class JsonInTags:
    """Calls as a JSON object `{"name": ..., "arguments": {...}}` between two tags (Qwen's, Hermes')."""

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        self.open, self.close = open_tag, close_tag

    def parse(self, block: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of the text between the tags; None if it is no call."""
        try:
            value = json.loads(block)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        return value["name"], json.dumps(arguments, ensure_ascii=False)


QWEN = JsonInTags()
# config.model_type -> the syntax its chat template asks for. A family not listed gets Qwen's syntax
# through the fallback tool prompt (tools.py), whatever its own template says: the server parses
# what it asked for.
SYNTAXES: dict[str, JsonInTags] = {"qwen3_vl_moe": QWEN}


def syntax_for(family: str) -> tuple[JsonInTags, bool]:
    """(the syntax to parse, whether the family's own template may render the tools: only where it asks
    for that syntax)."""
    return SYNTAXES.get(family, QWEN), family in SYNTAXES


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def split(events: list[Text | Call]) -> tuple[str, list[Call]]:
    """(the text, the calls) of a reader's events."""
    return "".join(e.text for e in events if isinstance(e, Text)), [e for e in events if isinstance(e, Call)]


class ToolCallReader:
    """Feed the answer's text pieces; get back `Text` and `Call` events, in order.

    `allowed`: the names of the functions offered (a call to another is text); `max_calls`: at most
    this many calls (parallel_tool_calls false: 1), later blocks are text. Whitespace around calls is
    not content: it is held until text follows it, dropped next to a call and at the end of an answer
    that made a call."""

    def __init__(self, syntax: JsonInTags, allowed: set[str], max_calls: int | None = None):
        self.syntax, self.allowed, self.max_calls = syntax, allowed, max_calls
        self.buffer = ""         # text not yet returned
        self.inside = False      # after an opening tag
        self.calls = 0
        self.after_call = False  # the next text follows a call: its leading whitespace is dropped
        self.gap = ""            # the whitespace before the open block: text again if the block is no call

    def feed(self, piece: str) -> list[Text | Call]:
        self.buffer += piece
        return self._scan(final=False)

    def finish(self) -> list[Text | Call]:
        """The answer ended: what is held back is decided (an unclosed block is a call only if it parses)."""
        return self._scan(final=True)

    def read(self, text: str) -> list[Text | Call]:
        """A whole answer at once."""
        return self.feed(text) + self.finish()

    def _text(self, text: str, out: list) -> None:
        if self.after_call:
            text = text.lstrip()
        if text:
            self.after_call = False
            out.append(Text(text))

    def _scan(self, final: bool) -> list[Text | Call]:
        out: list[Text | Call] = []
        syntax = self.syntax
        while True:
            if not self.inside:
                at = self.buffer.find(syntax.open)
                if at >= 0:
                    before = self.buffer[:at].rstrip()
                    self._text(before, out)
                    self.gap = self.buffer[len(before):at]
                    self.buffer, self.inside = self.buffer[at + len(syntax.open):], True
                    continue
                if final:
                    self._text(self.buffer.rstrip() if self.calls else self.buffer, out)
                    self.buffer = ""
                    return out
                cut = len(self.buffer) - _partial_tag(self.buffer, syntax.open)
                cut = len(self.buffer[:cut].rstrip())  # trailing whitespace waits: a call may follow it
                self._text(self.buffer[:cut], out)
                self.buffer = self.buffer[cut:]
                return out
            end = self.buffer.find(syntax.close)
            if end < 0 and not final:
                return out
            block = self.buffer if end < 0 else self.buffer[:end]
            raw = self.gap + syntax.open + block + ("" if end < 0 else syntax.close)
            self.buffer, self.inside = "" if end < 0 else self.buffer[end + len(syntax.close):], False
            parsed = syntax.parse(block)
            if parsed is not None and parsed[0] in self.allowed and (self.max_calls is None or self.calls < self.max_calls):
                out.append(Call(*parsed))
                self.calls += 1
                self.after_call = True
            else:
                self._text(raw, out)
