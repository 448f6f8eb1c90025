"""Running a command under torchrun: rank 0 does the work (chat, serve, bench), the other ranks follow.

Expert parallelism splits each MoE layer's experts over the ranks, so every rank must enter every MoE
layer's exchange. With one front end (the HTTP server, the chat prompt) only rank 0 has requests; the
others follow it. Before each pass through the MoE layers (announced where it enters the first
expert-parallel layer: a forward, a chunk of a prompt, prompts prefilled together) rank 0 broadcasts
STEP. A decode step, lean or batched, announces itself from its step hooks as FIXED_STEP with its
rows: its exchanges are the fixed-size ones, with no read on the host (`context.ep_fixed_rows` on
every rank). Each follower then calls its expert-parallel operators, layer by layer in the model's
order, with no tokens of its own, which serves its experts to rank 0's tokens. While idle, rank 0
broadcasts HEARTBEAT every few seconds, so a follower can tell a quiet leader from a lost one (the
group's timeout); STOP ends the followers. A lock keeps a heartbeat from landing inside a pass's
exchanges (collectives must be issued in the same order on every rank).
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.context import context_of_model
from ..errors import FollowerDone, InputError
from .expert_parallel import guarded

STOP, STEP, HEARTBEAT, FIXED_STEP = 0, 1, 2, 3
current_leader: "Leader | None" = None
joined: "Group | None" = None  # this process's group, once join_from_env made it


@dataclass
class Group:
    rank: int
    world: int
    device: str  # this rank's device: cuda:LOCAL_RANK, or cpu

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join_from_env(ep_size: int | None, timeout_s: float) -> Group | None:
    """The torchrun launch's process group (None when not launched by torchrun with several processes)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if ep_size not in (None, 1):
            raise InputError(f"--ep-size {ep_size} needs {ep_size} processes: launch with "
                             f"`torchrun --nproc-per-node {ep_size} -m vismmoe_kt ...`")
        return None
    if ep_size not in (None, world):
        raise InputError(f"--ep-size {ep_size}: this launch has {world} processes and expert parallelism spans all "
                         f"of them; pass --ep-size {world} or leave it out")
    if timeout_s <= 0:
        raise InputError(f"--ep_timeout must be positive, got {timeout_s}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise InputError(f"rank with LOCAL_RANK {local} has no GPU: this host has {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    global joined
    joined = Group(dist.get_rank(), world, device)
    return joined


def expert_parallel_operators(model: Any) -> list:
    """The model's expert-parallel operators in layer order (they register in the load context)."""
    context = context_of_model(model)
    ops = list(context.expert_parallel) if context is not None else []
    if not ops:
        raise InputError("this launch has several processes, but the rule file has no expert-parallel operators: "
                         "use the family's expert-parallel rule file, optimize_rules/qwen3vl-ep.yaml, glm4v-ep.yaml or "
                         "deepseek-ocr2-ep.yaml (or run a single process)")
    return ops


@guarded
def _broadcast(command: torch.Tensor) -> None:
    dist.broadcast(command, src=0)


class Leader:
    """Rank 0: announces each pass through the MoE layers, keeps the followers company when idle."""

    def __init__(self, model: Any, group: Group, heartbeat_s: float = 5.0):
        global current_leader
        ops = expert_parallel_operators(model)
        self.device = torch.device(group.device)
        self.lock = threading.RLock()
        self.stopped = threading.Event()
        # a pass is announced where it enters the first expert-parallel layer and ends after the last: every
        # pass that runs the layers, however the engine got there (a forward, a chunk of a prompt, prompts
        # prefilled together), and none that does not (a forward that only gathers a prompt's inputs)
        self._in_pass = False
        self._hooks = [ops[0].register_forward_pre_hook(self._before),
                       ops[-1].register_forward_hook(self._after, always_call=True)]
        # decode steps (lean or batched) run without the language model's forward: announce those too,
        # with their rows, as steps whose exchanges are the fixed-size ones (context.ep_fixed_rows)
        self._context = context_of_model(model)
        self._step_hooks = self._context.ep_step_hooks
        self._step_hook = (self._before_step, self._after_step)
        self._step_hooks.append(self._step_hook)
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), name="vismmoe-ep-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        current_leader = self

    def _send(self, value: int, rows: int = 0) -> None:
        _broadcast(torch.tensor([value, rows], device=self.device))

    def _before(self, module: Any, args: Any) -> None:
        if self._context.ep_fixed_rows:  # a decode step's layers: the step hook announced it
            return
        self.lock.acquire()  # released by _after, also when the last layer raises
        self._in_pass = True
        self._send(STEP)

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if self._in_pass:
            self._in_pass = False
            self.lock.release()

    def _before_step(self, rows: int) -> None:
        self.lock.acquire()  # released by _after_step
        self._send(FIXED_STEP, rows)
        self._context.ep_fixed_rows = self._context.ep_step_rows = rows

    def _after_step(self) -> None:
        self._context.ep_fixed_rows = 0
        self.lock.release()

    def _beat(self, every_s: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self.stopped.wait(every_s):
            with self.lock:
                if not self.stopped.is_set():
                    self._send(HEARTBEAT)

    def stop(self) -> None:
        """Tell the followers to leave (once)."""
        with self.lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
            self._send(STOP)
        for hook in self._hooks:
            hook.remove()
        if self._step_hook in self._step_hooks:
            self._step_hooks.remove(self._step_hook)


def follow(model: Any, group: Group) -> int:
    """A follower's life: serve this rank's experts to rank 0's forwards until STOP. Returns the steps."""
    ops = expert_parallel_operators(model)
    shape = model.vismmoe.adapter.moe_shape(model.config)
    dtype = model.get_input_embeddings().weight.dtype
    device = torch.device(group.device)
    hidden = torch.zeros(0, shape.hidden, dtype=dtype, device=device)
    chosen = torch.zeros(0, shape.top_k, dtype=torch.long, device=device)
    weights = torch.zeros(0, shape.top_k, dtype=dtype, device=device)
    command = torch.zeros(2, dtype=torch.long, device=device)  # (what, the decode step's rows)
    context = context_of_model(model)
    steps = 0
    with torch.inference_mode():
        while True:
            _broadcast(command)
            value, rows = command.tolist()
            if value == STOP:
                return steps
            if value in (STEP, FIXED_STEP):
                context.ep_fixed_rows = rows if value == FIXED_STEP else 0  # the exchanges rank 0's pass makes
                try:
                    for op in ops:
                        op(hidden, chosen, weights)
                finally:
                    context.ep_fixed_rows = 0
                steps += 1


def finish() -> None:
    """At the end of a command on any rank: rank 0 releases the followers; everyone leaves the group."""
    global current_leader
    if current_leader is not None:
        current_leader.stop()
        current_leader = None
    if dist.is_available() and dist.is_initialized():
        from .replication import wait_for_moves

        wait_for_moves()  # Async EPLB's last moves: no collective in flight when the group goes
        dist.destroy_process_group()


def start(model: Any, group: Group) -> None:
    """After loading: rank 0 becomes the leader and goes on with the command; a follower follows, then
    ends the command with FollowerDone."""
    if group.leader:
        Leader(model, group)
        return
    raise FollowerDone(follow(model, group))
