"""Tools in a request: `tools`, `tool_choice` and the tool messages checked, and rendered into the prompt.

Rendering (`ToolPrompt`, chosen once when the engine is made): a family whose tool-call syntax the
server parses (tool_calls.SYNTAXES) and whose chat template renders tools gets its own template,
with `tools=` and the messages as transformers passes them (assistant `tool_calls` with arguments as
objects, `role: "tool"` messages). Any other template gets the fallback: the system block Qwen's
template writes (`# Tools` ... `<tools></tools>` ... `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`), the assistant's calls as `<tool_call>` text and tool results as a user turn of
`<tool_response>` blocks, all through the template as plain text.

`tool_choice`: "none" renders no tools and reads no calls; "auto" and "required" render them all; a
named function renders only that one. "required" and a named function are checked, not forced: the
answer is `tool_calls` only where the model wrote a call to an offered function; otherwise it is the
model's text with finish_reason "stop".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .errors import ApiError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
OPEN_CALL, CLOSE_CALL = "<tool_call>", "</tool_call>"


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def parse_tools(value: Any, where: str = "tools") -> list[dict[str, Any]]:
    """`tools` -> [{"type": "function", "function": {"name", "description"?, "parameters"?}}], or a 400 naming
    the field. Ollama sends the same objects."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(f"'{where}' must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects", where)
    tools, names = [], set()
    for k, tool in enumerate(value):
        at = f"{where}[{k}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f"'{at}' must be an object with \"type\": \"function\" (the only tool type served)", at)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"'{at}.function' must be an object with the function's name", f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise _bad(f"'{at}.function.name' must be 1 to 64 letters, digits, underscores or dashes, got "
                       f"{json.dumps(name)}", f"{at}.function.name")
        if name in names:
            raise _bad(f"'{at}.function.name': the function '{name}' is defined twice", f"{at}.function.name")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise _bad(f"'{at}.function.description' must be a string", f"{at}.function.description")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _bad(f"'{at}.function.parameters' must be a JSON Schema object", f"{at}.function.parameters")
        kept = {key: function[key] for key in ("name", "description", "parameters") if function.get(key) is not None}
        tools.append({"type": "function", "function": kept})
    return tools


@dataclass(frozen=True)
class ToolChoice:
    mode: str               # "none", "auto", "required" or "function"
    name: str | None = None  # the function, for "function"

    def offered(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tools the prompt shows: none, all, or the named one."""
        if self.mode == "none":
            return []
        return [t for t in tools if self.mode != "function" or t["function"]["name"] == self.name]


def parse_tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """OpenAI's `tool_choice` (default: "auto" with tools, "none" without) checked against `tools`."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise _bad(f"'tool_choice' \"{value}\" needs a non-empty 'tools'", "tool_choice")
        return ToolChoice(value)
    name = value.get("function", {}).get("name") if isinstance(value, dict) and isinstance(value.get("function"), dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise _bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise _bad(f"'tool_choice' names the function '{name}', which is not in 'tools'", "tool_choice.function.name")
    return ToolChoice("function", name)


def parse_assistant_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (OpenAI's: arguments as JSON text; Ollama's: as an object) ->
    transformers' form, arguments as an object where they are one."""
    if not isinstance(value, list):
        raise _bad(f"'{where}' must be a list of tool calls", where)
    calls = []
    for k, call in enumerate(value):
        at = f"{where}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(f"'{at}' must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                       f"\"arguments\": ...}}}}", at)
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _bad(f"'{at}.id' must be a string", f"{at}.id")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                pass  # kept as the client wrote it: the template shows it as text
        elif not isinstance(arguments, dict):
            raise _bad(f"'{at}.function.arguments' must be a JSON object or its text", f"{at}.function.arguments")
        calls.append({"id": call.get("id") or f"call_{k}", "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def call_text(call: dict[str, Any]) -> str:
    """One call in Qwen's syntax, as its template writes it."""
    function = call["function"]
    arguments = function["arguments"]
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN_CALL}\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n{CLOSE_CALL}'


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The fallback system block: Qwen's template's words, so a Qwen model reads what it was trained on."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN_CALL}{CLOSE_CALL} XML tags:\n{OPEN_CALL}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE_CALL)


def _plain(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tools for a template that knows none: the tools as a system block, calls and
    results as text. Messages without tool parts pass unchanged."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], list(message["content"])
        if role == "assistant" and message.get("tool_calls"):
            text = "".join(p["text"] for p in content if p.get("type") == "text")
            calls = "\n".join(call_text(c) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": _plain(f"{text}\n{calls}" if text else calls)})
        elif role == "tool":
            response = "<tool_response>\n" + "".join(p["text"] for p in content) + "\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn, as Qwen's template does
                out[-1]["content"] = _plain(out[-1]["content"][0]["text"] + "\n" + response)
            else:
                out.append({"role": "user", "content": _plain(response), "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools:
        block = tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + _plain("\n\n" + block)}
        else:
            out.insert(0, {"role": "system", "content": _plain(block)})
    return out


PROBE_TOOL = "vismmoe_probe_tool"


def template_renders_tools(processor: Any) -> bool:
    """Whether the processor's chat template shows the tools, the assistant's calls and the tool results
    (a probe conversation rendered once; a template that fails on it does not)."""
    tool = {"type": "function", "function": {"name": PROBE_TOOL, "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": _plain("q")},
                {"role": "assistant", "content": [], "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "vismmoe_probe_call", "arguments": {}}}]},
                {"role": "tool", "content": _plain("vismmoe_probe_result"), "tool_call_id": "call_0"}]
    try:
        text = processor.apply_chat_template(messages, tools=[tool], add_generation_prompt=True, tokenize=False)
    except Exception:  # the template's own raise_exception, a missing key: it has no tool support
        return False
    return all(word in text for word in (PROBE_TOOL, "vismmoe_probe_call", "vismmoe_probe_result"))


class ToolPrompt:
    """How this model's prompts carry tools, decided once (`native`: its own template renders them)."""

    def __init__(self, processor: Any, native_allowed: bool):
        self.native = native_allowed and template_renders_tools(processor)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[list, list | None]:
        """(messages for the chat template, its `tools=` argument)."""
        if not tools and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            return messages, None  # no tools anywhere: the prompt of a plain chat
        if self.native:
            return messages, tools or None
        return fallback_messages(messages, tools), None
