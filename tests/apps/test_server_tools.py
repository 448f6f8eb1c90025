"""Tool calls: `tools` and `tool_choice` rendered into the prompt, the model's `<tool_call>` blocks read
back into OpenAI's `tool_calls` (whole and streamed, as the openai client joins them) and Ollama's,
malformed calls kept as text, tool results accepted back, bad tool fields refused naming the field.

Against a server with the demo model's processor and a scripted runner (`Scripted`: the answer is a
fixed text, one byte token per step), so the parsing is tested on known output and the prompt the
model would have read is observed.
"""

import copy
import json

import httpx
import pytest

from test_server_faults import demo, running  # noqa: F401
from vismmoe_kt.apps.serve.app import create_app
from vismmoe_kt.apps.serve.engine import Engine
from vismmoe_kt.apps.serve.inputs import Limits
from vismmoe_kt.apps.serve.runners import Run
from vismmoe_kt.apps.serve.tool_calls import QWEN, Call, Text, ToolCallReader
from vismmoe_kt.apps.serve.tools import ToolPrompt, template_renders_tools
from vismmoe_kt.engine.inputs import build_inputs

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Scripted:
    """Stands in for the engine's runner (runners.py's interface): every request's answer is `script`
    (as it was when the request was added), one token a step, up to its limit; records the prompts."""

    def __init__(self, tokenizer):
        self.tokenizer, self.script, self.prompts = tokenizer, "", []
        self.queue, self.left, self.cancelled = [], {}, set()

    @property
    def idle(self):
        return not self.queue

    def stats(self):
        return {"prompts": len(self.prompts)}

    def add(self, request):
        request.sequence = Run()
        self.prompts.append(self.tokenizer.decode(request.inputs["input_ids"][0]))
        self.left[request] = self.tokenizer(self.script, add_special_tokens=False)["input_ids"]
        self.queue.append(request)
        return request.sequence

    def cancel(self, request):
        self.cancelled.add(request)

    def step(self):
        if not self.queue:
            return 0, []
        request = self.queue[0]
        left = self.left[request]
        if request not in self.cancelled and left and len(request.sequence.generated) < request.max_new_tokens:
            token = left.pop(0)
            request.sequence.generated.append(token)
            request.on_token(token)
        if request in self.cancelled or not left or len(request.sequence.generated) >= request.max_new_tokens:
            self.queue.pop(0)
            return 1, [request]
        return 1, []


@pytest.fixture(scope="module")
def server(demo):  # noqa: F811
    model, processor = demo
    engine = Engine(model, processor, "vismmoe-demo", max_new_tokens=400, max_queue=2, limits=Limits(),
                    runner=Scripted(processor.tokenizer))
    with running(create_app(engine)) as port:
        yield engine.runner, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI  # the tests in this file need the openai client: the server's own test deps

    return OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


def post(url, path, body):  # JSON with \u escapes, as clients send it (a lone surrogate included)
    return httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)


