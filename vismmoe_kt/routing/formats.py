"""Routing traces on disk: the project's format, and importers for routing that others recorded.

Replaying a trained model's real routing is the other routing source benchmarks can use besides the
synthetic router; this module reads and writes such traces.

Project format, `.safetensors` or `.npz` (T tokens, L MoE layers, k experts per token):
    ids          int16   [T, L, k]  expert ids, each in [0, E)
    weights      float16 [T, L, k]  routing weights (optional)
    modality     uint8   [T]        1 = vision token (optional)
    phase        uint8   [T]        0 = prefill, 1 = decode (optional)
    request_ids  int32   [T]        which request each token belongs to; a request's tokens are
                                    contiguous (optional: one request)
safetensors metadata (npz: a `format` string entry) names the format and its version.

Importers (`load_trace` picks one from the extension and content; `format=` overrides):
    "vllm"   vLLM's routed experts (`--enable-return-routed-experts`): an integer array [T, L, k] in a .npy,
             .pt, .safetensors or .npz file; or a mapping with `prompt_routed_experts` and/or
             `routed_experts` (the API's two fields: prompt tokens become phase 0, generated ones phase 1)
    "jsonl"  one JSON record per (token, layer), as in public Mixtral-8x7B routing dumps:
             {"layer": 3, "token_idx": 17, "experts": [5, 2], "gating_probs": [0.7, 0.3], ...}; the optional
             fields request_id / prompt_id / problem_id / sample_id / dataset identify the request,
             "phase" ("prefill"/"decode" or 0/1) the phase. `.gz` files are read transparently.
Bad files raise TraceFormatError (a ValueError) naming the file and the problem.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

FORMAT_NAME, FORMAT_VERSION = "vismmoe-routing-trace", "1"
FORMATS = ("project", "vllm", "jsonl")
MAX_EXPERTS = 2 ** 15  # ids are stored as int16
REQUEST_FIELDS = ("dataset", "request_id", "prompt_id", "problem_id", "sample_id")  # JSONL request identity
PHASE_NAMES = {"prefill": 0, "decode": 1, 0: 0, 1: 1}


class TraceFormatError(ValueError):
    """A routing trace file that cannot be read; the message names the file and the problem."""

    def __init__(self, path: Any, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


@dataclass
class Trace:
    """One routing trace. T tokens, L layers, k experts per token.
    ids int64 [T, L, k]; weights float16 [T, L, k] or None; modality uint8 [T] or None (all text);
    phase uint8 [T] or None (unknown); request_ids int32 [T] or None (one request)."""
    ids: torch.Tensor
    weights: torch.Tensor | None = None
    modality: torch.Tensor | None = None
    phase: torch.Tensor | None = None
    request_ids: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])


# ---- validation -------------------------------------------------------------------------------------

def _numpy(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _flags(path: Any, name: str, value: Any, tokens: int) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in PHASE_NAMES:
            raise TraceFormatError(path, f"{name} must be 'prefill', 'decode' or a [tokens] array, got {value!r}")
        return np.full(tokens, PHASE_NAMES[value], dtype=np.uint8)
    arr = _numpy(value)
    if arr.ndim != 1 or arr.shape[0] != tokens:
        raise TraceFormatError(path, f"{name} must have shape [{tokens}] (one per token), got {list(arr.shape)}")
    if not np.isin(arr, (0, 1)).all():
        raise TraceFormatError(path, f"{name} must hold only 0 and 1")
    return arr.astype(np.uint8)


def _check(path: Any, ids: Any, weights: Any = None, modality: Any = None, phase: Any = None,
           request_ids: Any = None, experts: int | None = None) -> Trace:
    """Validate the pieces of a trace (from a file or from a caller) and build the Trace."""
    ids = _numpy(ids)
    if ids is None or ids.ndim != 3:
        shape = None if ids is None else list(ids.shape)
        raise TraceFormatError(path, f"expert ids must have 3 dimensions [tokens, layers, top_k], got shape {shape}")
    if ids.size and not (np.issubdtype(ids.dtype, np.integer) or
                         (np.issubdtype(ids.dtype, np.floating) and np.all(np.mod(ids, 1) == 0))):
        raise TraceFormatError(path, f"expert ids must be integers, got {ids.dtype}")
    ids = ids.astype(np.int64)
    limit = MAX_EXPERTS if experts is None else int(experts)
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        bad = ids[(ids < 0) | (ids >= limit)][0]
        t, layer, _ = np.argwhere(ids == bad)[0]
        raise TraceFormatError(path, f"expert id {bad} (token {t}, layer {layer}) is out of range [0, {limit})")
    if ids.size and ids.shape[2] > 1:
        ordered = np.sort(ids, axis=-1)
        dup = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
        if dup.any():
            t, layer = np.argwhere(dup)[0]
            raise TraceFormatError(path, f"token {t} repeats an expert at layer {layer}: {ids[t, layer].tolist()}")
    tokens = ids.shape[0]
    w = _numpy(weights)
    if w is not None:
        if w.shape != ids.shape:
            raise TraceFormatError(path, f"weights have shape {list(w.shape)}, ids {list(ids.shape)}")
        if not np.isfinite(w).all():
            raise TraceFormatError(path, "weights must be finite")
    modality, phase = _flags(path, "modality", modality, tokens), _flags(path, "phase", phase, tokens)
    req = _numpy(request_ids)
    if req is not None:
        if req.ndim != 1 or req.shape[0] != tokens:
            raise TraceFormatError(path, f"request_ids must have shape [{tokens}], got {list(req.shape)}")
        runs = 1 + int(np.count_nonzero(np.diff(req))) if tokens else 0
        if runs != len(np.unique(req)):
            raise TraceFormatError(path, "each request's tokens must be contiguous in the trace")
    return Trace(torch.from_numpy(ids),
                 None if w is None else torch.from_numpy(w.astype(np.float16)),
                 None if modality is None else torch.from_numpy(modality),
                 None if phase is None else torch.from_numpy(phase),
                 None if req is None else torch.from_numpy(req.astype(np.int32)))


# ---- project format ---------------------------------------------------------------------------------

def save_trace(path: str | Path, ids: Any, modality: Any = None, phase: Any = None, weights: Any = None,
               request_ids: Any = None) -> Path:
    """Write a trace in the project format; the extension (.safetensors or .npz) picks the container.
    ids [T, L, k] (< 32768), weights [T, L, k] (stored as float16), modality / phase [T] 0/1 (phase may
    also be "prefill" or "decode"), request_ids [T]. Returns the path."""
    path = Path(path)
    if path.suffix not in (".safetensors", ".npz"):
        raise TraceFormatError(path, "save_trace writes .safetensors or .npz files")
    trace = _check(path, ids, weights, modality, phase, request_ids)
    arrays = {"ids": trace.ids.numpy().astype(np.int16)}
    for name in ("weights", "modality", "phase", "request_ids"):
        value = getattr(trace, name)
        if value is not None:
            arrays[name] = value.numpy()
    if path.suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file(arrays, str(path), metadata={"format": FORMAT_NAME, "version": FORMAT_VERSION})
    else:
        with open(path, "wb") as f:  # a file object: np.savez would otherwise append .npz to odd names
            np.savez(f, format=np.array(f"{FORMAT_NAME} {FORMAT_VERSION}"), **arrays)
    return path


def _project(path: Path, arrays: dict[str, np.ndarray], experts: int | None) -> Trace:
    unknown = set(arrays) - {"ids", "weights", "modality", "phase", "request_ids"}
    if unknown:
        raise TraceFormatError(path, f"unexpected entries {sorted(unknown)} in a project trace")
    return _check(path, arrays["ids"], arrays.get("weights"), arrays.get("modality"), arrays.get("phase"),
                  arrays.get("request_ids"), experts)


# ---- vLLM -------------------------------------------------------------------------------------------

def from_vllm(routed_experts: Any = None, prompt_routed_experts: Any = None, experts: int | None = None,
              path: Any = "<vllm>") -> Trace:
    """A Trace from vLLM's routed-experts arrays ([T, L, k] each): prompt tokens (phase 0), then the
    generated tokens (phase 1). With a single unnamed array the phase stays unknown."""
    parts = [(a, p) for a, p in ((prompt_routed_experts, 0), (routed_experts, 1)) if a is not None]
    if not parts:
        raise TraceFormatError(path, "no routed experts given")
    arrays = [_numpy(a) for a, _ in parts]
    for a in arrays:
        if a.ndim != 3:
            raise TraceFormatError(path, f"expert ids must have 3 dimensions [tokens, layers, top_k], got shape "
                                         f"{list(a.shape)}")
    if len({a.shape[1:] for a in arrays}) > 1:
        raise TraceFormatError(path, f"prompt and generated routing differ in [layers, top_k]: "
                                     f"{[list(a.shape[1:]) for a in arrays]}")
    phase = np.concatenate([np.full(a.shape[0], p, np.uint8) for a, (_, p) in zip(arrays, parts)])
    return _check(path, np.concatenate(arrays), phase=phase, experts=experts)


def _vllm(path: Path, arrays: dict[str, Any], experts: int | None) -> Trace:
    if "routed_experts" in arrays or "prompt_routed_experts" in arrays:
        return from_vllm(arrays.get("routed_experts"), arrays.get("prompt_routed_experts"), experts, path)
    if len(arrays) != 1:
        raise TraceFormatError(path, f"expected one [tokens, layers, top_k] array or routed_experts / "
                                     f"prompt_routed_experts entries, found {sorted(arrays)}")
    (value,) = arrays.values()
    return _check(path, value, experts=experts)


# ---- JSONL ------------------------------------------------------------------------------------------

def _records(path: Path) -> Iterable[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, f"line {number} is not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise TraceFormatError(path, f"line {number} is not a JSON object")
            yield number, record


def _jsonl(path: Path, experts: int | None) -> Trace:
    requests: dict[tuple, int] = {}
    rows: list[tuple[int, int, int]] = []  # (request, token_idx, layer) per record
    chosen: list[list[int]] = []
    probs: list[list[float]] = []
    phases: list[int] = []
    k = has_probs = None
    for number, rec in _records(path):
        missing = [key for key in ("layer", "token_idx", "experts") if key not in rec]
        if missing:
            raise TraceFormatError(path, f"line {number} lacks {missing}")
        ids = rec["experts"]
        if not isinstance(ids, list) or not all(isinstance(e, int) for e in ids):
            raise TraceFormatError(path, f"line {number}: experts must be a list of integers")
        if k is None:
            k, has_probs = len(ids), "gating_probs" in rec
        if len(ids) != k:
            raise TraceFormatError(path, f"ragged records: line {number} has {len(ids)} experts, earlier lines {k}")
        if ("gating_probs" in rec) != has_probs:
            raise TraceFormatError(path, f"line {number}: gating_probs must be in every record or in none")
        if has_probs:
            if not isinstance(rec["gating_probs"], list) or len(rec["gating_probs"]) != k:
                raise TraceFormatError(path, f"ragged records: line {number} has {k} experts but "
                                             f"{len(rec['gating_probs'])} gating_probs")
            probs.append(rec["gating_probs"])
        if "phase" in rec and rec["phase"] not in PHASE_NAMES:
            raise TraceFormatError(path, f"line {number}: phase must be 'prefill', 'decode', 0 or 1")
        phases.append(PHASE_NAMES.get(rec.get("phase"), -1))
        key = tuple(rec.get(name) for name in REQUEST_FIELDS)
        request = requests.setdefault(key, len(requests))
        if not isinstance(rec["layer"], int) or not isinstance(rec["token_idx"], int):
            raise TraceFormatError(path, f"line {number}: layer and token_idx must be integers")
        rows.append((request, rec["token_idx"], rec["layer"]))
        chosen.append(ids)
    if not rows:
        raise TraceFormatError(path, "no routing records")
    # R requests, N records, k experts per record
    meta = np.asarray(rows, dtype=np.int64)                   # [N, 3] request, token, layer
    chosen_arr = np.asarray(chosen, dtype=np.int64)           # [N, k]
    layer_values = np.unique(meta[:, 2])
    first, last = int(layer_values[0]), int(layer_values[-1])
    if len(layer_values) != last - first + 1:
        absent = sorted(set(range(first, last + 1)) - set(layer_values.tolist()))
        raise TraceFormatError(path, f"missing layers: {absent} never appear (layers {first}..{last})")
    layers = last - first + 1  # a dump that starts after dense layers (first > 0) is shifted to start at 0
    probs_arr = np.asarray(probs, dtype=np.float32) if has_probs else None  # [N, k]
    phases_arr = np.asarray(phases, dtype=np.int64)                         # [N], -1 where absent
    order = np.argsort(meta[:, 0], kind="stable")  # records grouped by request, in file order within one
    bounds = np.searchsorted(meta[order, 0], np.arange(len(requests) + 1))
    out_ids, out_w, out_phase, out_req = [], [], [], []
    for request in range(len(requests)):
        sel = order[bounds[request]:bounds[request + 1]]
        tok, lay = meta[sel, 1], meta[sel, 2] - first
        t0 = int(tok.min())
        tokens = int(tok.max()) - t0 + 1
        seen = np.zeros((tokens, layers), dtype=np.int64)
        np.add.at(seen, (tok - t0, lay), 1)
        if (seen > 1).any():
            t, layer = np.argwhere(seen > 1)[0]
            raise TraceFormatError(path, f"request {request}: token_idx {t + t0} has several records for layer "
                                         f"{layer + first}")
        if (seen == 0).any():
            t = int(np.argwhere((seen == 0).any(1))[0][0])
            lacking = (np.flatnonzero(seen[t] == 0) + first).tolist()
            raise TraceFormatError(path, f"missing layers: request {request}, token_idx {t + t0} lacks layers "
                                         f"{lacking}")
        ids = np.zeros((tokens, layers, k), dtype=np.int64)
        ids[tok - t0, lay] = chosen_arr[sel]
        out_ids.append(ids)
        if has_probs:
            w = np.zeros((tokens, layers, k), dtype=np.float32)
            w[tok - t0, lay] = probs_arr[sel]
            out_w.append(w)
        ph = np.full(tokens, -1, dtype=np.int64)
        ph[tok - t0] = phases_arr[sel]
        out_phase.append(ph)
        out_req.append(np.full(tokens, request, dtype=np.int32))
    phase = np.concatenate(out_phase)
    if (phase >= 0).any() and not (phase >= 0).all():
        raise TraceFormatError(path, "phase must be in every record or in none")
    return _check(path, np.concatenate(out_ids), np.concatenate(out_w) if has_probs else None, None,
                  phase if (phase >= 0).all() else None,
                  np.concatenate(out_req) if len(requests) > 1 else None, experts)


# ---- loading ----------------------------------------------------------------------------------------

def _sniff(path: Path) -> str:
    """The container from the extension, or from the first bytes where the extension says nothing."""
    suffixes = [s.lower() for s in path.suffixes]
    for suffix in reversed(suffixes):
        if suffix in (".jsonl", ".json", ".ndjson"):
            return "jsonl"
        if suffix in (".safetensors", ".npz", ".npy", ".pt", ".pth"):
            return suffix[1:]
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"\x1f\x8b") or head.lstrip()[:1] == b"{":
        return "jsonl"
    if head.startswith(b"PK"):  # a zip: numpy's npz or torch's archive
        with zipfile.ZipFile(path) as z:
            return "npz" if all(n.endswith(".npy") for n in z.namelist()) else "pt"
    if len(head) >= 9 and head[8:9] == b"{":  # safetensors: u64 header length, then a JSON header
        return "safetensors"
    raise TraceFormatError(path, "unrecognised file: expected .safetensors, .npz, .npy, .pt or .jsonl")


def _arrays(path: Path, container: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The named arrays of a binary container, and its metadata."""
    try:
        if container == "safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="np") as f:
                return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})
        if container == "npz":
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
            tag = str(arrays.pop("format")) if "format" in arrays and arrays["format"].ndim == 0 else ""
            name, _, version = tag.rpartition(" ")
            return arrays, ({"format": name, "version": version} if name else {})
        if container == "npy":
            return {"ids": np.load(path, allow_pickle=False)}, {}
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except TraceFormatError:
        raise
    except Exception as exc:  # a damaged container: say which file and why
        raise TraceFormatError(path, f"cannot read as {container}: {exc}") from None
    if isinstance(loaded, dict):
        return {str(name): value for name, value in loaded.items()}, {}
    return {"ids": loaded}, {}


def load_trace(path: str | Path, format: str | None = None, experts: int | None = None) -> Trace:
    """Read a routing trace: the project format or an importer's (see the module docstring).
    format: "project", "vllm" or "jsonl" to override detection; experts: the model's expert count, to
    check ids against (without it ids are only checked to be non-negative and below 32768)."""
    path = Path(path)
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    container = "jsonl" if format == "jsonl" else _sniff(path)
    if container == "jsonl":
        if format not in (None, "jsonl"):
            raise TraceFormatError(path, f"a JSONL file cannot be read as format {format!r}")
        return _jsonl(path, experts)
    arrays, metadata = _arrays(path, container)
    is_project = metadata.get("format") == FORMAT_NAME or ("ids" in arrays and container in ("safetensors", "npz"))
    if format == "project" or (format is None and is_project):
        if "ids" not in arrays:
            raise TraceFormatError(path, f"a project trace needs an 'ids' entry, found {sorted(arrays)}")
        if metadata.get("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise TraceFormatError(path, f"trace format version {metadata['version']} is not {FORMAT_VERSION}")
        return _project(path, arrays, experts)
    return _vllm(path, arrays, experts)
