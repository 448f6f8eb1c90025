"""LayerwisePrefill: a long prompt's routed experts computed on the GPU a layer at a time, from a host copy
(KTransformers' dual prefill, its `kt-gpu-prefill-token-threshold`), while decode stays on the CPU.

Why: with every routed expert on the CPU (CpuExperts), a 448 px prompt (236 tokens, 8 experts each)
routes to nearly every expert of every layer, so each prefill reads all the model's expert weights
from host memory once. kt-kernel's INT4 prefill read them at 28-37 GB/s on the H200's host, 70-75% of
a 0.58-0.69 s prefill, while the PCIe link (55 GB/s there) and the GPU sat idle. Here a layer's experts
cross the link as one copy of their host blocks (Q4_K by default: 0.28x BF16's bytes) into device
staging, one layer ahead on a side stream, are dequantized there into one layer's bank in the model's
dtype, and run as grouped GEMM (expert_compute.bank_experts).

`share` < 1 splits each layer: experts [0, c) on the GPU (only their blocks are copied: a contiguous
prefix of the layer's store), the rest on the CPU backend at the same time, c = round(share * E). With
`share="auto"` c follows the measured rates: per layer, the CPU's seconds for its experts against the
copy's seconds for the GPU's (CUDA events on the side stream), so that both end together.

Memory: the host copy (ExpertStore, page-locked; 16 GB in Q4_K for Qwen3-VL-30B-A3B's experts, beside
the CPU backend's own copy); on the GPU two staging buffers of one layer's blocks and one layer's bank
(about 0.7 + 1.2 GB at that shape).

On a device without CUDA (tests, the CPU twin) a layer's GPU part is dequantized from the store and
computed in place, the same arithmetic without the staging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .expert_compute import bank_experts
from .kernels import dequantize
from .store import CODECS, ExpertStore
from .store import FORMATS as HOST_FORMATS

FORMATS = ("auto", *HOST_FORMATS)
SHARE_KEEP = 0.5  # weight of the past in the automatic share, per layer measured


def resolve_format(fmt: str, hidden: int, inter: int) -> str:
    """`auto`: Q4_K where the widths are whole super-blocks (256), else Q8_0 where whole 32-weight blocks,
    else the model's dtype. A named format the widths cannot take is an error naming both."""
    if fmt not in FORMATS:
        raise ValueError(f"gpu_prefill_format {fmt!r} is not one of: {', '.join(FORMATS)}")
    candidates = ("q4_k", "q8_0", "model") if fmt == "auto" else (fmt,)
    for candidate in candidates:
        try:
            if candidate != "model":
                CODECS[candidate].row_bytes(hidden), CODECS[candidate].row_bytes(inter)
            return candidate
        except ValueError as exc:
            if fmt != "auto":
                raise ValueError(f"gpu_prefill_format {fmt}: {exc} (hidden {hidden}, expert intermediate {inter})") from None
    return "model"


@dataclass
class LayerwiseCounters:
    prefills: int = 0          # prompts (or chunks) whose experts went this way
    layers: int = 0            # layer calls
    tokens: int = 0            # token rows of those calls
    bytes_copied: int = 0      # host blocks sent over PCIe
    gpu_experts: int = 0       # experts computed on the GPU ...
    cpu_experts: int = 0       # ... and on the CPU, summed over layer calls
    copy_seconds: float = 0.0  # side stream, measured by events where CUDA is present
    stall_seconds: float = 0.0  # the compute stream waiting for a layer's copy (events), the prefill's critical path
    cpu_seconds: float = 0.0   # submit to result of the CPU's part
    host_seconds_between: float = 0.0  # host time from one layer's call returning to the next one's (same prompt)


