"""Torch CPU backend: oneDNN matmuls on the caller's expert tensors, in place, on a worker thread.

It copies nothing: given views into the ExpertStore's page-locked blocks, it reads them directly, so
hybrid mode keeps one host copy of the experts. torch releases the GIL inside its kernels, so the
worker runs while the main thread keeps the GPU busy. Threads: torch's intra-op pool
(`torch.set_num_threads`, which `--cpu_infer` sets).

Where the model itself runs on the CPU there is nothing to overlap (both shares compute on the same cores),
and a worker thread costs: once it has run a torch op it keeps an OpenMP team of its own, whose threads spin
on the cores the main thread's parallel ops then wait for (on a 2-core machine a grouped GEMM of the main
thread went from about 1 ms to 2-7 ms). There (`in_caller`) the backend computes in the submitting thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F


def pair_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over the (token, k) pairs with an id >= 0, one matmul pair per expert used."""
    out = torch.zeros_like(hidden)
    inter = gate_up.shape[1] // 2
    for expert in torch.unique(expert_ids[expert_ids >= 0]).tolist():
        token, slot = torch.where(expert_ids == expert)
        x = hidden[token].to(gate_up.dtype)
        gate_up_out = x @ gate_up[expert].T
        y = (F.silu(gate_up_out[:, :inter]) * gate_up_out[:, inter:]) @ down[expert].T
        out.index_add_(0, token, (y * weights[token, slot, None].to(y.dtype)).to(out.dtype))
    return out


class _FutureTask:
    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> torch.Tensor:
        return self.future.result()


class _DoneTask:
    """A share computed in the caller's thread at submit."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


class TorchCpuBackend:
    name = "torch"

    def __init__(self, in_caller: bool = False):
        """`in_caller`: compute in the thread that submits (the model runs on the CPU: see above)."""
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None if in_caller else ThreadPoolExecutor(max_workers=1, thread_name_prefix="vismmoe-cpu-experts")

    @property
    def in_caller(self) -> bool:
        return self.pool is None

    def add_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.layers[layer] = (gate_up, down)

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> _FutureTask:
        gate_up, down = self.layers[layer]
        if self.pool is None:
            return _DoneTask(pair_experts(hidden, expert_ids, weights, gate_up, down))
        return _FutureTask(self.pool.submit(pair_experts, hidden, expert_ids, weights, gate_up, down))

    @property
    def host_bytes(self) -> int:
        return 0  # reads the tensors it was given

    def describe(self) -> str:
        where = "in the caller's thread" if self.in_caller else "on a worker thread"
        return f"torch ({torch.get_num_threads()} threads {where}, reads the expert store in place)"
