"""A prompt's routed experts on Q4_K slabs (Qwen3-VL-30B-A3B shapes, BF16 activations, K = 8): the kernels.

    PYTHONPATH=. python3 -m benchmarks.prefill_kernel_bench --out DIR [--tune]

T tokens (236: a 448 px picture's prompt, 512, 824: an 896 px one), each with K distinct random experts
of E = 128 per layer (seeded), LAYERS layers each with its own slabs (every expert resident, as with a
slab for every expert). Rows, each the median of CUDA-event timings of a captured graph of LAYERS layers:

  dequantize + grouped GEMM   the placement path's compute: every expert of the layer decoded from its
                              slab into a bank of BF16 (kernels.dequantize), then transformers' grouped GEMM
  expert-major, block M       kernels.quantized_major: each routed expert decoded once per block of M of its
                              pairs and multiplied on tensor cores, straight from the slabs (filled prefill)
  BF16 grouped GEMM           the same pairs over a resident BF16 bank (a pinned layer): for scale

Each with its error against grouped GEMM on the dequantized weights; "quarter steps": the kernels decoding a
quarter super-block a step; "weights first": the same with the decoded weights as the tensor cores' first
operand, read from registers (quantized_major.tile_form); "weights ahead": that with each step prefetching the next
one's bytes into L1. `--tune`: the expert-major kernels' (block M, columns
per program, warps, stages, piece[, order]) at T = `--tune-tokens` (512), fastest first (tuning.json's
quantized_prefill); below 400 tokens (fewer than 25 pairs an expert) blocks of 16 and 32, else of 32 and 64.
`--adopt` then writes the fastest into this machine's copy of tuning.json (`adopt`), so the commands after it
in the same call (decode_bench end to end) run them; the committed file changes only when its diff is committed.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch

from benchmarks.decode_kernel_bench import timed
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.runtime.expert_compute import bank_experts
from vismmoe_kt.runtime.kernels import dequantize, quantized_major
from vismmoe_kt.runtime.kernels import tuning as kernel_tuning
from vismmoe_kt.runtime.store import ExpertStore
from vismmoe_kt.runtime.table_experts import combine

E, H, I, K = 128, 2048, 768, 8
LAYERS = 8
TOKENS = (236, 512, 824)
FMT = "q4_k"


def routing(tokens: int, device) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=generator).to(device, torch.bfloat16)
    w = torch.rand(tokens, K, generator=generator).to(device)
    ids = [torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)]).to(device)
           for _ in range(LAYERS)]
    return x, w, ids


def main() -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for prefill_kernel_bench.json")
    parser.add_argument("--tune", action="store_true", help="sweep the expert-major kernels' tiles at T = --tune-tokens")
    parser.add_argument("--tune-tokens", type=int, default=512, metavar="T",
                        help="the prompt's tokens the sweep times (236: a 448 px picture's; default 512)")
    parser.add_argument("--adopt", action="store_true",
                        help="with --tune: write the fastest tiles into tuning.json's entry for this GPU")
    parser.add_argument("--profile-once", type=int, default=0, metavar="T",
                        help="instead of the rows: each tile form (PROFILED_FORMS) twice at T tokens on one layer, "
                             "for a profiler such as ncu to catch its launches")
    args = parser.parse_args()
    if args.adopt and not args.tune:
        parser.error("--adopt writes what --tune measured: give both")
    if args.tune_tokens < 1:  # before minutes of rows, not after them
        parser.error(f"--tune-tokens {args.tune_tokens}: a prompt has at least one token")
    device = torch.device("cuda:0")
    torch.manual_seed(0)
    if args.profile_once:
        return profile_once(args.profile_once, device)
    store = ExpertStore(E, H, I, torch.bfloat16, pin_memory=False, fmt=FMT)
    pools = []
    for layer in range(LAYERS):  # quantized on the GPU, a layer at a time; slab e holds expert e
        store.fill_layer(layer, torch.randn(E, 2 * I, H, device=device) / 50, torch.randn(E, H, I, device=device) / 50)
        pools.append(store.layers.pop(layer).to(device))
    bank = (torch.empty(E, 2 * I, H, device=device, dtype=torch.bfloat16),
            torch.empty(E, H, I, device=device, dtype=torch.bfloat16))
    resident = [store.dequantized(pool, 0) for pool in pools[:2]]  # BF16 banks (two: the rest reuse them)
    identity = torch.arange(E, device=device)
    ones = torch.ones(E, dtype=torch.int8, device=device)
    act = torch.nn.SiLU()
    rows, sweep = [], []
    for tokens in TOKENS:
        x, w, ids = routing(tokens, device)
        no_land = torch.full((tokens * K,), -1, dtype=torch.long, device=device)

        def dequantized_grouped():
            out = []
            for layer in range(LAYERS):
                dequantize.fetch_q8(identity, ones, identity, bank, pools[layer].data_ptr(), pools[layer].shape[1],
                                    I, H, fmt=FMT, staged=True)
                out.append(bank_experts(x, ids[layer], w, identity, *bank, act))
            return out

        def major(block_m=None, gate_up_tiles=None, down_tiles=None):
            tuned = kernel_tuning.get("quantized_prefill", device)

            def run():
                return [combine(quantized_major.experts_quantized_major(
                    x, ids[layer], ids[layer].reshape(-1), no_land, pools[layer], pools[layer], FMT, FMT, I, E,
                    gate_up_tiles or tuned["gate_up"], down_tiles or tuned["down"],
                    block_m=block_m or tuned["block_m"]), w, x.dtype, True) for layer in range(LAYERS)]
            return run

        def bf16_grouped():
            return [bank_experts(x, ids[layer], w, identity, *resident[layer % 2], act) for layer in range(LAYERS)]

        want = bank_experts(x, ids[0], w, identity, *resident[0], act).float()
        runs = [("dequantize + grouped GEMM", dequantized_grouped)]
        runs += [(f"expert-major, block M {m}", major(m)) for m in (16, 32, 64, 128)]
        # a quarter super-block a kernel step (fewer registers: two pipeline stages fit)
        runs += [(f"expert-major, block M {m}, quarter steps", major(m, (64, 4, 2, 64), (128, 4, 2, 64)))
                 for m in (32, 64)]
        # the decoded weights first: the tensor cores read them from registers (one stage: see tile_form)
        runs += [(f"expert-major, block M {m}, weights first", major(m, (128, 4, 1, 64, "weights"),
                                                                    (128, 4, 1, 64, "weights"))) for m in (16, 32, 64)]
        # and each step prefetching the next one's bytes into L1
        runs += [(f"expert-major, block M {m}, weights ahead", major(m, (128, 4, 1, 64, "weights-ahead"),
                                                                    (128, 4, 1, 64, "weights-ahead"))) for m in (32, 64)]
        runs += [("BF16 grouped GEMM (resident bank)", bf16_grouped)]
        for name, run in runs:
            error = float((run()[0].float() - want).norm() / want.norm())
            seconds = timed(run, repeats=10)
            rows.append({"tokens": tokens, "kernel": name, "us_per_layer": seconds / LAYERS * 1e6,
                         "relative_error": error})
            print(f"T={tokens:4d} {name:36s} {seconds / LAYERS * 1e6:8.1f} us a layer  error {error:.1e}", flush=True)
    write(args.out, device, rows, sweep)
    if args.tune:  # after every row, so a timeout leaves them all
        x, w, ids = routing(args.tune_tokens, device)
        no_land = torch.full((args.tune_tokens * K,), -1, dtype=torch.long, device=device)
        # blocks about a short prompt's pairs an expert (236 tokens: 15), or a long one's
        blocks = (16, 32) if args.tune_tokens < 400 else (32, 64)
        # whole super-blocks a step (pipelining them spills), or quarters of them with 1-3 stages
        shapes = [(m, n, w, 1, 256) for m, n, w in itertools.product(blocks, (32, 64, 128), (4, 8))]
        shapes += [(m, n, w, s, 64) for m, n, w, s in itertools.product(blocks, (32, 64, 128), (4, 8), (1, 2, 3))]
        # the decoded weights first (one stage; 64 rows and more: a Hopper warp group's product is 64 rows)
        shapes += [(m, n, w, 1, 64, order) for m, n, w, order in
                   itertools.product(blocks, (64, 128, 256), (4, 8), quantized_major.WEIGHTS_FIRST)]
        for block_m, n, warps, stages, *piece in shapes:
            for part in ("gate_up", "down"):
                tiles = {f"{part}_tiles": (n, warps, stages, *piece)}
                try:
                    seconds = timed(major(block_m, **tiles), repeats=5)
                except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses
                    sweep.append({"part": part, "block_m": block_m, "tiles": tiles[f"{part}_tiles"],
                                  "error": str(exc)[:200]})
                    continue
                sweep.append({"part": part, "block_m": block_m, "tiles": tiles[f"{part}_tiles"],
                              "us_per_layer": seconds / LAYERS * 1e6})
                print(f"tune {part} M={block_m} {tiles[f'{part}_tiles']} {seconds / LAYERS * 1e6:.1f} us", flush=True)
        sweep.sort(key=lambda r: (r["part"], r.get("us_per_layer", 1e9)))
        for part in ("gate_up", "down"):
            best = [r for r in sweep if r["part"] == part][:4]
            print(part, [(r["block_m"], r["tiles"], round(r.get("us_per_layer", 0), 1)) for r in best], flush=True)
        if args.adopt:
            name = torch.cuda.get_device_name(0)
            print(f"adopted for {name}:", json.dumps(adopt(sweep, args.tune_tokens, name)), flush=True)
    write(args.out, device, rows, sweep)
    return 0


# (gate_up tiles, down tiles, block M) of the forms --profile-once runs: the tokens first with whole super-blocks and
# with quarter steps, and the weights first
PROFILED_FORMS = {"tokens first": ((64, 4, 1), (128, 4, 1), 32),
                  "tokens first, quarter steps": ((128, 4, 3, 64), (128, 4, 3, 64), 32),
                  "weights first": ((128, 4, 1, 64, "weights"), (128, 4, 1, 64, "weights"), 32),
                  "weights ahead": ((128, 4, 1, 64, "weights-ahead"), (128, 4, 1, 64, "weights-ahead"), 32)}


def profile_once(tokens: int, device) -> int:
    """Each of PROFILED_FORMS run twice (the second warm) on one layer of slabs at `tokens` tokens, in that order,
    nothing timed: a profiler attached to the process (ncu -k regex:_q_) sees each form's kernels."""
    store = ExpertStore(E, H, I, torch.bfloat16, pin_memory=False, fmt=FMT)
    store.fill_layer(0, torch.randn(E, 2 * I, H, device=device) / 50, torch.randn(E, H, I, device=device) / 50)
    pool = store.layers.pop(0).to(device)
    x, _, ids = routing(tokens, device)
    no_land = torch.full((tokens * K,), -1, dtype=torch.long, device=device)
    for name, (gate_up, down, block_m) in PROFILED_FORMS.items():
        for _ in range(2):
            quantized_major.experts_quantized_major(x, ids[0], ids[0].reshape(-1), no_land, pool, pool, FMT, FMT, I, E,
                                                    gate_up, down, block_m=block_m)
        torch.cuda.synchronize()
        print(f"profiled: {name} {gate_up} {down} block M {block_m}, {tokens} tokens", flush=True)
    return 0


