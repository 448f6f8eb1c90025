"""Offload copies replayed from recorded routing traces: what one shared LRU slab pool copies over the link for
each compression's traces (`affinity_study.py --keep-traces`), at a few budgets.

    python -m benchmarks.trace_replay --traces DIR [--budgets 0.4,0.7] [--expert-bytes 393216] [--out DIR]

DIR holds a folder per compression, named as affinity_study names them: `none` (no pruning) and
METHOD-KEEP-DEPTH (`affinity-0.5-1`: Algorithm 1 keeping half the visual tokens after a pinned prefix of
1 layer), each with request-*.safetensors (vismmoe_kt/predictor/traces.py: per step of a request the
(layers, experts) set of experts its tokens used; the first step the prefill, then decode steps). Each
folder's requests run one after another through one pool of slabs: a budget B (a share of the model's
layers x experts) holds B x layers x experts experts, the pinned prefix's layers whole and the rest as
slabs. In layer order the prefill copies each expert it uses that no slab holds (as the runtime's streamed
prefill does), and each decode step its misses; a copy takes the least recently used slab (one policy for
every compression: the runtime's streamed prefill takes the slab whose layer runs again last). `none` is
replayed at the depth of each pruned folder, so every row compares with the unpruned traces at its own depth.
The first request warms the pool and is not counted.

Counts, not times: a trace holds which experts a step used, not how long it took. Bytes are the counts
times --expert-bytes (default: routing-12x64's BF16 expert, 3 x 512 x 128 x 2 bytes).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from pathlib import Path

import torch

from benchmarks.results import print_table, save_json
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.predictor.traces import read_trace

ROUTING_12X64_EXPERT_BYTES = 3 * 512 * 128 * 2


class SlabPool:
    """One pool of `slabs` slabs shared by the offloaded layers; least recently used goes first."""

    def __init__(self, slabs: int):
        if slabs < 1:
            raise ValueError(f"a budget that leaves {slabs} slabs: nothing to replay")
        self.slabs = slabs
        self.held: OrderedDict[tuple[int, int], None] = OrderedDict()

    def use(self, layer: int, expert: int) -> bool:
        """Touch (layer, expert); True when it had to be copied in."""
        key = (layer, expert)
        if key in self.held:
            self.held.move_to_end(key)
            return False
        if len(self.held) >= self.slabs:
            self.held.popitem(last=False)
        self.held[key] = None
        return True


def slab_count(budget: float, depth: int, layers: int, experts: int) -> int:
    """Slabs a budget (share of the layers x experts) leaves beside `depth` pinned layers held whole."""
    return int(budget * layers * experts) - depth * experts


def replay(requests: list[list[dict]], budget: float, depth: int) -> dict:
    """Experts copied per request (prefill, decode; the first request not counted) for `requests` (each a list
    of trace steps) through one pool at `budget` (share of the layers x experts) with `depth` pinned layers."""
    layers, experts = requests[0][0]["active"].shape
    slabs = slab_count(budget, depth, layers, experts)
    pool = SlabPool(slabs)
    prefill, decode = [], []
    for steps in requests:
        copied = {"prefill": 0, "decode": 0}
        for step in steps:
            for layer in range(depth, layers):
                for expert in torch.nonzero(step["active"][layer]).flatten().tolist():
                    copied[step["phase"]] += pool.use(layer, expert)
        prefill.append(copied["prefill"])
        decode.append(copied["decode"])
    return {"slabs": slabs, "prefill_per_request": prefill[1:], "decode_per_request": decode[1:],
            "prefill_mean": statistics.mean(prefill[1:]), "decode_mean": statistics.mean(decode[1:])}


def read_folder(folder: Path) -> list[list[dict]]:
    paths = sorted(folder.glob("request-*.safetensors"))
    if len(paths) < 2:
        raise SystemExit(f"{folder}: {len(paths)} request traces; the replay needs two or more (the first warms "
                         "the pool)")
    return [read_trace(path) for path in paths]


def pruned_folders(root: Path) -> dict[str, tuple[str, float, int]]:
    """The pruned folders under `root` by name: (method, keep, depth)."""
    out = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        parts = folder.name.rsplit("-", 2)
        if len(parts) == 3:  # not `none` nor `train-none` (the predictor's training traces)
            try:
                out[folder.name] = (parts[0], float(parts[1]), int(parts[2]))
            except ValueError:
                continue
    return out


def study(root: Path, budgets: list[float], expert_bytes: int) -> list[dict]:
    if not (root / "none").is_dir():
        raise SystemExit(f"{root}: no `none` folder (the unpruned traces every row compares with)")
    pruned = pruned_folders(root)
    if not pruned:
        raise SystemExit(f"{root}: no folder named METHOD-KEEP-DEPTH (affinity_study.py --keep-traces writes them)")
    traces = {name: read_folder(root / name) for name in ["none", *pruned]}
    layers, experts = traces["none"][0][0]["active"].shape
    rows, skipped = [], []
    for budget in budgets:
        for depth in sorted({d for _, _, d in pruned.values()}):
            if slab_count(budget, depth, layers, experts) < 1:  # the pinned prefix alone fills the budget
                skipped.append(f"budget {budget} at depth {depth}")
                continue
            names = ["none"] + [n for n, (_, _, d) in pruned.items() if d == depth]
            for name in names:
                result = replay(traces[name], budget, depth)
                method, keep = ("none", 1.0) if name == "none" else pruned[name][:2]
                rows.append({"budget": budget, "depth": depth, "compression": method, "keep": keep,
                             **result, "prefill_mb": round(result["prefill_mean"] * expert_bytes / 1e6, 2),
                             "decode_mb": round(result["decode_mean"] * expert_bytes / 1e6, 2)})
    if skipped:
        print(f"left out (the pinned prefix's {experts} experts a layer leave no slab of a {layers} x {experts} model): "
              + ", ".join(skipped))
    if not rows:
        raise SystemExit(f"no budget of {budgets} holds a slab beside the pinned prefix of any depth here; "
                         "give larger --budgets")
    return rows


def main(argv=None) -> int:
    p = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    p.add_argument("--traces", required=True, help="affinity_study's traces folder (none, METHOD-KEEP-DEPTH, ...)")
    p.add_argument("--budgets", default="0.4,0.7", help="shares of the model's layers x experts the GPU holds")
    p.add_argument("--expert-bytes", type=int, default=ROUTING_12X64_EXPERT_BYTES, help="bytes of one expert")
    p.add_argument("--out", help="directory for trace_replay.json")
    args = p.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    if any(not 0 < b <= 1 for b in budgets):
        p.error(f"--budgets {args.budgets}: each a share in (0, 1]")
    root = Path(args.traces)
    if not root.is_dir():
        p.error(f"--traces {root}: not a folder")
    rows = study(root, budgets, args.expert_bytes)
    columns = ("budget", "depth", "compression", "keep", "slabs", "prefill_mean", "decode_mean", "prefill_mb",
               "decode_mb")
    print_table(["budget", "depth", "compression", "keep", "slabs", "experts copied per prefill",
                 "per request's decode", "prefill MB", "decode MB"],
                [[round(row[c], 2) if isinstance(row[c], float) else row[c] for c in columns] for row in rows])
    save_json(args.out, "trace_replay.json", {"traces": str(root), "expert_bytes": args.expert_bytes, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