def joined(stream):
    """What the openai client's consumers build from a stream: the content, the calls by index, the finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] += (piece.function.name or "") if piece.function else ""
            call["arguments"] += (piece.function.arguments or "") if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# -- the reader alone ------------------------------------------------------------------------------

def events(reader, pieces):
    out = [e for piece in pieces for e in reader.feed(piece)] + reader.finish()
    return [(type(e).__name__, e.text) if isinstance(e, Text) else ("Call", e.name, e.arguments) for e in out]


def merged(evs):
    """Consecutive text events as one: how the pieces fall is not part of the answer."""
    out = []
    for e in evs:
        if out and e[0] == out[-1][0] == "Text":
            out[-1] = ("Text", out[-1][1] + e[1])
        else:
            out.append(e)
    return out


def test_a_call_split_at_any_point_reads_as_the_whole():
    text = "Let me look.\n" + PARIS + "\n" + ROME + "\n"
    whole = events(ToolCallReader(QWEN, {"get_weather"}), [text])
    assert whole == [("Text", "Let me look."), ("Call", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     ("Call", "get_weather", '{"city": "Rome"}')]
    for cut in range(1, len(text)):
        assert merged(events(ToolCallReader(QWEN, {"get_weather"}), [text[:cut], text[cut:]])) == whole, cut
    assert merged(events(ToolCallReader(QWEN, {"get_weather"}), list(text))) == whole


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call> and on",   # not JSON
    "Sure: <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",                 # not offered
    "<tool_call>[1, 2]</tool_call>",                                                             # not an object
    "<tool_call>{\"name\": \"get_weather\", \"arguments\": [1]}</tool_call>",                    # arguments not an object
    "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa",                     # cut off
    "a <tool_ b  \n",                                                                            # a tag's beginning
])
def test_what_is_no_call_is_the_text_as_written(text):
    for pieces in ([text], list(text)):
        out = events(ToolCallReader(QWEN, {"get_weather"}), pieces)
        assert all(e[0] == "Text" for e in out) and "".join(e[1] for e in out) == text


def test_parallel_calls_off_keeps_the_second_as_text():
    out = events(ToolCallReader(QWEN, {"get_weather"}, max_calls=1), [PARIS + "\n" + ROME])
    assert out == [("Call", "get_weather", '{"city": "Paris", "unit": "celsius"}'), ("Text", ROME)]


# -- rendering -------------------------------------------------------------------------------------

TOOL_TEMPLATE = (  # a template with tool support, in the shape of Qwen's
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
    "{% for call in m.get('tool_calls', []) %}CALL:{{ call['function']['name'] }}"
    "{{ call['function']['arguments'] | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_tool_support_renders_them_itself(demo):  # noqa: F811
    _, processor = demo
    assert not template_renders_tools(processor)  # the demo's template knows no tools: the fallback block
    native = copy.copy(processor)
    native.chat_template = TOOL_TEMPLATE
    assert template_renders_tools(native)
    prompt = ToolPrompt(native, native_allowed=True)
    assert prompt.native and not ToolPrompt(native, native_allowed=False).native  # a family whose syntax is unknown
    history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": [], "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": [{"type": "text", "text": "-3 C"}], "tool_call_id": "c"}]
    messages, tools = prompt.render(history, [WEATHER])
    assert tools == [WEATHER] and messages == history
    text = native.tokenizer.decode(build_inputs(native, messages, tools=tools)["input_ids"][0])
    assert 'TOOLS:{"type": "function", "function": {"name": "get_weather"' in text
    assert 'CALL:get_weather{"city": "Oslo"}' in text and "<|im_start|>tool\n-3 C<|im_end|>" in text


# -- OpenAI's API ----------------------------------------------------------------------------------

def test_the_openai_client_gets_parsed_tool_calls(server, client):
    runner, _ = server
    runner.script = "Let me look.\n" + PARIS
    answer = client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    prompt = runner.prompts[-1]  # the fallback block, in Qwen's words, as the system turn
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert json.dumps(WEATHER) in prompt and "<tool_call>\n{\"name\": <function-name>" in prompt


def test_a_streamed_call_split_across_chunks_reaches_the_client_whole(server, client):
    runner, _ = server
    runner.script = "Let me look.\n" + PARIS + "\n" + ROME
    chunks = list(client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER], stream=True))
    content, calls, finish = joined(chunks)
    assert finish == "tool_calls" and content == "Let me look."
    assert [c["name"] for c in calls] == ["get_weather", "get_weather"] and all(c["id"] for c in calls)
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris", "unit": "celsius"}, {"city": "Rome"}]
    assert sum(1 for c in chunks if c.choices[0].delta.tool_calls) == 4  # per call: id and name, then arguments
    # the client's own stream helper joins the same answer
    with client.chat.completions.stream(model="vismmoe-demo", messages=ASK, tools=[WEATHER]) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in final.message.tool_calls] == [json.loads(c["arguments"]) for c in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_is_returned_as_text(server, client, stream):
    runner, _ = server
    runner.script = 'On it: <tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    answer = client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER], stream=stream)
    content, calls, finish = joined(answer) if stream else (
        answer.choices[0].message.content, answer.choices[0].message.tool_calls or [], answer.choices[0].finish_reason)
    assert (content, calls, finish) == (runner.script, [], "stop")


def test_tool_choice_none_renders_no_tools_and_reads_no_calls(server, client):
    runner, _ = server
    runner.script = PARIS
    answer = client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content == PARIS and answer.choices[0].finish_reason == "stop"
    assert "# Tools" not in runner.prompts[-1] and "get_weather" not in runner.prompts[-1]


def test_a_named_choice_offers_that_function_and_takes_no_other(server, client):
    runner, _ = server
    runner.script = PARIS
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    assert "get_time" in runner.prompts[-1] and "get_weather" not in runner.prompts[-1]
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content == PARIS  # not fabricated
    answer = client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_required_without_a_call_is_the_text_with_stop(server, client):
    runner, _ = server
    runner.script = "I cannot tell."
    answer = client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER], tool_choice="required")
    assert answer.choices[0].message.content == "I cannot tell." and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.tool_calls is None


def test_tool_results_and_the_calls_they_answer_go_back_into_the_prompt(server, client):
    runner, _ = server
    runner.script = "It is 18 C in Paris."
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    answer = client.chat.completions.create(model="vismmoe-demo", messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content == "It is 18 C in Paris." and answer.choices[0].finish_reason == "stop"
    prompt = runner.prompts[-1]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>') in prompt


def test_parallel_tool_calls_false_takes_the_first_call(server, client):
    runner, _ = server
    runner.script = PARIS + "\n" + ROME
    answer = client.chat.completions.create(model="vismmoe-demo", messages=ASK, tools=[WEATHER], parallel_tool_calls=False)
    assert len(answer.choices[0].message.tool_calls) == 1 and answer.choices[0].message.content == ROME


@pytest.mark.parametrize("extra,param,message", [
    ({"tools": {"name": "f"}}, "tools", "must be a list"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "JSON Schema object"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "\"type\": \"function\""),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "defined twice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be \"none\", \"auto\", \"required\""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope', which is not in 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "needs a non-empty 'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"messages": ASK + [{"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id", "is required"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]},
     "messages[1].tool_calls[0]", "\"function\""),
    ({"messages": ASK + [{"role": "user", "content": "x", "tool_calls": []}]}, None, None),  # empty: nothing asked
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls", "belongs in an assistant message"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools[0]", "lone surrogate"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(server, extra, param, message):
    runner, url = server
    runner.script = "ok"
    r = post(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
    if param is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


# -- Ollama's API ----------------------------------------------------------------------------------

def test_ollama_chat_takes_tools_and_answers_its_tool_calls(server):
    runner, url = server
    runner.script = PARIS
    body = {"model": "vismmoe-demo", "messages": ASK, "tools": [WEATHER], "stream": False}
    message = post(url, "/api/chat", body).json()["message"]
    assert message == {"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    with httpx.stream("POST", url + "/api/chat", json={**body, "stream": True}, timeout=30) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and [l["message"]["tool_calls"] for l in lines if "tool_calls" in l["message"]] == \
        [message["tool_calls"]]
    # the result goes back as Ollama sends it: the call's arguments as an object, the result by tool_name
    runner.script = "18 C."
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": message["tool_calls"]},
                     {"role": "tool", "content": "18 C", "tool_name": "get_weather"}]
    assert post(url, "/api/chat", {**body, "messages": history}).json()["message"]["content"] == "18 C."
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in runner.prompts[-1]
    assert "<tool_response>\n18 C\n</tool_response>" in runner.prompts[-1]
    r = post(url, "/api/chat", {**body, "tools": [{"type": "function", "function": {"name": 3}}]})
    assert r.status_code == 400 and "'tools[0].function.name'" in r.json()["error"]
    assert "tools" in httpx.post(url + "/api/show", json={"model": "vismmoe-demo"}, timeout=30).json()["capabilities"]
