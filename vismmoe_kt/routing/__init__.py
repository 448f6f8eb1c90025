"""Realistic routing for benchmarks, independent of model weights: replayed traces and a calibrated
synthetic router.

Full-size models with random weights route near-uniformly, so cache and prefetch figures measured on
them mean nothing. This subpackage gives a routing source instead: a synthetic latent-factor router
fitted to published Qwen3-30B-A3B routing statistics, real traces (ours, vLLM's, JSONL dumps) to replay,
the statistics to compare them, and the optimal offline (Belady) cache hit rate as a yardstick.
It imports only torch, numpy, safetensors and the standard library, nothing else of vismmoe_kt: it sits
at the bottom of the package's import graph and any layer may use it.

    synthetic_trace(T, layers=48, experts=128, top_k=8, phase="decode", modality=None, seed=0, **knobs)
        -> ids int64 [T, L, k];  synthetic_routing(...) -> (ids, weights)
    SyntheticRouter(...)                 token-by-token (prefill, decode, ids(token, layer)), same ids
    affinity=S (0 < S <= 1) on either    the labelled visual-expert affinity what-if (affinity.py), never the default
    load_trace(path, format=None) -> Trace;  save_trace(path, ids, modality, phase, weights, request_ids)
    trace_stats(ids, experts, modality=None, phase=None) -> dict;  hot_set_jaccard(a, b, experts)
    belady_hit_rate(ids, capacity);  lru_hit_rate(ids, capacity);  simulate_cache(...) -> CacheResult
"""

from .affinity import check_strength as check_affinity_strength, image_preference, label as affinity_label
from .belady import CacheResult, belady_hit_rate, lru_hit_rate, simulate_cache
from .calibration import DEFAULT_CALIBRATION, Knobs, resolve_knobs
from .formats import Trace, TraceFormatError, from_vllm, load_trace, save_trace
from .stats import hot_set_jaccard, hot_sets, trace_stats
from .synthetic import Routing, SyntheticRouter, synthetic_routing, synthetic_trace

__all__ = [
    "synthetic_trace", "synthetic_routing", "SyntheticRouter", "Routing",
    "check_affinity_strength", "affinity_label", "image_preference",
    "Trace", "TraceFormatError", "load_trace", "save_trace", "from_vllm",
    "trace_stats", "hot_set_jaccard", "hot_sets",
    "belady_hit_rate", "lru_hit_rate", "simulate_cache", "CacheResult",
    "resolve_knobs", "Knobs", "DEFAULT_CALIBRATION",
]
