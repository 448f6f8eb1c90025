"""Table decode: a lean decode step's layers read their experts where they lie (slab or host store)
through the DecodeTable, with no host work, so the whole step is one CUDA graph (decode_table.py;
the DecodeBoundary keeps the cache between steps).

The plan's variant fixes how an offloaded layer reads (`slabs`: the model's dtype, misses read from
the host store in place; `dequantize-into-slabs`: a quantized store's misses dequantized into their
landing or scratch slabs first; `quantized-slabs`: the store's blocks copied as they are and decoded
by the GEMVs), whether the lookahead predictor runs at each layer (StepLookahead) and whether the
hybrid's CPU pairs join (TableCpuJoin): all bound here at construction, per layer (the CPU pairs'
table, or the one without them, picked again as each step is armed: `bind_step`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..kernels import quantized_gemv, table_ops
from ..residency import Residency
from ..table_experts import block_bank_outputs, combine, fetch_dequantized, pair_outputs, quantized_slab_outputs


class TableStepExecutor:
    def __init__(self, res: Residency, variant: str, kernel: bool, fallback: Any,
                 lookahead: Any = None, cpu_join: Any = None):
        """`fallback`: the placement path, for a call of more than one token while a step is armed.
        `lookahead` (StepLookahead) and `cpu_join` (TableCpuJoin): None where the plan has neither."""
        self.res, self.kernel, self.fallback = res, kernel, fallback
        self.cpu_join = cpu_join
        self._read = {"slabs": self._read_slabs, "dequantize-into-slabs": self._read_dequantized,
                      "quantized-slabs": self._read_quantized_slabs}[variant]
        self.publish_and_combine = self._combine_publishing if kernel else self._publish_then_combine
        self._look_ahead = lookahead.look_ahead if lookahead is not None else _no_look_ahead
        # (pinned layers held as blocks come only with quantized slabs, which a lookahead predictor never has)
        self._pinned_step = self._pinned_blocks if res.pinned_blocks else self._pinned
        pinned = self._pinned_looking_ahead if lookahead is not None else self._pinned_step
        # two tables: a step whose cost model sends misses to the CPU (a graph variant of its own) and one
        # that sends none, captured without the CPU's calls; `bind_step` picks one as each step is armed
        self._without_cpu: dict[int, Callable] = {layer: pinned if layer in res.pinned else self._offloaded
                                                  for layer in res.moe_layers}
        self._with_cpu = {layer: pinned if layer in res.pinned else self._offloaded_with_cpu
                          for layer in res.moe_layers} if cpu_join is not None else self._without_cpu
        # a settled table (every offloaded expert in a resident slab): the slabs read straight from the table,
        # nothing claimed, recorded, staged or looked ahead
        settled = self._settled_quantized if variant == "quantized-slabs" and kernel else self._settled
        self._settled_layers = {layer: self._pinned_step if layer in res.pinned else settled
                                for layer in res.moe_layers}
        self.by_layer = self._without_cpu

    def bind_step(self) -> None:
        """A step is armed (its CPU quota set): the layers' table for it, settled, CPU pairs joining or not."""
        table = self.res.table
        self.by_layer = self._settled_layers if table.settled else self._with_cpu if table.cpu_active \
            else self._without_cpu

    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  act: Any) -> torch.Tensor:
        if top_k_index.numel() != self.res.top_k:  # not one decode token: the placement path serves it
            return self.fallback.run_layer(layer, hidden, top_k_index, top_k_weights, act)
        return self.token(layer, hidden, top_k_index, top_k_weights, act)

    def token(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              act: Any, offset: int | None = None) -> torch.Tensor:
        """One decode token's experts, each read from its slab or the host store (device work only).
        On CUDA three launches besides the two expert kernels' (plan, and combine with publish).
        `offset`: a batched step's token, whose records go to the table's batch columns from there."""
        return self.by_layer[layer](layer, hidden, top_k_index, top_k_weights, act, offset)

    def _pinned(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                act: Any, offset: int | None) -> torch.Tensor:
        """The bank holds every expert at its own index: nothing to look up."""
        ids = top_k_index.reshape(-1)
        y = pair_outputs(hidden, ids, ids, self.res.table.no_landing, self.res.banks[layer], None, act,
                         top_k_index.shape[1], self.kernel)
        return combine(y, top_k_weights, hidden.dtype, self.kernel)

    def _pinned_blocks(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, act: Any, offset: int | None) -> torch.Tensor:
        """A pinned layer held as quantized blocks, every expert at its own row: the quantized slabs' GEMVs."""
        y = block_bank_outputs(hidden, top_k_index.reshape(-1), self.res.banks[layer][0], self.res.store, layer, act,
                               top_k_index.shape[1], self.kernel)
        return combine(y, top_k_weights, hidden.dtype, self.kernel)

    def _pinned_looking_ahead(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor, act: Any, offset: int | None) -> torch.Tensor:
        row = self.res.index[layer]
        self.res.table.routed[row].copy_(top_k_index.reshape(-1))  # the predictor's routing history
        self._look_ahead(row, hidden)
        return self._pinned(layer, hidden, top_k_index, top_k_weights, act, offset)

    def _offloaded(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   act: Any, offset: int | None) -> torch.Tensor:
        row, ids, slots, land = self._looked_up(layer, hidden, top_k_index, offset)
        return self._gpu_pairs(layer, hidden, row, ids, slots, land, top_k_weights, act, top_k_index.shape[1])

    def _offloaded_with_cpu(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, act: Any, offset: int | None) -> torch.Tensor:
        """The hybrid's step: the layer's CPU pairs (slot CPU_PAIR) start on the CPU before the GPU's
        pairs compute, and join their sum."""
        row, ids, slots, land = self._looked_up(layer, hidden, top_k_index, offset)
        on_cpu = self.cpu_join.begin(layer, hidden, ids, slots, top_k_weights)
        return self._gpu_pairs(layer, hidden, row, ids, slots, land, top_k_weights, act, top_k_index.shape[1]) \
            + on_cpu()

    def _settled(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 act: Any, offset: int | None) -> torch.Tensor:
        """Every pair hits: its slab from the table row, no landing (the variant's read stages nothing)."""
        table, ids = self.res.table, top_k_index.reshape(-1)
        slots = table.slots[self.res.index[layer]].index_select(0, ids)
        land = table.no_landing if ids.numel() == table.top_k else torch.full_like(ids, -1)
        y = self._read(layer, hidden, ids, slots, land, act, top_k_index.shape[1])
        return combine(y, top_k_weights, hidden.dtype, self.kernel)

    def _settled_quantized(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, act: Any, offset: int | None) -> torch.Tensor:
        """`_settled` on quantized slabs: the GEMVs read each pair's slab from the table row themselves
        (three launches a layer, as a pinned layer's)."""
        res = self.res
        store = res.store
        y = quantized_gemv.quantized_experts(hidden, top_k_index.reshape(-1), res.pool[0], store.fmt,
                                             store.down_format(layer), store.inter, store.hidden,
                                             top_k_index.shape[1], table_row=res.table.slots[res.index[layer]])
        return combine(y, top_k_weights, hidden.dtype, self.kernel)

    def _looked_up(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                   offset: int | None) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The table's slots and landings for the layer's pairs; the lookahead started after them (its
        prefetches overlap this layer's experts)."""
        row, ids = self.res.index[layer], top_k_index.reshape(-1)
        slots, land = self.res.table.lookup(row, ids, self.kernel, offset)
        self._look_ahead(row, hidden)
        return row, ids, slots, land

    def _gpu_pairs(self, layer: int, hidden: torch.Tensor, row: int, ids: torch.Tensor, slots: torch.Tensor,
                   land: torch.Tensor, top_k_weights: torch.Tensor, act: Any, top_k: int) -> torch.Tensor:
        y = self._read(layer, hidden, ids, slots, land, act, top_k)
        return self.publish_and_combine(y, top_k_weights, hidden.dtype, row, ids, land)

    def _read_slabs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                    land: torch.Tensor, act: Any, top_k: int) -> torch.Tensor:
        res = self.res
        return pair_outputs(hidden, ids, slots, land, res.pool, res.store.layers[layer], act, top_k, self.kernel)

    def _read_dequantized(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                          land: torch.Tensor, act: Any, top_k: int) -> torch.Tensor:
        """Misses dequantized into their landing (or scratch) slabs first."""
        res = self.res
        read = fetch_dequantized(ids, slots, land, res.pool, res.store.layers[layer], res.store, res.num_slabs + 1,
                                 self.kernel, layer)
        return pair_outputs(hidden, ids, read, res.table.no_landing, res.pool, None, act, top_k, self.kernel)

    def _read_quantized_slabs(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                              land: torch.Tensor, act: Any, top_k: int) -> torch.Tensor:
        """Misses copied as they are into their landing (or scratch) slabs, then decoded."""
        res = self.res
        return quantized_slab_outputs(hidden, ids, slots, land, res.pool[0], res.store.layers[layer], res.store,
                                      layer, res.num_slabs + 1, act, top_k, self.kernel)

    def _combine_publishing(self, y: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype, row: int,
                            ids: torch.Tensor, land: torch.Tensor) -> torch.Tensor:
        """The kernels combine and publish in one launch."""
        return table_ops.combine(y, top_k_weights, dtype, self.res.table, row, ids, land)

    def _publish_then_combine(self, y: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype, row: int,
                              ids: torch.Tensor, land: torch.Tensor) -> torch.Tensor:
        self.res.table.publish(row, ids, land)
        return combine(y, top_k_weights, dtype)


def _no_look_ahead(row: int, hidden: torch.Tensor) -> None:
    """No lookahead predictor in the plan."""
