"""The server speaks each API as its own clients expect: OpenAI's conventions on /v1/*, Ollama's on
/api/*, the API key on every route but /health, one access-log line per request, and /metrics as
Prometheus' parser reads it.

Against the fault tests' server (test_server_faults.py: the demo model's processor, `SlowWords` in place
of the engine's runner: one known word per token), so what reached the model is observed, not guessed.
"""

import json
import logging

import httpx
import pytest

from test_server_faults import chat_body, demo, idle, make_server, post, running, served, until  # noqa: F401

OPENAI_ERROR = {"message", "type", "param", "code"}


def openai_error(r: httpx.Response) -> dict:
    error = r.json()["error"]
    assert isinstance(error, dict) and set(error) == OPENAI_ERROR, r.text
    return error


def ollama_error(r: httpx.Response) -> str:
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), r.text  # Ollama's clients show this string
    return body["error"]


def sse_events(r: httpx.Response) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ")]


# -- OpenAI on /v1/* ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {}}]),  # the deprecated form of tools (test_server_tools.py)
    ("function_call", "auto"),
    ("logprobs", True),
    ("response_format", {"type": "json_object"}),
    ("frequency_penalty", 0.5),
    ("presence_penalty", -1),
    ("logit_bias", {"42": 5}),
    ("seed", 7),
    ("no_such_field", 1),
])
def test_an_unsupported_parameter_is_a_400_naming_it(served, field, value):
    engine, url, _, _ = served
    calls = len(engine.runner.calls)
    r = post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2, **{field: value}))
    assert r.status_code == 400
    error = openai_error(r)
    assert error["param"] == field and error["code"] == "unsupported_parameter" and f"'{field}'" in error["message"]
    assert len(engine.runner.calls) == calls  # refused before anything ran


def test_the_openai_client_sees_the_refused_parameter(served):
    from openai import BadRequestError, OpenAI

    _, url, _, _ = served
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="vismmoe-demo", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"})
    assert refused.value.param == "response_format" and refused.value.code == "unsupported_parameter"


def test_parameters_at_their_off_value_and_user_are_accepted(served):
    """Some clients send the defaults explicitly: they ask for nothing this server lacks."""
    _, url, _, _ = served
    r = post(url, "/v1/chat/completions", chat_body("hi", max_tokens=2, frequency_penalty=0, presence_penalty=0.0,
                                                    logprobs=False, tools=[], functions=[], response_format={"type": "text"},
                                                    seed=None, n=1, user="someone"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "alpha beta "[:len(r.json()["choices"][0]["message"]["content"])]


def test_the_developer_role_is_the_system_prompt(served):
    engine, url, _, _ = served
    calls = len(engine.runner.calls)
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "Answer in one word."},
                                                        {"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    prompt = engine.runner.calls[calls]["prompt"]
    assert "<|im_start|>system\nAnswer in one word.<|im_end|>" in prompt and "developer" not in prompt


@pytest.mark.parametrize("include", [True, False])
def test_include_usage_adds_a_last_chunk_with_the_usage(served, include):
    _, url, _, _ = served
    body = chat_body("hi", stream=True, max_tokens=3, stream_options={"include_usage": include})
    events = sse_events(post(url, "/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-2 if include else -1]["choices"][0]["finish_reason"] == "length"
    if include:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 3
    assert all("usage" not in c for c in (chunks[:-1] if include else chunks))


def test_a_malformed_stream_options_is_a_400(served):
    _, url, _, _ = served
    r = post(url, "/v1/chat/completions", chat_body("hi", stream=True, stream_options={"include_usage": "yes"}))
    assert r.status_code == 400 and openai_error(r)["param"] == "stream_options"


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/no/such/route", 404), ("POST", "/v1/completions", 404), ("GET", "/no-such-page", 404),
    ("GET", "/v1/chat/completions", 405), ("GET", "/v1/models/gpt-9", 404),
])
def test_unknown_routes_and_models_answer_openais_error_object(served, method, path, status):
    _, url, _, _ = served
    r = httpx.request(method, url + path, json={} if method == "POST" else None, timeout=10)
    assert r.status_code == status
    error = openai_error(r)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_a_known_model_is_retrieved(served):
    _, url, _, _ = served
    assert httpx.get(url + "/v1/models/vismmoe-demo", timeout=10).json()["id"] == "vismmoe-demo"


# -- Ollama on /api/* ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,status,message", [
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": "ten"}}, 400,
     "'options.num_predict' must be a whole number"),
    ("/api/generate", {"prompt": "hi", "options": {"num_predict": 0}}, 400, "'options.num_predict' must be between"),
    ("/api/generate", {"prompt": "hi", "options": {"temperature": 9}}, 400, "'options.temperature' must be between"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"top_p": "x"}}, 400,
     "'options.top_p' must be a number"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"stop": [1]}}, 400, "'options.stop'"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "'tools[0].function' must be an object"),
    ("/api/generate", {"prompt": "hi", "tools": [{"type": "function"}]}, 400, "'tools' is not supported by /api/generate"),
    ("/api/generate", {"prompt": "hi", "format": "json"}, 400, "'format' is not supported"),
    ("/api/chat", {"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}, 404, "model 'llama3' not found"),
    ("/api/generate", {"model": "llama3", "prompt": "hi"}, 404, "model 'llama3' not found"),
    ("/api/show", {"model": "llama3"}, 404, "model 'llama3' not found"),
    ("/api/show", {}, 400, "'model'"),
    ("/api/pull", {"model": "llama3"}, 404, "no route /api/pull"),
])
def test_ollama_errors_are_strings_naming_the_fields_the_client_sent(served, path, body, status, message):
    engine, url, _, _ = served
    calls = len(engine.runner.calls)
    r = post(url, path, body)
    assert r.status_code == status
    error = ollama_error(r)
    assert message in error and "max_tokens" not in error
    assert len(engine.runner.calls) == calls