class LayerwisePrefill:
    """One per model (the CpuExperts layers share it): `fill_layer` at load, `run` per long prefill call."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device,
                 fmt: str = "auto", min_tokens: int = 0, share: float | str = 1.0):
        self.num_experts, self.hidden, self.inter, self.dtype = num_experts, hidden, inter, dtype
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # "cuda" is the current device: name it, as tensors do
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.fmt = resolve_format(fmt, hidden, inter)
        self.min_tokens = int(min_tokens)
        self.auto_share = share == "auto"
        self.share = 0.5 if self.auto_share else float(share)
        self.store = ExpertStore(num_experts, hidden, inter, dtype, pin_memory=self.cuda, fmt=self.fmt)
        self.layers: list[int] = []
        self.wanted: tuple = ()  # the rule kwargs that made it (CpuExperts checks every layer asks the same)
        self.counters = LayerwiseCounters()
        self._identity = torch.arange(num_experts, device=self.device)
        self._needed = torch.ones(num_experts, dtype=torch.int8, device=self.device)  # the kernel fetches every row
        self._bank: tuple[torch.Tensor, torch.Tensor] | None = None
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staged: list[tuple[int, int] | None] = [None, None]  # (layer, experts) each buffer holds or receives
        self._read: list[Any] = [None, None]     # event: the compute stream is done with the buffer
        self._timing: list[Any] = [None, None]   # (start, end) events of the buffer's last copy: end = landed
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._returned: float | None = None  # host clock when the last layer's call returned
        self._pending: list[tuple[str, Any, Any]] = []  # (counter, start, end) events not read back yet

    # --- load --------------------------------------------------------------------------------------
    def fill_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """One layer's experts (E, 2I, H) and (E, H, I), quantized into the store (on the GPU where there
        is one: a layer at a time, the store keeps only the result)."""
        if self.cuda and self.store.quantized and gate_up.device.type != "cuda":
            gate_up, down = gate_up.to(self.device), down.to(self.device)
        self.store.fill_layer(layer, gate_up, down)
        self._register(layer)

    def fill_layer_raw(self, layer: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       down_format: str | None = None) -> None:
        """A GGUF's experts as stored, in the store's format (no requantizing)."""
        self.store.fill_layer_raw(layer, gate, up, down, down_format)
        self._register(layer)

    def _register(self, layer: int) -> None:
        if layer not in self.layers:
            self.layers = sorted(self.layers + [layer])

    def takes(self, tokens: int, device: torch.device) -> bool:
        """Whether a call of `tokens` rows on `device` goes this way."""
        return bool(self.min_tokens) and tokens >= self.min_tokens and device == self.device

    def gpu_experts(self) -> int:
        """How many of a layer's experts (a prefix) the GPU computes now."""
        return max(1, min(self.num_experts, round(self.share * self.num_experts)))

    # --- one layer ---------------------------------------------------------------------------------
    def run(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            act: Any, cpu: Any = None) -> torch.Tensor:
        """The layer's routed experts for `hidden` (T, H): the GPU's prefix of experts from the store, the
        rest (where `share` < 1) through `cpu` (a CpuExpertBackend) at the same time."""
        if layer not in self.store.layers:
            raise RuntimeError(f"layer {layer} has no experts in the layerwise prefill's store")
        if hidden.dtype != self.dtype:  # a silent cast would run the GEMMs off their fast path
            raise ValueError(f"the layerwise prefill got {hidden.dtype} activations for experts kept in {self.dtype}: "
                             "the operator took the model's dtype from the loader or the config, which name another "
                             "one; load with dtype= set to the model's")
        if layer == self.layers[0]:
            self.counters.prefills += 1
        elif self._returned is not None:
            self.counters.host_seconds_between += time.perf_counter() - self._returned
        self._read_back()
        count = self._count(layer) if cpu is not None else self.num_experts
        task = None
        if count < self.num_experts:
            task = self._submit_cpu(cpu, layer, hidden, top_k_index, top_k_weights, count)
            submitted = time.perf_counter()
        gate_up, down = self._gpu_bank(layer, count)
        if self.cuda:  # only the dequantization read the staging buffer: free it and start the next layer's copy
            # before the grouped GEMM: where the GEMM waits on the host (torch's grouped GEMM outside BF16 reads
            # its group ends back), a copy issued after it would wait for this layer's compute
            self._read[self._buffer_of(layer)].record()
            self._stage_next(layer, self.gpu_experts() if cpu is not None else self.num_experts)
        if task is None:
            out = bank_experts(hidden, top_k_index, top_k_weights, self._identity, gate_up, down, act)
        else:  # the CPU's pairs weigh 0 here, read from row 0 (a finite expert of this layer: 0, exactly)
            rows = torch.where(self._identity < count, self._identity, 0)
            weights = top_k_weights.masked_fill(top_k_index >= count, 0)
            out = bank_experts(hidden, top_k_index, weights, rows, gate_up, down, act)
        self.counters.layers += 1
        self.counters.tokens += hidden.shape[0]
        self.counters.gpu_experts += count
        if task is not None:
            result = task.wait()
            seconds = time.perf_counter() - submitted
            self.counters.cpu_experts += self.num_experts - count
            self.counters.cpu_seconds += seconds
            out = out + result.to(out.device, non_blocking=True)
            self._update_share(layer, count, seconds)
        self._returned = time.perf_counter()
        return out

    def _count(self, layer: int) -> int:
        """The GPU's experts of `layer` in a split: as many as were staged ahead (the share moves on at the
        next staging, so a layer is never copied twice), else the share's now."""
        slot = self._buffer_of(layer) if self.cuda else None
        return self._staged[slot][1] if slot is not None else self.gpu_experts()

    def _submit_cpu(self, cpu: Any, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, count: int) -> Any:
        ids = top_k_index.masked_fill(top_k_index < count, -1)  # -1: computed elsewhere (the backend skips it)
        host = [t.to("cpu", non_blocking=self.cuda) for t in (hidden, ids, top_k_weights.float())]
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return cpu.submit(layer, *host)

    def _gpu_bank(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's first `count` experts in the model's dtype, rows at their own indices."""
        blocks_bytes = self.store.block_bytes_of(layer)
        if not self.cuda:  # the twin: dequantized from the store where it lies
            return self.store.dequantized(self.store.layers[layer][:count], layer)
        if self._bank is None:
            kw = dict(dtype=self.dtype, device=self.device)
            self._bank = (torch.empty(self.num_experts, 2 * self.inter, self.hidden, **kw),
                          torch.empty(self.num_experts, self.hidden, self.inter, **kw))
        slot = self._buffer_of(layer)
        if slot is None or self._staged[slot][1] < count:  # not staged ahead (the first layer): now
            slot = self._stage(layer, count, self._free_slot(layer))
        stalled, resumed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stalled.record()
        torch.cuda.current_stream(self.device).wait_event(self._timing[slot][1])
        resumed.record()
        self._pending.append(("stall_seconds", stalled, resumed))
        staging = self._staging[slot]
        if not self.store.quantized:  # the blocks as they are, into the bank's contiguous (rows, out, in) layout
            gate_up, down = self.store.dequantized(staging[:count * blocks_bytes].view(self.dtype).view(count, -1), layer)
            self._bank[0][:count].copy_(gate_up)
            self._bank[1][:count].copy_(down)
            return self._bank[0][:count], self._bank[1][:count]
        if not dequantize.available(self.dtype):  # torch's dequantization, on the device
            return self.store.dequantized(staging[:count * blocks_bytes].view(count, blocks_bytes), layer)
        ids = self._identity[:count]
        dequantize.fetch_q8(ids, self._needed[:count], ids, self._bank, staging.data_ptr(), blocks_bytes,
                            self.inter, self.hidden,
                            fmt=self.store.fmt, down_fmt=self.store.down_format(layer), staged=True)
        return self._bank[0][:count], self._bank[1][:count]

    def _buffer_of(self, layer: int) -> int | None:
        for slot, staged in enumerate(self._staged):
            if staged is not None and staged[0] == layer:
                return slot
        return None

    def _free_slot(self, layer: int) -> int:
        """The buffer not holding the layer before `layer` (whose bank may still be in use)."""
        previous = self._last_before(layer)
        for slot, staged in enumerate(self._staged):
            if staged is None or staged[0] != previous:
                return slot
        return 0

    def _last_before(self, layer: int) -> int:
        at = self.layers.index(layer)
        return self.layers[at - 1] if at else self.layers[-1]

    def _stage_next(self, layer: int, count: int) -> None:
        """Start the copy of the layer after `layer` (after the last, the first: the next prompt's) into the
        buffer `layer` does not use."""
        at = self.layers.index(layer)
        upcoming = self.layers[(at + 1) % len(self.layers)]
        if self._buffer_of(upcoming) is not None and self._staged[self._buffer_of(upcoming)][1] >= count:
            return
        self._stage(upcoming, count, 1 - self._buffer_of(layer))

    def _stage(self, layer: int, count: int, slot: int) -> int:
        """Copy the first `count` experts' blocks of `layer` into staging buffer `slot` on the side stream,
        once the compute stream is done reading what the buffer held. The blocks land back to back, as
        the dequantizing kernel reads them (`block_bytes_of(layer)` apart from the buffer's start)."""
        if self._staging[slot] is None:
            widest = max(self.store.block_bytes_of(other) for other in self.layers)
            self._staging[slot] = torch.empty(self.num_experts * widest, dtype=torch.uint8, device=self.device)
        source = self.store.layers[layer][:count]
        source = source.view(torch.uint8).reshape(-1)
        with torch.cuda.stream(self._stream):
            if self._read[slot] is not None:
                self._stream.wait_event(self._read[slot])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._staging[slot][:source.numel()].copy_(source, non_blocking=True)
            end.record()
        self._timing[slot] = (start, end)
        self._pending.append(("copy_seconds", start, end))
        self._read[slot] = torch.cuda.Event()
        self._staged[slot] = (layer, count)
        self.counters.bytes_copied += source.numel()
        return slot

    def _update_share(self, layer: int, count: int, cpu_seconds: float) -> None:
        """`auto`: move the split towards where the CPU's part and the copy of the GPU's end together."""
        if not self.auto_share or not self.cuda:
            return
        slot = self._buffer_of(layer)
        timing = self._timing[slot] if slot is not None else None
        if timing is None or not timing[1].query():
            return
        copy_seconds = timing[0].elapsed_time(timing[1]) / 1000
        if copy_seconds <= 0 or cpu_seconds <= 0:
            return
        gpu_rate, cpu_rate = count / copy_seconds, (self.num_experts - count) / cpu_seconds
        target = gpu_rate / (gpu_rate + cpu_rate)
        self.share = min(1.0, max(1 / self.num_experts, SHARE_KEEP * self.share + (1 - SHARE_KEEP) * target))

    def _read_back(self) -> None:
        """Add the timings whose events have completed to the counters (no waiting)."""
        while self._pending and self._pending[0][2].query():
            name, start, end = self._pending.pop(0)
            setattr(self.counters, name, getattr(self.counters, name) + start.elapsed_time(end) / 1000)

    def describe(self) -> str:
        share = f"auto ({self.share:.2f} now)" if self.auto_share else f"{self.share:g}"
        return (f"layerwise GPU prefill from {self.min_tokens} tokens: {self.fmt} host copy "
                f"({self.store.nbytes / 2**30:.1f} GiB), GPU share {share}")

    def settle(self) -> LayerwiseCounters:
        """The counters with every timing read back (waits for the device's work)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._read_back()
        return self.counters

    def stats(self) -> dict[str, Any]:
        from dataclasses import asdict

        self.settle()
        return {"gpu_prefill": self.describe(), **{f"gpu_prefill_{k}": v for k, v in asdict(self.counters).items()}}

    def close(self) -> None:
        self.store.release()
        self._staging = [None, None]
        self._bank = None