def adopt(sweep: list[dict], tokens: int, device_name: str, table: Path = kernel_tuning.TABLE) -> dict:
    """The sweep's fastest gate_up tile with its block M, and the fastest down tile at that block M, written into
    `table`'s entry for `device_name` as its quantized_prefill tiles for a prompt of `tokens` tokens: the `long`
    ones where the entry has them and the prompt reaches their threshold (tuning.prefill_tiles), else the
    others. Each tile was timed beside the other kernel's tuned one, so the pair is the sweep's best guess;
    decode_bench end to end is the judge. Returns what the entry's quantized_prefill became."""
    timed_rows = [r for r in sweep if "us_per_layer" in r]
    gate_up = min((r for r in timed_rows if r["part"] == "gate_up"), key=lambda r: r["us_per_layer"], default=None)
    down = min((r for r in timed_rows if r["part"] == "down" and gate_up and r["block_m"] == gate_up["block_m"]),
               key=lambda r: r["us_per_layer"], default=None)
    if gate_up is None or down is None:
        raise ValueError("the sweep timed no gate_up and down tiles at one block M: nothing to adopt")
    data = json.loads(table.read_text(encoding="utf-8"))
    entry = data.setdefault(device_name, {})
    prefill = entry.setdefault("quantized_prefill", dict(data[kernel_tuning.DEFAULT]["quantized_prefill"]))
    long = prefill.get("long")
    target = long if long is not None and tokens * K / E >= long["from_pairs_per_expert"] else prefill
    target.update(block_m=gate_up["block_m"], gate_up=list(gate_up["tiles"]), down=list(down["tiles"]))
    table.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    kernel_tuning.entry.cache_clear()
    return prefill


def write(out_dir: str, device, rows: list, sweep: list) -> None:
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "tuned": kernel_tuning.get("quantized_prefill", device), "rows": rows, "tuning": sweep}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "prefill_kernel_bench.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
