"""OffloadSettings: the VisExperts rule's kwargs, each written once here (with its YAML meaning).

Built as `OffloadSettings(**kwargs)` from a rule; `__post_init__` checks and normalises the values
(sizes like "24GiB" become bytes, `auto` becomes None), so two rules that mean the same compare
equal (every VisExperts of a model must agree: they share one runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .budget import BudgetError, parse_budget, parse_bytes
from .cost_model import CostModel
from .eviction import EVICTIONS
from .offload_compat import check
from .reservations import RESERVATIONS
from .store import FORMATS

POLICIES = ("vismmoe", "lru")
MISS_POLICIES = ("wait", "cpu", "auto")
SLAB_FORMATS = ("auto", "dequantized", "quantized")
BATCH_EXPERTS = ("auto", "table", "grouped-gemm", "expert-major")  # a batched step's resident experts


@dataclass(frozen=True)
class OffloadSettings:
    expert_budget: Any                 # GPU memory for routed experts (pinned prefix + slabs): bytes, "24GiB", or a
                                       # share of the model's routed experts' bytes, "30%" (the runtime resolves it)
    policy: str = "vismmoe"            # vismmoe (pinned prefix + prefetch + safe eviction) | lru (the baseline)
    # the slab cache's eviction ranking (eviction.py): vismmoe (VisMMOE's: Expired by the router's averages, then
    # Speculative by priority) | lru (recency) | auto (table decode times both over its first steps and keeps
    # the faster, a tie lru; a slab for every offloaded expert: lru) | None: the policy's own (as before the key)
    eviction: str | None = None
    # table decode's landing reservations (decode_boundary.py): ahead (a step's landing slabs are reserved while
    # the step before it runs, from the records of the one before that, so the next step is queued without
    # waiting for the host's upkeep; where decode has no CPU share and no lookahead, else before-step) |
    # before-step (each step's after the records of the one before it) | auto (where ahead can run, decode's
    # first steps time both and keep the faster, a tie before-step, before the eviction trial: reservations.py)
    reservations: str = "before-step"
    pinned_layers: Any = "auto"        # auto: VisMMOE Eq. 10's choice | an int, checked against the budget
    min_pinned_layers: int = 1         # L_semantic of Eq. 10
    min_cache_bytes: Any = None        # C_safe of Eq. 10; None: one layer of experts (prefill can always progress)
    prefetch_window: int = 2           # W: offloaded layers ahead the history policy prefetches
    prefetch_gamma: float = 0.8        # priority decay per layer of distance
    max_in_flight: int = 16            # prefetch copies outstanding at once
    miss_policy: str = "wait"          # wait (fetch, stall on it) | cpu (compute misses on the CPU) | auto (cost model)
    cpu_backend: str = "torch"         # torch (reads the store in place) | kt-kernel (own copy) | auto
    # kt-kernel's copy: auto (a GGUF's quantized experts as stored, else bf16) | bf16 | int8 | int4 (quantized at
    # load: half or a quarter the memory)
    cpu_dtype: str = "auto"
    cost_model: Any = None             # {fetch_seconds, cpu_seconds_fixed, cpu_seconds_per_token[, cpu_seconds_call]}
                                       # pins `auto`; None: measure
    # the host store: model (the checkpoint's dtype) | q8_0 / q4_0 / q4_k / q5_k (llama.cpp's 8-, 4- or 5-bit
    # blocks: a half to a quarter of BF16's host memory and PCIe bytes per fetched expert; dequantized into the
    # slabs as they arrive) | auto: a GGUF's expert format where the store can keep it as the file stores
    # it (no predictor, miss_policy wait), else model (VisExperts resolves it at load)
    store_dtype: str = "auto"
    # the GPU's slabs with a quantized store: dequantized (the model's dtype, decoded once as an expert
    # arrives) | quantized (the store's blocks as they are, decoded by the decode GEMVs as they read them:
    # 2-7x more experts in the same budget; miss_policy wait, no predictor, H and I multiples of 256) |
    # auto: quantized wherever those hold (on the H200 at 16 GiB: 75.5 tok/s vs 54.8 dequantized, Q4_K),
    # else dequantized (the runtime resolves it: it knows the store and the shapes)
    slab_format: str = "auto"
    predictor: str | None = None       # predictor.pt from `vismmoe-kt calibrate`; None: the history policy
    prefetch_topk: int = 20            # B: (layer, expert) pairs the predictor queues per layer
    prefetch_min_probability: float = 0.7  # in table decode, prefetch only pairs the predictor gives at least this
    prefetch_stride: int = 1           # in table decode, the predictor runs at every S-th MoE layer (1 <= S <= its
                                       # window W): its W layers ahead still cover the gap, at 1/S of its kernels
    # a batched step's pinned layers (BATCH_EXPERTS): auto takes the table kernel (each pair reads its
    # expert) up to batch_table_pairs pairs, and beyond, the expert-major tensor-core kernels (each
    # routed expert read once, runtime/kernels/expert_major.py) where they run, else grouped GEMM. H200, one
    # layer's experts, random distinct experts per token (`decode_kernel_bench --batch`), us per layer
    # table / grouped / expert-major: 2 tokens 60.6 / 118.1 / 92.6, 4: 106.5 / 169.1 / 123.4,
    # 8: 192.2 / 246.0 / 175.9, 16: 355.6 / 342.3 / 243.6. Pinned layers held as quantized blocks: auto
    # takes their GEMVs in one launch up to the device's tuned pairs (tuning.json quantized_batch_gemv_pairs:
    # on the H100 one launch beat expert-major at every batch to 16 tokens), then expert-major. On quantized
    # slabs, expert-major and auto run an offloaded layer's tokens at once (offload_plan.py); table and
    # grouped-gemm token by token
    batch_experts: str = "auto"
    batch_table_pairs: int = 32

    def __post_init__(self):
        def put(name: str, value: Any) -> None:  # frozen: normalised values go in through object.__setattr__
            object.__setattr__(self, name, value)

        if self.expert_budget is None:
            raise BudgetError("expert_budget is required (bytes, a size like '24GiB' or a share like '30%')")
        put("expert_budget", parse_budget(self.expert_budget))
        if self.policy not in POLICIES:
            raise BudgetError(f"policy {self.policy!r} is not one of: {', '.join(POLICIES)}")
        if self.eviction is not None and self.eviction not in EVICTIONS:
            raise BudgetError(f"eviction {self.eviction!r} is not one of: {', '.join(EVICTIONS)}")
        if self.reservations not in RESERVATIONS:
            raise BudgetError(f"reservations {self.reservations!r} is not one of: {', '.join(RESERVATIONS)}")
        put("pinned_layers", None if self.pinned_layers in (None, "auto") else int(self.pinned_layers))
        if self.policy == "lru":  # the baseline: the whole budget is an on-demand cache, no prefetch
            put("pinned_layers", 0)
            put("min_pinned_layers", 0)
            put("prefetch_window", 0)
        put("min_pinned_layers", int(self.min_pinned_layers))
        put("min_cache_bytes", None if self.min_cache_bytes is None else parse_bytes(self.min_cache_bytes))
        put("prefetch_window", int(self.prefetch_window))
        put("prefetch_gamma", float(self.prefetch_gamma))
        if not 0 < self.prefetch_gamma <= 1:
            raise BudgetError(f"prefetch_gamma must be in (0, 1], got {self.prefetch_gamma}")
        put("max_in_flight", int(self.max_in_flight))
        if self.miss_policy not in MISS_POLICIES:
            raise BudgetError(f"miss_policy {self.miss_policy!r} is not one of: {', '.join(MISS_POLICIES)}")
        if self.store_dtype not in FORMATS + ("auto",):
            raise BudgetError(f"store_dtype {self.store_dtype!r} is not one of: auto, {', '.join(FORMATS)}")
        if self.slab_format not in SLAB_FORMATS:
            raise BudgetError(f"slab_format {self.slab_format!r} is not one of: {', '.join(SLAB_FORMATS)}")
        if self.cpu_dtype not in ("auto", "bf16", "int8", "int4"):
            raise BudgetError(f"cpu_dtype {self.cpu_dtype!r} is not one of: auto, bf16, int8, int4")
        if self.batch_experts not in BATCH_EXPERTS:
            raise BudgetError(f"batch_experts {self.batch_experts!r} is not one of: {', '.join(BATCH_EXPERTS)}")
        put("batch_table_pairs", int(self.batch_table_pairs))
        check({key: getattr(self, key) for key in ("slab_format", "store_dtype", "miss_policy", "cpu_dtype",
                                                   "cpu_backend")}, settings_only=True)  # offload_compat.py
        if isinstance(self.cost_model, dict):
            model = CostModel.from_kwargs(self.cost_model)
            put("cost_model", (model.fetch_seconds, model.cpu_seconds_fixed, model.cpu_seconds_per_token,
                               model.cpu_seconds_call))
        elif self.cost_model is not None and not isinstance(self.cost_model, tuple):
            raise BudgetError("cost_model needs fetch_seconds, cpu_seconds_fixed, cpu_seconds_per_token")
        put("predictor", None if self.predictor is None else str(self.predictor))
        put("prefetch_topk", int(self.prefetch_topk))
        put("prefetch_min_probability", float(self.prefetch_min_probability))
        if isinstance(self.prefetch_stride, bool) or not isinstance(self.prefetch_stride, int) or self.prefetch_stride < 1:
            raise BudgetError(f"prefetch_stride must be a whole number >= 1, got {self.prefetch_stride!r}")
        if not 0 <= self.prefetch_min_probability <= 1:
            raise BudgetError(f"prefetch_min_probability must be in [0, 1], got {self.prefetch_min_probability}")