def test_ollama_answers_carry_load_duration_and_its_model_names(served):
    _, url, _, _ = served
    plain = post(url, "/api/generate", {"model": "vismmoe-demo:latest", "prompt": "hi", "stream": False,
                                        "options": {"num_predict": 3}}).json()
    assert plain["done"] and plain["response"] == "alpha beta gamma"[:len(plain["response"])] and plain["eval_count"] == 3
    assert plain["load_duration"] == 0 and plain["total_duration"] >= plain["eval_duration"] >= 0
    with httpx.stream("POST", url + "/api/chat", timeout=30, json={"model": "vismmoe-demo", "options": {"num_predict": 2},
                                                                   "messages": [{"role": "user", "content": "hi"}]}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["load_duration"] == 0 and lines[-1]["done_reason"] == "length"


def test_generate_takes_a_system_prompt(served):
    engine, url, _, _ = served
    calls = len(engine.runner.calls)
    r = post(url, "/api/generate", {"prompt": "hi", "system": "Be terse.", "stream": False, "options": {"num_predict": 1}})
    assert r.status_code == 200
    assert "<|im_start|>system\nBe terse.<|im_end|>" in engine.runner.calls[calls]["prompt"]


def test_ollamas_model_routes_have_the_fields_its_clients_read(served):
    engine, url, _, _ = served
    details_keys = {"parent_model", "format", "family", "families", "parameter_size", "quantization_level"}
    (tag,) = httpx.get(url + "/api/tags", timeout=10).json()["models"]
    assert tag["name"] == tag["model"] == "vismmoe-demo" and set(tag["details"]) == details_keys
    assert tag["size"] > 0 and len(tag["digest"]) == 64
    show = post(url, "/api/show", {"model": "vismmoe-demo"}).json()
    assert set(show["details"]) == details_keys and show["details"]["family"] == "qwen3_vl_moe"
    assert show["details"]["parameter_size"].endswith("M")  # the demo model: 2.9 M parameters
    assert show["model_info"]["qwen3_vl_moe.context_length"] == engine.context
    assert show["model_info"]["general.architecture"] == "qwen3_vl_moe"
    assert "vision" in show["capabilities"] and "num_predict 2000" in show["parameters"]
    assert post(url, "/api/show", {"name": "vismmoe-demo:latest"}).status_code == 200  # the older field name
    (running_model,) = httpx.get(url + "/api/ps", timeout=10).json()["models"]
    assert running_model["name"] == "vismmoe-demo" and running_model["size_vram"] == 0  # on the CPU
    assert running_model["expires_at"] and running_model["context_length"] == engine.context
    version = httpx.get(url + "/api/version", timeout=10).json()["version"]
    assert [int(part) for part in version.split(".")] >= [0, 1, 0]


# -- access: the key, the log ---------------------------------------------------------------------------

def test_the_api_key_guards_every_route_but_health_in_each_apis_shape(demo):
    _, app, _ = make_server(demo, api_key="s3cret")
    key = {"Authorization": "Bearer s3cret"}
    with running(app) as port:
        url = f"http://127.0.0.1:{port}"
        for path in ("/v1/models", "/v1/models/vismmoe-demo", "/metrics", "/api/tags", "/api/ps", "/api/version"):
            r = httpx.get(url + path, timeout=10)
            assert r.status_code == 401, path
            if path.startswith("/api/"):
                assert "API key" in ollama_error(r)
            else:
                assert openai_error(r)["type"] == "authentication_error"
            assert httpx.get(url + path, headers=key, timeout=10).status_code == 200, path
        for path, body in (("/api/show", {"model": "vismmoe-demo"}), ("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 1}}),
                           ("/v1/chat/completions", chat_body("hi", max_tokens=1))):
            assert post(url, path, body).status_code == 401, path
            assert post(url, path, body, headers=key).status_code == 200, path
        assert httpx.get(url + "/no-such-page", timeout=10).status_code == 401  # no probing for routes either
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_one_access_log_line_per_request_without_the_prompt(served, caplog):
    _, url, port, _ = served
    caplog.set_level(logging.INFO, logger="vismmoe_kt.serve.access")
    secret = "my-private-question-42"
    assert post(url, "/v1/chat/completions", chat_body(secret, max_tokens=3)).status_code == 200
    assert post(url, "/api/generate", {"prompt": secret, "stream": True, "options": {"num_predict": 2}}).status_code == 200
    assert httpx.get(url + "/v1/nope", timeout=10).status_code == 404
    assert post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": secret}], "tools": [1]}).status_code == 400

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "vismmoe_kt.serve.access"]
    assert until(lambda: len(lines()) >= 4), lines()  # each is written once its response has been sent
    chat, generate, missing, refused = lines()[:4]
    assert chat.startswith("127.0.0.1:") and " POST /v1/chat/completions 200 tokens=" in chat and chat.endswith("s")
    prompt_tokens, completion_tokens = chat.split("tokens=")[1].split()[0].split("+")
    assert int(prompt_tokens) > 5 and completion_tokens == "3"
    assert " POST /api/generate 200 tokens=" in generate and generate.split("tokens=")[1].split("+")[1].startswith("2 ")
    assert " GET /v1/nope 404 tokens=- " in missing
    assert " POST /v1/chat/completions 400 tokens=- " in refused
    assert not any(secret in line for line in lines())
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "vismmoe_kt.serve.access")


