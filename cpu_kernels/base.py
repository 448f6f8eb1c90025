"""The interface every CPU expert backend offers.

Shapes: T tokens, K routed experts per token, E experts of a layer, H hidden, I expert intermediate.
`submit(layer, hidden[T, H], expert_ids[T, K], weights[T, K])` runs on host tensors and returns at
once with a task; `task.wait()` gives `out[T, H]` = sum over k of weights[t, k] * expert(hidden[t]).
An expert id of -1 means "not here" (that pair is computed elsewhere, e.g. on the GPU) and adds
nothing. Inputs must stay alive until `wait()` returns; the task holds them.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CpuTask(Protocol):
    def wait(self) -> torch.Tensor: ...


class CpuExpertBackend(Protocol):
    name: str

    def add_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Serve `layer` with experts gate_up (E, 2I, H) and down (E, H, I) (host tensors)."""

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> CpuTask: ...

    @property
    def host_bytes(self) -> int:
        """Host memory this backend holds beyond what it was given (its own copies of weights)."""

    def describe(self) -> str: ...


def reference_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """float64 oracle for the backends' tests (SwiGLU experts, -1 ids skipped)."""
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float64)
    inter = gate_up.shape[1] // 2
    for t in range(hidden.shape[0]):
        for k in range(expert_ids.shape[1]):
            e = int(expert_ids[t, k])
            if e < 0:
                continue
            h = hidden[t].double()
            gate = h @ gate_up[e, :inter].double().T
            up = h @ gate_up[e, inter:].double().T
            out[t] += float(weights[t, k]) * ((torch.nn.functional.silu(gate) * up) @ down[e].double().T)
    return out
