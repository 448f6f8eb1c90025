"""Data parallel + expert parallelism (parallel/lockstep.py): under torchrun (2 CPU processes, gloo), each
rank serves requests of its own through the expert-parallel rule file. Rank 0 decodes three requests
together (batched generation, one prompt with a picture); rank 1 decodes one request alone with the lean
engine and is done first. Decode steps, lean or batched, exchange fixed-size buffers, which the other
rank joins. It then
serves its experts to rank 0's passes until both are idle. Every request gets the tokens it gets in one
process without expert parallelism (fp32)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.engine.generation import generate

from conftest import make_image

pytestmark = pytest.mark.distributed

BIN = os.path.dirname(sys.executable)
EP_RULES = "optimize_rules/qwen3vl-ep.yaml"

# what each rank decodes: (prompt, with a picture, new tokens)
WORK = {0: [("Describe the picture.", True, 6), ("hello there", False, 3), ("what is this about", False, 5)],
        1: [("two words", False, 2)]}

SCRIPT = r"""
import json, sys
import torch
from vismmoe_kt import load
from vismmoe_kt.engine.generation import generate_batch
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.parallel import launch
from vismmoe_kt.parallel.lockstep import Lockstep
sys.path.insert(0, "tests")
from parallel.test_data_parallel import WORK, requests_of

model_dir, out, capture = sys.argv[1], sys.argv[2], sys.argv[3] == "capture"
group = launch.join_from_env(2, 120)
extra = dict(graphs="replay", capture_exchange=True) if capture else {}
model, processor = load(model_dir, "optimize_rules/qwen3vl-ep.yaml", generate_device="cpu", prefill_device="cpu",
                        progress=False, **extra)
work = WORK[group.rank]
requests = requests_of(processor, work)
with torch.inference_mode(), Lockstep(model, group) as lockstep:
    if len(work) > 1:
        got = generate_batch(model, requests, [n for *_, n in work], max_batch=len(work),
                             min_new_tokens=max(n for *_, n in work))
    else:
        got = [generate(model, requests[0], work[0][2], min_new_tokens=work[0][2])]
tokens = [g[0, r["input_ids"].shape[1]:].tolist() for g, r in zip(got, requests)]
fixed = sum(op.fixed_passes for op in lockstep.ops)
json.dump({"tokens": tokens, "passes": lockstep.passes, "idle_passes": lockstep.idle_passes, "fixed_exchanges": fixed},
          open(f"{out}/rank{group.rank}.json", "w"))
launch.finish()
"""


def requests_of(processor, work):
    """The processor's inputs for each (prompt, with a picture, tokens)."""
    from vismmoe_kt.engine.inputs import build_inputs, user_turn

    return [build_inputs(processor, [user_turn(prompt, 1 if picture else 0)], [make_image()] if picture else [],
                         "cpu") for prompt, picture, _ in work]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("capture", [False, True])  # with capture_exchange, decode steps' exchanges in the graphs
def test_every_rank_serves_its_own_requests_in_lockstep(tiny_dir, tmp_path, capture):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    cmd = [os.path.join(BIN, "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()), str(script),
           str(tiny_dir), str(tmp_path), "capture" if capture else "eager"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    model, processor = load(tiny_dir, None, generate_device="cpu", prefill_device="cpu", progress=False)
    with torch.inference_mode():
        for rank, result in enumerate(ranks):
            for (prompt, picture, n), request, got in zip(WORK[rank], requests_of(processor, WORK[rank]),
                                                         result["tokens"]):
                alone = generate(model, request, n, min_new_tokens=n)[0, request["input_ids"].shape[1]:].tolist()
                assert got == alone, (rank, prompt)
    # rank 1 ran a prefill and one lean decode step, rank 0 a prompt pass and batched steps; rank 1 then
    # served rank 0's passes with no tokens: both took part in every round
    # (with graphs, the step's capture is checked against an eager run of it: a second step to the group)
    assert ranks[1]["passes"] == (3 if capture else 2) and ranks[1]["idle_passes"] > 0
    assert ranks[0]["passes"] + ranks[0]["idle_passes"] == ranks[1]["passes"] + ranks[1]["idle_passes"]
    # decode steps, lean and batched, exchange fixed-size buffers on both ranks: rank 1's one step and
    # rank 0's batched steps, in each of the 4 layers
    assert ranks[0]["fixed_exchanges"] == ranks[1]["fixed_exchanges"] > 4
