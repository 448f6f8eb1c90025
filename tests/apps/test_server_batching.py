"""`vismmoe-kt serve --max_batch N`: concurrent requests decoded together give each client the answer it
gets alone, a client that leaves frees its slot, and what batching needs is a clear error."""

import base64
import concurrent.futures
import io

import httpx
import pytest

from conftest import make_image, serve_in_thread
from vismmoe_kt.apps.cli import build_parser
from vismmoe_kt.apps.serve.command import build_server
from vismmoe_kt.errors import InputError

RULES = "optimize_rules/qwen3vl-offload.yaml"  # a VisDecoder: the lean decode path batching runs on


@pytest.fixture(scope="module")
def server(tiny_dir):
    yield from serve_in_thread(["--model_path", str(tiny_dir), "--optimize_config_path", RULES, "--generate_device",
                                "cpu", "--prefill_device", "cpu", "--max_new_tokens", "10", "--max_batch", "3",
                                "--max_queue", "8", "--slot_tokens", "512"])


def message(i: int) -> list[dict]:
    """Request i: its own question, and an image of its own for the even ones."""
    content = [{"type": "text", "text": f"Question {i}: what do you see?" + " more" * i}]
    if i % 2 == 0:
        buffer = io.BytesIO()
        make_image(64 + 16 * i, 48, seed=i).save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


def test_concurrent_requests_get_the_answers_they_get_alone(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    def ask(i: int) -> tuple[str, int]:
        out = client.chat.completions.create(model=model, messages=message(i), max_tokens=4 + i, temperature=0)
        return out.choices[0].message.content, out.usage.completion_tokens

    alone = [ask(i) for i in range(6)]  # one at a time: batches of one
    before = batch_steps(server)
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        together = list(pool.map(ask, range(6)))
    assert together == alone
    assert all(1 <= tokens <= 4 + i for i, (_, tokens) in enumerate(together))
    count, _ = batch_steps(server)
    # the batching thread ran them (whether two overlap depends on timing; test_batched.py checks that
    # rows decode together, deterministically)
    assert count > before[0]
    metrics = httpx.get(server + "/metrics").text
    tpot = next(l for l in metrics.splitlines() if l.startswith("vismmoe_time_per_output_token_seconds_count"))
    assert float(tpot.split()[-1]) >= 6  # requests of more than one token each observed
    gaps = next(l for l in metrics.splitlines() if l.startswith("vismmoe_inter_token_latency_seconds_count"))
    assert float(gaps.split()[-1]) >= sum(tokens - 1 for _, tokens in together)  # every gap between two tokens


def batch_steps(server: str) -> tuple[float, float]:
    """(decode steps, steps with more than one sequence) from /metrics."""
    text = httpx.get(server + "/metrics").text
    value = lambda name: float(next(l.split()[-1] for l in text.splitlines() if l.startswith(name)))  # noqa: E731
    count = value("vismmoe_decode_batch_size_count")
    return count, count - value('vismmoe_decode_batch_size_bucket{le="1.0"}')


def test_a_cancelled_request_stops_within_a_step_and_frees_its_slot(tiny_dir):
    """Through the engine itself (over HTTP this tiny model finishes 400 tokens before a client can leave)."""
    import asyncio

    from vismmoe_kt import load
    from vismmoe_kt.apps.serve.engine import Engine, Usage
    from vismmoe_kt.apps.serve.inputs import Limits, parse_chat

    model, processor = load(tiny_dir, RULES, generate_device="cpu", prefill_device="cpu", progress=False)
    # 2000 tokens take seconds even for this model: the cancellation lands long before the budget would end it
    engine = Engine(model, processor, "tiny", 2000, None, None, 4, Limits(), max_batch=2, slot_tokens=2048)

    async def scenario() -> tuple[Usage, Usage]:
        cancelled, kept = Usage(), Usage()
        job = await engine.submit(parse_chat({"messages": message(1), "max_tokens": 2000}, Limits()), cancelled)
        other = await engine.submit(parse_chat({"messages": message(3), "max_tokens": 6}, Limits()), kept)
        async for _ in job.pieces():
            break
        job.cancel()
        await asyncio.wait_for(job.finished.wait(), 60)
        await asyncio.wait_for(other.text(), 60)
        return cancelled, kept

    cancelled, kept = asyncio.run(scenario())
    assert cancelled.completion_tokens < 2000 and 1 <= kept.completion_tokens <= 6
    assert engine.runner.idle and engine._running == 0  # every slot and place given back


def test_what_batching_needs_is_a_clear_error(tiny_dir):
    args = build_parser().parse_args(["serve", "--model_path", str(tiny_dir), "--generate_device", "cpu",
                                      "--prefill_device", "cpu", "--max_batch", "2"])  # no rules: no lean decode path
    with pytest.raises(InputError, match="--max_batch 2: the model runner runs on the lean decode path"):
        build_server(args)


def test_a_prompt_longer_than_a_slot_is_refused(tiny_dir):
    for url in serve_in_thread(["--model_path", str(tiny_dir), "--optimize_config_path", RULES, "--generate_device",
                                "cpu", "--prefill_device", "cpu", "--max_batch", "2", "--slot_tokens", "16"]):
        reply = httpx.post(url + "/v1/chat/completions", json={"messages": message(5), "max_tokens": 4})
        assert reply.status_code == 400 and "--slot_tokens" in reply.json()["error"]["message"]


def test_the_demo_batches_without_a_rule_file():
    """`serve --demo --max_batch 8` names no rules: the demo's batching rules (demo/batching.yaml: our text
    model's forward, nothing pruned, every other module stock) run it, and 8 concurrent requests each get
    the answer they get alone, which is the stock demo's answer (greedy)."""
    from openai import OpenAI

    questions = ["What colour is the square?", "How many triangles are there?", "What shape is red?",
                 "Is there a circle?", "What colour is the triangle?", "How many shapes are there?",
                 "Describe the image.", "What is blue?"]

    def asker(url: str):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int) -> str:
            buffer = io.BytesIO()
            make_image(64 + 8 * i, 48, seed=i).save(buffer, format="PNG")
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                        base64.b64encode(buffer.getvalue()).decode()}}
            content = [image, {"type": "text", "text": questions[i]}]
            out = client.chat.completions.create(model="vismmoe-demo", messages=[{"role": "user", "content": content}],
                                                 max_tokens=6, temperature=0)
            return out.choices[0].message.content
        return ask

    common = ["--demo", "--generate_device", "cpu", "--prefill_device", "cpu", "--max_new_tokens", "6"]
    for stock in serve_in_thread(common):
        stock_answers = [asker(stock)(i) for i in range(8)]
    for url in serve_in_thread([*common, "--max_batch", "8", "--max_queue", "8", "--slot_tokens", "512"]):
        ask = asker(url)
        alone = [ask(i) for i in range(8)]
        before = batch_steps(url)
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            together = list(pool.map(ask, range(8)))
        assert batch_steps(url)[0] > before[0]  # a ModelRunner decoded them
    assert together == alone == stock_answers
    assert len(set(alone)) > 1  # different questions, different answers: the rows did not mix


