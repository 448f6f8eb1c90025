"""`vismmoe-kt serve` on the demo model (trained: it may stop before max_tokens): the official openai client, Ollama endpoints, bad input,
concurrent load. The server runs in this process on a free loopback port."""

import base64
import concurrent.futures
import io
import json

import httpx
import pytest

from conftest import make_image, serve_in_thread


@pytest.fixture(scope="module")
def server():
    yield from serve_in_thread(["--demo", "--generate_device", "cpu", "--prefill_device", "cpu", "--max_new_tokens", "8",
                                "--max_queue", "4", "--max_image_mb", "1"])


def data_url(width=64, height=48, seed=0) -> str:
    buffer = io.BytesIO()
    make_image(width, height, seed=seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(text, url=None):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url or data_url()}},
                                         {"type": "text", "text": text}]}]


def test_openai_client_streamed_and_plain_answers_agree(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["vismmoe-demo"]
    plain = client.chat.completions.create(model="vismmoe-demo", messages=image_message("Describe the image."), max_tokens=8)
    assert plain.choices[0].message.role == "assistant" and 1 <= plain.usage.completion_tokens <= 8
    assert plain.usage.prompt_tokens > 20
    stream = client.chat.completions.create(model="vismmoe-demo", messages=image_message("Describe the image."),
                                            max_tokens=8, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert streamed == plain.choices[0].message.content
    # stream_options.include_usage: one last chunk without choices that carries the usage
    chunks = list(client.chat.completions.create(model="vismmoe-demo", messages=image_message("Describe the image."),
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_the_load_test_drives_the_server_at_each_concurrency(server, tmp_path):
    """benchmarks/load_test.py against this server: a row per concurrency, every request answered,
    no answer changed by the load, and its table and plot written."""
    from benchmarks.load_test import main

    assert main(["--out", str(tmp_path), "--url", server + "/v1", "--concurrency", "1", "3", "--requests", "4",
                 "--max_tokens", "6", "--timeout_s", "120"]) == 0
    rows = json.loads((tmp_path / "load_test.json").read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert all(r["errors"] == 0 and r["lost"] == 0 and r["changed_answers"] == 0 and r["tokens"] >= 4 for r in rows)
    assert rows[0]["correct"] == rows[1]["correct"]  # the known answers the demo model gets do not move with the load
    assert all(r["ttft_p50_s"] is not None and r["ttft_p50_s"] <= r["ttft_p95_s"] for r in rows)
    assert "| 3 |" in (tmp_path / "load_test.md").read_text()
    assert (tmp_path / "load_test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def good(server):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("case,status,message", [
    ("malformed", 400, "not valid JSON"),
    ("wrong_type", 400, "'temperature' must be a number"),
    ("empty", 400, "'messages' must be a non-empty list"),
    ("not_image", 400, "not a readable image"),
    ("too_big", 400, "over the 1 MiB limit"),
    ("too_many", 400, "at most 4 images per request"),
    ("too_long", 400, "this model's context of"),
    ("unsupported", 400, "'n' other than 1 is not supported"),
    ("remote", 400, "remote image URLs are not fetched"),
    ("unknown_model", 404, "the model 'gpt-9' does not exist"),
])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server, case, status, message):
    bodies = {
        "wrong_type": {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        "empty": {"messages": []},
        "not_image": {"messages": image_message("x", "data:image/png;base64," + base64.b64encode(b"nope" * 50).decode())},
        "too_big": {"messages": image_message("x", "data:image/png;base64," + "A" * (2 * 2**20))},
        "too_many": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url()}}] * 5}]},
        "too_long": {"messages": [{"role": "user", "content": "x" * 5000}]},
        "unsupported": {"messages": [{"role": "user", "content": "hi"}], "n": 2},
        "remote": {"messages": image_message("x", "https://example.com/cat.png")},
        "unknown_model": {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
    }
    if case == "malformed":
        r = httpx.post(server + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    else:
        r = httpx.post(server + "/v1/chat/completions", json=bodies[case], timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    good(server)


def test_ollama_endpoints(server):
    tags = httpx.get(server + "/api/tags").json()
    assert tags["models"][0]["name"] == "vismmoe-demo"
    image = data_url().split(",", 1)[1]
    with httpx.stream("POST", server + "/api/chat", timeout=60,
                      json={"messages": [{"role": "user", "content": "What is this?", "images": [image]}]}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and 1 <= lines[-1]["eval_count"] <= 8 and not lines[0]["done"]
    text = "".join(l["message"]["content"] for l in lines)
    plain = httpx.post(server + "/api/generate", json={"prompt": "What is this?", "images": [image], "stream": False},
                       timeout=60).json()
    assert plain["done"] and isinstance(plain["response"], str) and isinstance(text, str)


def test_health_metrics_and_page(server):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    good(server)
    metrics = httpx.get(server + "/metrics").text
    assert 'vismmoe_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert "vismmoe_time_to_first_token_seconds_count" in metrics and "vismmoe_num_requests_waiting 0.0" in metrics
    page = httpx.get(server + "/").text
    assert "<form" in page and "/v1/chat/completions" in page
    assert 'src="http' not in page and 'href="http' not in page and "import(" not in page  # nothing fetched from outside


def test_concurrent_clients_get_their_own_answers_or_a_clean_429(server):
    prompts = [f"Tell me about number {i}" for i in range(5)]

    def ask(prompt):
        r = httpx.post(server + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 6})
        return r.status_code, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.headers.get("retry-after"))

    expected = {p: ask(p)[1] for p in prompts}  # greedy: each prompt has one answer
    jobs = [prompts[i % len(prompts)] for i in range(50)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(ask, jobs))
    answered = [(p, text) for p, (status, text) in zip(jobs, results) if status == 200]
    refused = [text for status, text in results if status == 429]
    assert len(answered) + len(refused) == 50
    assert answered and all(text == expected[p] for p, text in answered)  # nobody got another's reply
    assert all(retry == "1" for retry in refused)
    good(server)


@pytest.mark.parametrize("rules", [None, "optimize_rules/qwen3vl-offload.yaml"])  # transformers' loop; lean decode
def test_a_cancelled_request_stops_generating_and_frees_its_slot(reference, rules):
    """Closing the stream (a client that went away) stops the generation early (transformers' loop through
    the SerialRunner; the lean decode path through a ModelRunner of one slot) and frees its slot."""
    import asyncio

    from vismmoe_kt import load
    from vismmoe_kt.apps.serve.engine import Engine, Usage
    from vismmoe_kt.apps.serve.inputs import ChatRequest
    from vismmoe_kt.demo.tiny import demo_model_dir

    model, processor = load(demo_model_dir(), rules, generate_device="cpu", prefill_device="cpu", progress=False)
    engine = Engine(model, processor, "demo", max_new_tokens=400)
    request = ChatRequest([{"role": "user", "content": [{"type": "text", "text": "hello"}]}])

    async def scenario():
        usage = Usage()

        async def consume():
            async for _ in engine.stream(request, usage):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        second = Usage()  # waits for the slot, which the cancelled generation gives back within a step
        text = "".join([p async for p in engine.stream(ChatRequest(request.messages, max_tokens=2), second)])
        assert engine.runner.idle and engine._running == engine._waiting == 0
        return usage, second, text

    usage, second, text = asyncio.run(scenario())
    assert 0 < usage.completion_tokens < 400  # stopped early, not run to the limit
    assert second.completion_tokens == 2


def test_memory_is_stable_under_repeated_requests(server):
    import psutil

    def burst():
        for i in range(15):
            r = httpx.post(server + "/v1/chat/completions", timeout=60,
                           json={"messages": image_message(f"picture {i}"), "max_tokens": 4})
            assert r.status_code == 200
    burst()  # warm-up: allocator pools, lazily built kernels
    before = psutil.Process().memory_info().rss
    burst()
    burst()
    growth = psutil.Process().memory_info().rss - before
    assert growth < 150 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB over 30 requests"


def test_lean_decode_server_answers_like_transformers_loop():
    """The engine on the lean decode path (rules with a VisDecoder) streams the text of the plain
    transformers loop, greedy, for an image request, and honours `stop`."""
    import asyncio

    from vismmoe_kt import load
    from vismmoe_kt.apps.serve.engine import Engine, Usage
    from vismmoe_kt.apps.serve.inputs import ChatRequest, Limits, parse_chat
    from vismmoe_kt.demo.tiny import demo_model_dir

    request = parse_chat({"messages": image_message("Describe the image."), "max_tokens": 12, "temperature": 0},
                         Limits(4, 2**20, None))
    answers = {}
    for rules in (None, "optimize_rules/qwen3vl-offload.yaml"):
        model, processor = load(demo_model_dir(), rules, generate_device="cpu", prefill_device="cpu", progress=False)
        engine = Engine(model, processor, "demo", max_new_tokens=12)

        async def ask(req):
            usage = Usage()
            return "".join([p async for p in engine.stream(req, usage)]), usage
        answers[rules] = asyncio.run(ask(request))
        if rules is not None:
            text = answers[rules][0]
            cut = text[len(text) // 2:][:2] or text[:1]
            stopped, _ = asyncio.run(ask(ChatRequest(request.messages, request.images, 12, 0, stop=[cut])))
            assert stopped == text[:text.index(cut)]
    (hf_text, hf_usage), (lean_text, lean_usage) = answers.values()
    assert lean_text == hf_text and lean_usage.completion_tokens == hf_usage.completion_tokens == 12