# -- metrics -----------------------------------------------------------------------------------------------

def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)}


def sample(families: dict, name: str, suffix: str = "_count", **labels) -> float:
    return sum(s.value for s in families[name].samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_are_typed_and_the_histograms_grow_with_a_request(served):
    engine, url, _, _ = served
    assert idle(engine)
    before = scrape(url)
    assert all(f.type != "unknown" and f.documentation for f in before.values()), \
        [f.name for f in before.values() if f.type == "unknown" or not f.documentation]
    expected = {"vismmoe_requests": "counter", "vismmoe_prompt_tokens": "counter", "vismmoe_generation_tokens": "counter",
                "vismmoe_time_to_first_token_seconds": "histogram", "vismmoe_inter_token_latency_seconds": "histogram",
                "vismmoe_e2e_request_latency_seconds": "histogram", "vismmoe_time_per_output_token_seconds": "histogram",
                "vismmoe_num_requests_waiting": "gauge", "vismmoe_num_requests_running": "gauge",
                "vismmoe_requests_rejected": "counter", "vismmoe_requests_cancelled": "counter"}
    assert {name: before[name].type for name in expected} == expected
    r = post(url, "/v1/chat/completions", chat_body("count me", stream=True, max_tokens=5))
    assert r.status_code == 200 and "data: [DONE]" in r.text
    after = scrape(url)
    histograms = ("vismmoe_time_to_first_token_seconds", "vismmoe_e2e_request_latency_seconds",
                  "vismmoe_time_per_output_token_seconds")
    assert all(sample(after, h) == sample(before, h) + 1 for h in histograms)
    # 5 tokens, 4 gaps between them
    assert sample(after, "vismmoe_inter_token_latency_seconds") == sample(before, "vismmoe_inter_token_latency_seconds") + 4
    assert sample(after, "vismmoe_generation_tokens", "_total") == sample(before, "vismmoe_generation_tokens", "_total") + 5
    assert sample(after, "vismmoe_requests", "_total", endpoint="/v1/chat/completions", status="200") == \
        sample(before, "vismmoe_requests", "_total", endpoint="/v1/chat/completions", status="200") + 1
    inf = [s for s in after["vismmoe_e2e_request_latency_seconds"].samples if s.labels.get("le") == "+Inf"]
    assert inf[0].value == sample(after, "vismmoe_e2e_request_latency_seconds")
