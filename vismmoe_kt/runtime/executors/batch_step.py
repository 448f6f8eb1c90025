"""A batched decode step: several sequences' tokens, one each, between the batch's step hooks.

Pinned layers compute from their banks by the plan's `batch_pinned` (grouped GEMM; the table kernel,
each pair reading its expert; the expert-major kernels, each routed expert read once, or their torch
twin; or the table kernel up to `batch_table_pairs` pairs and expert-major beyond); pinned layers held
as quantized blocks by the quantized slabs' kernels, pair by pair (the GEMVs in one launch) up to the plan's
`batch_block_gemv_pairs`, expert-major beyond. Offloaded layers:
with the table armed (`batch_table`), token by token through the table executor, so a miss one token
lands is a hit for the next, or, on quantized slabs (`quantized-expert-major`), all the step's tokens
at once, each routed expert decoded once per block of its tokens; without it, the placement path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..kernels import expert_major
from ..expert_compute import bank_experts
from ..offload_plan import OffloadPlan
from ..residency import Residency
from ..table_experts import block_bank_outputs, block_experts, combine, pair_outputs, quantized_batch_outputs


class BatchStepExecutor:
    def __init__(self, res: Residency, plan: OffloadPlan, placement: Any, table: Any = None):
        """`table`: the table executor when the step's table is armed, else None (the placement path)."""
        self.res, self.placement, self.table = res, placement, table
        self.kernel, self.major_kernels = plan.table_kernels, plan.batch_major_kernels
        self.table_pairs = plan.settings.batch_table_pairs
        # expert-major on the Triton kernels, or their torch twin (CPU, or weights the kernels do not take)
        self._expert_major_outputs = self._expert_major_kernels if plan.batch_pinned_kernels else self._expert_major_twin
        self.gemv_pairs = plan.batch_block_gemv_pairs  # pinned blocks: pair by pair up to this many pairs
        pinned = {"grouped-gemm": self._grouped, "table": self._table_kernel, "expert-major": self._expert_major,
                  "table-then-expert-major": self._table_then_expert_major}[plan.batch_pinned] \
            if not plan.pinned_blocks else self._blocks
        if table is None:
            offloaded = self._placement
        elif plan.batch_offloaded == "quantized-expert-major":
            offloaded = self._quantized_or_token_by_token
        else:
            offloaded = self._token_by_token
        self.by_layer: dict[int, Callable] = {layer: pinned if layer in res.pinned else offloaded
                                              for layer in res.moe_layers}

    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  act: Any) -> torch.Tensor:
        return self.by_layer[layer](layer, hidden, top_k_index, top_k_weights, act)

    # --- pinned layers (device work only: a batched step's graph holds them) -------------------------
    def _grouped(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 act: Any) -> torch.Tensor:
        return bank_experts(hidden, top_k_index, top_k_weights, self.res.identity, *self.res.banks[layer], act)

    def _table_kernel(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      act: Any) -> torch.Tensor:
        ids = top_k_index.reshape(-1)
        y = pair_outputs(hidden, ids, ids, torch.full_like(ids, -1), self.res.banks[layer], None, act,
                         top_k_index.shape[1], True)
        return combine(y, top_k_weights, hidden.dtype, True)

    def _expert_major(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      act: Any) -> torch.Tensor:
        y = self._expert_major_outputs(hidden, top_k_index, *self.res.banks[layer], act)
        return combine(y, top_k_weights, hidden.dtype, self.kernel)

    @staticmethod
    def _expert_major_kernels(hidden: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                              down: torch.Tensor, act: Any) -> torch.Tensor:
        return expert_major.experts_expert_major(hidden, top_k_index, gate_up, down)

    @staticmethod
    def _expert_major_twin(hidden: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                           down: torch.Tensor, act: Any) -> torch.Tensor:
        """The kernels' torch twin: the same blocks, eagerly."""
        blocks = expert_major.expert_blocks(top_k_index.reshape(-1), gate_up.shape[0])
        return expert_major.experts_by_block(hidden, top_k_index.shape[1], *blocks, gate_up, down, act)

    def _table_then_expert_major(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                                 top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        way = self._table_kernel if top_k_index.numel() <= self.table_pairs else self._expert_major
        return way(layer, hidden, top_k_index, top_k_weights, act)

    def _blocks(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                act: Any) -> torch.Tensor:
        """A pinned layer held as quantized blocks: as the quantized slabs compute, pair by pair up to
        `gemv_pairs` pairs (one token always), else each routed expert decoded once per block of its tokens."""
        res = self.res
        if top_k_index.shape[0] == 1 or top_k_index.numel() <= self.gemv_pairs:
            y = block_bank_outputs(hidden, top_k_index.reshape(-1), res.banks[layer][0], res.store, layer, act,
                                   top_k_index.shape[1], self.kernel)
            return combine(y, top_k_weights, hidden.dtype, self.kernel)
        return block_experts(hidden, top_k_index, top_k_weights, act, res.banks[layer][0], None, res.store,
                             layer, res.num_experts, self.major_kernels, prompt=False)

    # --- offloaded layers ---------------------------------------------------------------------------
    def _placement(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   act: Any) -> torch.Tensor:
        return self.placement.run_layer(layer, hidden, top_k_index, top_k_weights, act, batched=True)

    def _token_by_token(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        act: Any) -> torch.Tensor:
        k = top_k_index.shape[1]  # token by token, so a miss one token lands is a hit for the next
        return torch.cat([self.table.token(layer, hidden[t:t + 1], top_k_index[t:t + 1], top_k_weights[t:t + 1],
                                           act, offset=t * k) for t in range(hidden.shape[0])])

    def _quantized_or_token_by_token(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                                     top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        """All tokens at once from 2 tokens (into prepare_batch's staging rows: begin_batch_step refuses a
        step with the table that prepare_batch did not make room for). Token by token is a launch sequence
        per token here, not one launch of GEMVs, so the pinned blocks' `gemv_pairs` does not apply."""
        if top_k_index.shape[0] == 1:
            return self._token_by_token(layer, hidden, top_k_index, top_k_weights, act)
        return self._quantized_major(layer, hidden, top_k_index, top_k_weights, act)

    def _quantized_major(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, act: Any) -> torch.Tensor:
        """A batched step's offloaded layer on quantized slabs: one lookup for its T x K pairs (their
        records at the batch columns from 0), then every pair at once (table_experts.quantized_batch_outputs);
        the combine publishes what landed. Device work only."""
        res = self.res
        row, ids = res.index[layer], top_k_index.reshape(-1)
        slots, land = res.table.lookup(row, ids, self.kernel, offset=0)
        y = quantized_batch_outputs(hidden, top_k_index, slots, land, res.pool[0], res.batch_staging,
                                    res.store.layers[layer], res.store, layer, res.num_experts, act,
                                    self.major_kernels)
        return self.table.publish_and_combine(y, top_k_weights, hidden.dtype, row, ids, land)