def test_max_batch_1_and_4_are_one_engine_with_the_same_greedy_answers():
    """`--max_batch 1` is the batching engine with one slot: the stock demo (no lean decode path) through
    the SerialRunner (transformers' loop), the demo's batching rules through a ModelRunner of one slot,
    and `--max_batch 4` through one of four, all one Engine class; concurrent clients get the same greedy
    answers from each."""
    from conftest import running_app
    from vismmoe_kt.apps.serve.engine import Engine
    from vismmoe_kt.apps.serve.runners import SerialRunner
    from vismmoe_kt.demo.tiny import BATCHING_RULES
    from vismmoe_kt.engine.runner import ModelRunner

    questions = ["What colour is the square?", "How many triangles are there?", "What shape is red?",
                 "Describe the image."]
    common = ["--demo", "--generate_device", "cpu", "--prefill_device", "cpu", "--max_new_tokens", "6",
              "--max_queue", "4", "--slot_tokens", "512"]
    setups = {"serial": ["--max_batch", "1"], "one slot": ["--max_batch", "1", "--optimize_config_path",
                                                           str(BATCHING_RULES)], "four slots": ["--max_batch", "4"]}
    answers, runners = {}, {}
    for setup, flags in setups.items():
        app = build_server(build_parser().parse_args(["serve", *common, *flags]))
        engine = app.state.engine
        assert type(engine) is Engine and engine.max_batch == int(flags[1])
        runners[setup] = type(engine.runner)
        with running_app(app) as port:
            from openai import OpenAI

            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

            def ask(i: int) -> str:
                buffer = io.BytesIO()
                make_image(64 + 8 * i, 48, seed=i).save(buffer, format="PNG")
                image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                            base64.b64encode(buffer.getvalue()).decode()}}
                out = client.chat.completions.create(model="vismmoe-demo", max_tokens=6, temperature=0, messages=[
                    {"role": "user", "content": [image, {"type": "text", "text": questions[i]}]}])
                return out.choices[0].message.content
            with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
                answers[setup] = list(pool.map(ask, range(4)))
    assert runners == {"serial": SerialRunner, "one slot": ModelRunner, "four slots": ModelRunner}
    assert answers["serial"] == answers["one slot"] == answers["four slots"]
    assert len(set(answers["serial"])) > 1  # different questions, different answers: the rows did not mix
