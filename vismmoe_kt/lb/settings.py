"""The ReaLB operators' rule kwargs, each written once (with its YAML meaning).

`MixedPrecisionSettings` (one process, virtual expert-parallel ranks) and `ExpertParallelSettings`
(real ranks over torch.distributed) share the controller's kwargs (`RealbSettings`); each is built
as `Settings(**kwargs)` and checks its values in `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .controller import MODES as CONTROLLER_MODES
from .controller import RealbController
from .precision import BACKENDS

MODES = CONTROLLER_MODES + ("eplb",)
SCOPES = ("vision_tokens", "expert")


@dataclass
class RealbSettings:
    mode: str = "realb"                     # bf16 | all (FP4-All) | realb | realb-seq | fixed | eplb (replication baseline)
    fixed_threshold: float = 0.7            # M_d for mode `fixed`
    precision_backend: str = "auto"         # auto | nvfp4-emulated | fp8 | nvfp4 (vismmoe_kt/lb/precision.py)
    lb_gate_tokens: int = 2048              # Gamma: below this many tokens per step everything stays BF16
    fp4_scope: str = "vision_tokens"        # vision_tokens: a switched expert's text rows stay BF16 | expert
    eps: float = 0.05                       # a rank is overloaded above (1 + eps) x the mean
    lowprec_cost: float = 0.5               # a low-precision pair's time relative to BF16, for the plan
    md_start: float = 0.9                   # M_d's start under AIMD
    md_min: float = 0.0                     # ... and its floor
    eplb_redundant: int | None = None       # mode eplb: extra expert copies (None: one per rank)
    eplb_period: int = 8                    # ... steps between re-placements
    eplb_window: int = 16                   # ... steps of load history they use

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of: {', '.join(MODES)}")
        if self.precision_backend not in BACKENDS:
            raise ValueError(f"precision_backend {self.precision_backend!r} is not one of: {', '.join(BACKENDS)}")
        if self.fp4_scope not in SCOPES:
            raise ValueError(f"fp4_scope {self.fp4_scope!r} is not one of: {', '.join(SCOPES)}")
        self.fixed_threshold, self.eps, self.lowprec_cost = float(self.fixed_threshold), float(self.eps), float(self.lowprec_cost)
        self.md_start, self.md_min = float(self.md_start), float(self.md_min)
        self.lb_gate_tokens, self.eplb_period, self.eplb_window = int(self.lb_gate_tokens), int(self.eplb_period), int(self.eplb_window)
        if self.eplb_redundant is not None:
            self.eplb_redundant = int(self.eplb_redundant)

    def controller(self) -> RealbController:
        """The plan + AIMD controller these settings describe (EPLB balances by placement: BF16 plans)."""
        return RealbController("bf16" if self.mode == "eplb" else self.mode, self.fixed_threshold, self.lb_gate_tokens,
                               self.eps, self.lowprec_cost, self.fp4_scope, self.md_start, self.md_min)


@dataclass
class MixedPrecisionSettings(RealbSettings):
    precision_backend: str = "nvfp4-emulated"
    ep_size: int = 4                        # virtual expert-parallel ranks the experts are spread over

    def __post_init__(self):
        super().__post_init__()
        self.ep_size = int(self.ep_size)


@dataclass
class ExpertParallelSettings(RealbSettings):
    mode: str = "bf16"
    expert_map: list[int] | None = None     # each expert's rank; None: contiguous blocks
    capture_exchange: bool = False          # decode steps' fixed-size exchanges inside their CUDA graphs
                                            # (NCCL collectives captured); off: eager between the captures
    eplb_async: bool = False                # mode eplb: a re-placement's weights move while the next step
                                            # runs on the old placement (Async EPLB); off: the step waits

    def __post_init__(self):
        super().__post_init__()
        self.capture_exchange, self.eplb_async = bool(self.capture_exchange), bool(self.eplb_async)
