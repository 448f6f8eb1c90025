"""`vismmoe-kt chat`, `serve` and `python -m benchmarks.bench` under torchrun with the expert-parallel rule
file (2 CPU processes, gloo): rank 0 answers, rank 1 follows with its half of the experts, and the answer is
the single-process one (fp32, exact). Then everything exits: rank 0 releases the follower."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.distributed

BIN = os.path.dirname(sys.executable)
EP_RULES = "optimize_rules/qwen3vl-ep.yaml"
PROMPT = "Hello there"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(model_dir, *prefix, extra=()):
    cmd = [*prefix, "chat", "--model_path", str(model_dir), "--prompt", PROMPT, "--greedy", "--max_new_tokens", "8",
           "--cpu_infer", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def torchrun(port, module="vismmoe_kt"):
    return [os.path.join(BIN, "torchrun"), "--nproc-per-node", "2", "--master-port", str(port), "-m", module]


def wait_until_up(server, ports, seconds=300):  # model loads on a 2-core machine
    """Until every port answers /health (the launch must not have exited meanwhile)."""
    deadline = time.time() + seconds
    for port in ports:
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, f"the server on port {port} did not come up"
            time.sleep(0.5)


def reply_of(stdout: str) -> str:
    return stdout[: stdout.index("prompt eval count:")].strip()


@pytest.fixture(scope="module")
def single(tiny_dir):
    result = chat(tiny_dir, os.path.join(BIN, "vismmoe-kt"))
    assert result.returncode == 0, result.stderr[-2000:]
    return reply_of(result.stdout)


@pytest.mark.parametrize("graphs,capture", [("off", False), ("replay", False), ("replay", True)])
def test_chat_under_torchrun_answers_like_one_process(tiny_dir, single, graphs, capture):
    """Lean decode steps, eager or through the graph plumbing; with capture_exchange, the fixed-size
    exchanges inside the captured pieces (rank 0 replays them, rank 1 runs them eagerly; a capture's
    warm-up run skips them, so each step runs them once on both ranks)."""
    result = chat(tiny_dir, *torchrun(free_port()), extra=("--optimize_config_path", EP_RULES, "--ep-size", "2",
                                                           "--set", f"graphs={graphs}", "--stats",
                                                           "--set", f"capture_exchange={str(capture).lower()}"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert reply_of(result.stdout) == single
    steps = int(re.search(r"decode_steps=(\d+)", result.stdout).group(1))
    graphed = int(re.search(r"decode_graphed_steps=(\d+)", result.stdout).group(1))
    assert steps == 7 and graphed == (7 if graphs == "replay" else 0)  # the lean path, announced to rank 1
    assert "ep_size=2, local_experts=32" in result.stdout  # summed over 4 layers: 8 of 16 experts each
    # the lean steps' exchanges are the fixed-size ones (no host reads): 4 layers in each of 7 steps at least
    assert int(re.search(r"ep_fixed_exchanges=(\d+)", result.stdout).group(1)) >= 28
    if graphs == "replay":  # the exchanges run between the captured pieces, eagerly, or inside them
        eager = int(re.search(r"decode_eager_pieces_per_step=(\d+)", result.stdout).group(1))
        assert (eager == 0) if capture else (eager > 0), eager
    assert result.stdout.count("prompt eval count:") == 1  # only rank 0 answers


@pytest.mark.parametrize("batching", [(), ("--max_batch", "2", "--prefill_chunk", "8")])
def test_serve_under_torchrun_answers_and_shuts_down(tiny_dir, single, batching):
    """Rank 0 serves, rank 1 follows; with continuous batching the prompt is prefilled 8 tokens a pass,
    each pass announced to the follower where it enters the expert-parallel layers."""
    port = free_port()
    cmd = [*torchrun(free_port()), "serve", "--model_path", str(tiny_dir), "--optimize_config_path", EP_RULES,
           "--port", str(port), "--cpu_infer", "1", *batching]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_until_up(server, [port])
        time.sleep(6)  # long enough for a heartbeat: the follower must treat it as a no-op
        body = {"model": tiny_dir.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"].strip() == single
    finally:
        rank0 = next(p for p in psutil.Process(server.pid).children(recursive=True) if _rank(p) == "0")
        rank0.send_signal(signal.SIGINT)  # rank 0 stops serving and releases the follower
        try:
            out, _ = server.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            pytest.fail("the launch did not exit after rank 0 stopped")
    assert server.returncode == 0, out[-3000:]  # both ranks ended cleanly: the follower got STOP
    assert "Traceback" not in out, out[-3000:]


def test_bench_under_torchrun_measures_the_expert_parallel_configurations(tmp_path):
    out = tmp_path / "bench"
    cmd = [*torchrun(free_port(), "benchmarks.bench"), "--demo", "--image-sizes", "64", "--decode-tokens", "2",
           "--warmup", "0", "--repeats", "1", "--cpu_infer", "1", "--output", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["ep_size"] == 2
    assert [(r["config"], r["status"]) for r in data["rows"]] == [
        (name, "ok") for name in ("ep", "ep-realb", "ep-graphs", "ep-realb-seq", "ep-fixed", "ep-lowprec-all",
                                  "ep-eplb", "ep-eplb-async")]
    assert all(r["decode_tok_s"]["median"] > 0 for r in data["rows"])
    assert result.stdout.count("| ep |") == 1  # rank 0 reports, the follower does not


def test_bench_under_torchrun_measures_data_parallel_concurrency(tmp_path):
    """--concurrency under torchrun: every rank decodes N requests of its own (data parallel + expert
    parallelism, in lockstep); rank 0 reports the group's figures and each rank's."""
    out = tmp_path / "bench"
    cmd = [*torchrun(free_port(), "benchmarks.bench"), "--demo", "--configs", "ep-realb", "--image-sizes", "64",
           "--decode-tokens", "3", "--warmup", "0", "--repeats", "1", "--concurrency", "2", "--cpu_infer", "1",
           "--output", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = json.loads((out / "bench.json").read_text())["rows"]
    [level] = row["concurrency"]
    assert level["status"] == "ok" and level["ranks"] == 2 and level["requests"] == 4
    assert level["aggregate_tok_s"] > 0 and level["itl_p50_s"] > 0
    assert [r["requests"] for r in level["per_rank"]] == [2, 2]
    # each rank's own expert compute in the timed run, and the straggler time it leaves (>= 0 by definition)
    assert len(level["moe_compute_s_per_rank"]) == 2 and min(level["moe_compute_s_per_rank"]) > 0
    assert level["straggler_s"] >= 0 and 0 <= level["straggler_share"] <= 1  # 1: one rank did all the work
    # both ranks ran passes of their own (their prefills and decode steps), in step with each other
    assert all(r["passes"] > 0 for r in level["per_rank"])
    assert "2 on each of 2 ranks" in result.stdout


def test_bench_under_torchrun_refuses_single_process_configurations(tiny_dir):
    cmd = [*torchrun(free_port(), "benchmarks.bench"), "--demo", "--configs", "lru", "--image-sizes", "64"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "--configs lru: under torchrun only the expert-parallel configurations run" in result.stderr


def _rank(process) -> str | None:
    try:
        return process.environ().get("RANK")
    except psutil.Error:  # a short-lived child (or one that just ended)
        return None


def test_ep_size_without_torchrun_says_how_to_launch(tiny_dir):
    result = chat(tiny_dir, os.path.join(BIN, "vismmoe-kt"), extra=("--optimize_config_path", EP_RULES, "--ep-size", "2"))
    assert result.returncode == 2
    assert "--ep-size 2 needs 2 processes: launch with `torchrun --nproc-per-node 2" in result.stderr


def test_several_processes_need_the_expert_parallel_rules(tiny_dir):
    result = chat(tiny_dir, *torchrun(free_port()))
    assert result.returncode != 0
    assert "the rule file has no expert-parallel operators" in result.stderr + result.stdout


def test_serve_data_parallel_every_rank_answers_and_all_shut_down(tiny_dir, single):
    """serve --data_parallel: each rank serves on a port of its own (continuous batching), both answer
    at once as one process does; one rank shutting down stops the other (the group stops at a round)."""
    port = free_port()
    cmd = [*torchrun(free_port()), "serve", "--model_path", str(tiny_dir), "--optimize_config_path", EP_RULES,
           "--port", str(port), "--cpu_infer", "1", "--data_parallel", "--max_batch", "2"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_until_up(server, [port, port + 1])
        body = {"model": tiny_dir.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                "temperature": 0}
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # two requests on each rank, all at once
            answers = list(pool.map(lambda p: httpx.post(f"http://127.0.0.1:{p}/v1/chat/completions", json=body,
                                                         timeout=300), (port, port + 1, port, port + 1)))
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"].strip() == single
    finally:
        rank1 = next((p for p in psutil.Process(server.pid).children(recursive=True) if _rank(p) == "1"), None)
        if rank1 is not None:
            rank1.send_signal(signal.SIGINT)  # one rank stops: the group stops, rank 0's server too
        try:
            out, _ = server.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            pytest.fail("the launch did not exit after rank 1 stopped")
    assert server.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "rank 0 serving on" in out and "rank 1 serving on" in out
