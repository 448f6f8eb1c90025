"""One decode token's routed experts (Qwen3-VL-30B-A3B shapes, BF16, K = 8): where the time goes.

    PYTHONPATH=. python3 -m benchmarks.decode_kernel_bench --out DIR

Rows, each the median of CUDA-event timings of a captured graph that runs LAYERS layers in a row
(distinct experts per layer, so nothing is served from L2):
  grouped resident     transformers' grouped GEMM over a bank (the placement path's kernel)
  table resident       the decode table's Triton kernels, every expert in a slab
  table host           the same, every expert read from the page-locked host store (zero-copy over PCIe)
  table host + land    ... and written into a landing slab as it is read (what a decode miss costs)
  copy engine          cudaMemcpyAsync of the same bytes from the host store into slabs
  prefetch P programs  the lookahead prefetch's kernels (claim, copy by P programs, publish) moving
                       the same experts into landing slots (kernels.prefetch_copy.prefetch)
  resident + prefetch  "table resident" on the compute stream while the prefetch (32 programs)
                       runs on a side stream: how much each slows the other
Each with the bytes of expert weights it reads and the rate that makes. Also: how long registering
page-locked host memory takes per GiB (the store's load cost). `--tune`: each kernel of the table
path alone, resident, over (rows per program, columns per tile, warps), fastest first. Quantized
slabs (Q8_0, Q4_0, Q4_K, Q5_K; `--formats` picks): their GEMVs with every expert resident, and with
`--tune` over QUANTIZED_SWEEP's (rows per program, warps, load form: loop, unrolled, tile; Q4_K also shared
and dp4a), each with its error. `--quantized` without `--batch`: only those (decode_kernel_bench_quantized.json), e.g.

    PYTHONPATH=. python3 -m benchmarks.decode_kernel_bench --out DIR --quantized --tune --formats q4_k,q8_0

`--batch`: a batched step's resident experts instead (T = 2, 4, 8, 16 tokens, each with K distinct
random experts of a layer, LAYERS layers each with its own bank of E experts): grouped GEMM, the
table kernels (a read per pair) and the expert-major tensor-core kernels (runtime/kernels/expert_major.py,
a read per expert), with the distinct experts read per layer, the rate that makes, and each result's
error against grouped GEMM; with `--tune`, the expert-major kernels' tiles at T = 8. `--batch
--quantized`: the same step on Q4_K slabs: the GEMVs token by token, all pairs in one launch (the
tuned form, and the int8-input dp4a form), and the quantized expert-major kernels
(runtime/kernels/quantized_major.py), with `--tune` their tiles.
The tiles the kernels run with by default are the device's in runtime/kernels/tuning.json.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from vismmoe_kt.runtime.kernels import bf16_gemv, expert_major, prefetch_copy, quantized_gemv
from vismmoe_kt.runtime.kernels import tuning as kernel_tuning
from vismmoe_kt.runtime.expert_compute import bank_experts
from vismmoe_kt.runtime.host_memory import HostBuffer
from vismmoe_kt.runtime.table_experts import combine, pair_outputs, table_experts

from benchmarks.timing import median_seconds
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

E, H, I, K = 128, 2048, 768, 8
LAYERS = 8


def timed(run, repeats: int = 20) -> float:
    """Median seconds of one replay of a graph of `run`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


# the BF16 GEMVs' tiles: (rows per program, columns per loaded tile) up to whole rows (2048 columns: one load
# per row, as the quantized kernels' "tile" form), at most 8192 elements per weight tile (more spills on sm_90)
BF16_TILES = [(r, c) for r in (1, 2, 4, 8, 16) for c in (256, 512, 1024, 2048) if r * c <= 8192]


def tune(x, ids, resident, no_land, pools, host, block_bytes) -> dict[str, list]:
    """Each kernel alone, every expert resident, per (rows, cols, warps): microseconds per layer."""
    out = {}
    for part, share in (("gate_up", 2 / 3), ("down", 1 / 3)):
        results = []
        for rows, cols in BF16_TILES:
            for warps in (1, 2, 4, 8):
                config = (rows, cols, warps)

                def run():
                    for l in range(LAYERS):
                        bf16_gemv.experts_where_they_lie(
                            x, ids[l].view(-1), resident[l], no_land, pools, host.data_ptr(), host.shape[1], K,
                            gate_up_config=config, down_config=config, parts=part)
                try:
                    seconds = timed(run, repeats=10)
                except Exception as exc:  # a shape the compiler refuses (too many registers)
                    results.append({"config": config, "error": str(exc).splitlines()[0][:120]})
                    continue
                results.append({"config": config, "us_per_layer": seconds / LAYERS * 1e6,
                                "gb_s": LAYERS * K * block_bytes * share / seconds / 1e9})
        out[part] = sorted(results, key=lambda r: r.get("us_per_layer", float("inf")))
    return out


QUANTIZED_FORMATS = ("q8_0", "q4_0", "q4_k", "q4_k:bytes", "q5_k")  # q4_k:bytes: its quant bytes read one by one
# the quantized GEMVs' sweep: (rows per program, warps, load form: quantized_gemv.LOAD_FORMS), chosen so each
# compiles without spilling on sm_90 and a format's sweep compiles in about a minute (the unrolled Q4_K
# kernels take 5-15 s each; (16, 4) unrolled spills)
QUANTIZED_SWEEP = ([(r, w, "loop") for r, w in ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4))]
                   + [(r, w, "unrolled") for r, w in ((4, 1), (8, 2), (8, 4), (16, 8), (32, 8))]
                   + [(r, w, "tile") for r, w in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 4), (8, 4), (8, 8), (16, 8))]
                   + [(r, w, "shared") for r, w in ((1, 1), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (16, 4), (16, 8),
                                                    (32, 8))]  # Q4_K only
                   + [(r, w, "dp4a") for r, w in ((1, 1), (2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (16, 4))])  # Q4_K only


def quantized_rows(device, x, sweep: bool, formats=QUANTIZED_FORMATS, forms=None) -> dict[str, dict]:
    """The quantized slabs' GEMVs (quantized_gemv.quantized_experts), every expert resident in its slab, per
    format: microseconds per layer, the blocks' bytes read per second, and the error against the same
    blocks dequantized and computed in fp32; `sweep`: every configuration of QUANTIZED_SWEEP (of `forms`, the
    load forms to keep; None: all)."""
    out = {}
    for name in formats:
        with kernel_tuning.overridden(q4_k_word_loads=not name.endswith(":bytes")):
            out[name] = quantized_format_rows(device, x, name.split(":")[0], sweep, forms)
    return out


def quantized_format_rows(device, x, fmt: str, sweep: bool, forms=None) -> dict:
    """`quantized_rows` of one format."""
    from vismmoe_kt.runtime.store import ExpertStore

    store = ExpertStore(LAYERS * K, H, I, torch.bfloat16, pin_memory=False, fmt=fmt)
    store.fill_layer(0, torch.randn(LAYERS * K, 2 * I, H, device=device) / 50,
                     torch.randn(LAYERS * K, H, I, device=device) / 50)
    pool = store.layers[0].to(device)           # slab i holds expert i
    slots = [torch.arange(l * K, (l + 1) * K, device=device) for l in range(LAYERS)]
    gu, dn = store.dequantized(pool[:K], 0)
    gate, up = torch.bmm(gu.float(), x.float().expand(K, H).unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    want = torch.bmm(dn.float(), (torch.nn.functional.silu(gate) * up).unsqueeze(-1)).squeeze(-1)

    def error(config=None) -> float:
        got = quantized_gemv.quantized_experts(x, slots[0], pool, fmt, fmt, I, H, K, config)
        return float((got - want).norm() / want.norm())

    tuned = kernel_tuning.get("quantized_gemv", device)[fmt]
    results = []
    swept = [c for c in QUANTIZED_SWEEP if quantized_gemv.form_reads(c, fmt) and (forms is None or c[2] in forms)]
    for config in swept if sweep else [tuned]:
        def run():
            for l in range(LAYERS):
                quantized_gemv.quantized_experts(x, slots[l], pool, fmt, fmt, I, H, K, config)
        try:
            seconds = timed(run, repeats=10)
        except Exception as exc:  # a shape the compiler refuses
            results.append({"config": config, "error": str(exc).splitlines()[0][:120]})
            continue
        results.append({"config": config, "us_per_layer": seconds / LAYERS * 1e6,
                        "gb_s": LAYERS * K * store.block_bytes / seconds / 1e9, "relative_error": error(config)})
    return {"tuned": tuned, "relative_error_vs_dequantized": error(),
            "results": sorted(results, key=lambda r: r.get("us_per_layer", float("inf")))}


def prefetch_rows(device, host, pools, compute, per_token: int) -> list[dict]:
    """The lookahead prefetch's copy rate by program count, alone and beside resident compute."""
    from vismmoe_kt.runtime.decode_table import DecodeTable

    table = DecodeTable(LAYERS, E, K, device, landing_slots=K)
    addresses = torch.full((LAYERS,), host.data_ptr(), dtype=torch.long, device=device)
    rows_of = torch.arange(LAYERS, device=device).repeat_interleave(K)
    experts = torch.arange(LAYERS * K, device=device) % E

    def reset():
        table.slots.fill_(-1)
        table.used.zero_()
        table.reserve([[l * K + k for k in range(K)] for l in range(LAYERS)])

    def timed_eager(run, side_run=None) -> float:
        times = []
        side = torch.cuda.Stream()
        for _ in range(10):
            reset()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            if side_run is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    side_run()
            run()
            if side_run is not None:
                torch.cuda.current_stream().wait_stream(side)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1000)
        return statistics.median(times)

    out = []
    for programs in (8, 16, 32, 64, 132):
        seconds = timed_eager(lambda: prefetch_copy.prefetch(table, rows_of, experts, pools, addresses, programs))
        out.append({"kernel": f"prefetch {programs} programs", "us_per_layer": seconds / LAYERS * 1e6,
                    "gb_s": per_token / seconds / 1e9})
    alone = timed_eager(compute)
    both = timed_eager(compute, lambda: prefetch_copy.prefetch(table, rows_of, experts, pools, addresses))
    out.append({"kernel": "resident alone", "us_per_layer": alone / LAYERS * 1e6, "gb_s": per_token / alone / 1e9})
    out.append({"kernel": "resident + prefetch", "us_per_layer": both / LAYERS * 1e6, "gb_s": None})
    return out


def batch_steps(device):
    """(T, x (T, H), routing weights (T, K), per layer ids (T, K), distinct experts per layer) for T = 2, 4,
    8, 16 tokens, each with K distinct random experts of a layer (seeded: every run the same)."""
    generator = torch.Generator().manual_seed(0)
    for tokens in (2, 4, 8, 16):
        x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16)
        w = torch.rand(tokens, K, device=device)
        ids = [torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)]).to(device)
               for _ in range(LAYERS)]
        yield tokens, x, w, ids, sum(int(i.unique().numel()) for i in ids) / LAYERS


def batch_rows(device, sweep: bool) -> dict:
    """--batch: a batched step's resident experts, three ways (see the module's docstring)."""
    banks = [(torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) / 50,
              torch.randn(E, H, I, device=device, dtype=torch.bfloat16) / 50) for _ in range(LAYERS)]
    identity = torch.arange(E, device=device)
    act = torch.nn.SiLU()
    expert_bytes = 3 * I * H * 2
    rows, tuning = [], []
    for tokens, x, w, ids, distinct in batch_steps(device):

        def grouped():
            return [bank_experts(x, ids[l], w, identity, *banks[l], act) for l in range(LAYERS)]

        def table():
            out = []
            for l in range(LAYERS):
                flat = ids[l].reshape(-1)
                y = pair_outputs(x, flat, flat, torch.full_like(flat, -1), banks[l], None, act, K, True)
                out.append(combine(y, w, x.dtype, True))
            return out

        def major(gate_up_tiles=None, down_tiles=None):  # None: the device's tuned tiles
            def run():
                out = []
                for l in range(LAYERS):
                    y = expert_major.experts_expert_major(x, ids[l], *banks[l], gate_up_tiles, down_tiles)
                    out.append(combine(y, w, x.dtype, True))
                return out
            return run

        want = grouped()
        for name, run in (("grouped GEMM", grouped), ("table (a read per pair)", table),
                          ("expert-major (a read per expert)", major())):
            got = run()
            error = max(float((g.float() - r.float()).norm() / r.float().norm()) for g, r in zip(got, want))
            seconds = timed(run)
            rows.append({"tokens": tokens, "kernel": name, "us_per_layer": seconds / LAYERS * 1e6,
                         "distinct_experts": distinct, "gb_s": distinct * expert_bytes * LAYERS / seconds / 1e9,
                         "relative_error_vs_grouped": error})
        if sweep and tokens == 8:
            tuning = sweep_tiles(major, itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4)))
    return {"rows": rows, "tuning": tuning}


def sweep_tiles(make_run, tile_options) -> list[dict]:
    """Each projection's kernel timed at each of `tile_options` (the other at its default), fastest first:
    `make_run(gate_up_tiles=..)` / `make_run(down_tiles=..)` give the run."""
    tuning = []
    for tiles in tile_options:
        for part, run in (("gate_up", make_run(gate_up_tiles=tiles)), ("down", make_run(down_tiles=tiles))):
            try:
                seconds = timed(run)
            except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses
                tuning.append({"part": part, "tiles": tiles, "error": str(exc)[:200]})
                continue
            tuning.append({"part": part, "tiles": tiles, "us_per_layer": seconds / LAYERS * 1e6})
    return sorted(tuning, key=lambda r: (r["part"], r.get("us_per_layer", 1e9)))


def batch_quantized_rows(device, sweep: bool, fmt: str = "q4_k") -> dict:
    """--batch --quantized: a batched step's experts on quantized slabs (every expert of LAYERS layers
    resident in its slab), three ways: the GEMVs token by token (what a step ran before, one token's K
    pairs a launch), the GEMVs over all the step's pairs in one launch, and the expert-major kernels
    (runtime/kernels/quantized_major.py: each expert decoded once per block of its tokens); each result's
    error against grouped GEMM over the same blocks dequantized to BF16. `sweep`: the expert-major
    kernels' tiles at T = 8."""
    from vismmoe_kt.runtime.kernels import quantized_major
    from vismmoe_kt.runtime.store import ExpertStore

    store = ExpertStore(E, H, I, torch.bfloat16, pin_memory=False, fmt=fmt)
    pools = []
    for l in range(LAYERS):  # quantized on the GPU, a layer at a time
        store.fill_layer(l, torch.randn(E, 2 * I, H, device=device) / 50, torch.randn(E, H, I, device=device) / 50)
        pools.append(store.layers.pop(l).to(device))  # slab e holds expert e
    staging = torch.zeros(16 * K, pools[0].shape[1], dtype=torch.uint8, device=device)
    reference_bank = store.dequantized(pools[0], 0)
    identity = torch.arange(E, device=device)
    act = torch.nn.SiLU()
    rows, tuning = [], []
    for tokens, x, w, ids, distinct in batch_steps(device):
        no_land = torch.full((tokens * K,), -1, dtype=torch.long, device=device)

        def per_token():
            return [torch.cat([combine(quantized_gemv.quantized_experts(x[t:t + 1], ids[l][t], pools[l], fmt, fmt, I, H, K),
                                       w[t:t + 1], x.dtype, True) for t in range(tokens)]) for l in range(LAYERS)]

        def one_launch(config=None):  # None: the device's tuned GEMVs
            def run():
                return [combine(quantized_gemv.quantized_experts(x, ids[l].reshape(-1), pools[l], fmt, fmt, I, H, K,
                                                                 config), w, x.dtype, True) for l in range(LAYERS)]
            return run

        def major(gate_up_tiles=None, down_tiles=None):  # None: the device's tuned tiles
            def run():
                return [combine(quantized_major.experts_quantized_major(
                    x, ids[l], ids[l].reshape(-1), no_land, pools[l], staging, fmt, fmt, I, E, gate_up_tiles, down_tiles),
                    w, x.dtype, True) for l in range(LAYERS)]
            return run

        want = bank_experts(x, ids[0], w, identity, *reference_bank, act).float()
        ways = [("GEMVs token by token", per_token), ("GEMVs, every pair in one launch", one_launch()),
                ("expert-major (each expert decoded once)", major())]
        if fmt == "q4_k":  # the int8-input GEMVs (q4k_dp4a.py), every pair in one launch, at two shapes
            ways += [(f"GEMVs, every pair in one launch, dp4a {r}x{w}", one_launch((r, w, "dp4a"))) for r, w in ((4, 1), (8, 2))]
        for name, run in ways:
            error = float((run()[0].float() - want).norm() / want.norm())
            seconds = timed(run)
            rows.append({"format": fmt, "tokens": tokens, "kernel": name, "us_per_layer": seconds / LAYERS * 1e6,
                         "distinct_experts": distinct,
                         "quantized_gb_s": distinct * store.block_bytes * LAYERS / seconds / 1e9,
                         "relative_error_vs_dequantized_grouped": error})
        if sweep and tokens == 8:
            # whole super-blocks a step, and (Q4_K) quarters of them, which leave registers for wider tiles
            tiles = list(itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3)))
            if fmt == "q4_k":
                tiles += list(itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (64,)))
                # the decoded weights first, read by the tensor cores from registers (one stage: tile_form)
                tiles += list(itertools.product((64, 128, 256), (4, 8), (1,), (64,), ("weights",)))
            tuning = sweep_tiles(major, tiles)
    return {"quantized_rows": rows, "quantized_tuning": tuning}


def main() -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for decode_kernel_bench*.json")
    parser.add_argument("--tune", action="store_true", help="sweep the kernels' tile shapes and warps")
    parser.add_argument("--batch", action="store_true", help="a batched step's resident experts (see above)")
    parser.add_argument("--quantized", action="store_true",
                        help="with --batch: the experts on Q4_K slabs instead of resident BF16 banks; alone: only "
                             "the quantized slabs' GEMVs (see above)")
    parser.add_argument("--formats", default=",".join(QUANTIZED_FORMATS),
                        help="the quantized slabs' formats to time, comma-separated (default: all)")
    parser.add_argument("--forms", default=None,
                        help="with --quantized --tune: only these load forms of the sweep, comma-separated "
                             f"({', '.join(quantized_gemv.LOAD_FORMS)}; default: all)")
    args = parser.parse_args()
    device = torch.device("cuda:0")
    formats = args.formats.split(",")
    forms = args.forms.split(",") if args.forms else None
    unknown = sorted(set(forms or ()) - set(quantized_gemv.LOAD_FORMS))
    if unknown:
        parser.error(f"--forms {args.forms}: not load forms: {', '.join(unknown)}")
    if args.quantized and not args.batch:  # the quantized slabs' GEMVs alone (with --tune their sweep)
        torch.manual_seed(0)
        x = torch.randn(1, H, device=device, dtype=torch.bfloat16)
        out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "quantized_slabs": quantized_rows(device, x, args.tune, formats, forms)}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_kernel_bench_quantized.json").write_text(json.dumps(out, indent=2))
        print(json.dumps(out, indent=2))
        for fmt, row in out["quantized_slabs"].items():  # last: each format's three fastest configurations
            best = [f"{r['config']} {r['us_per_layer']:.1f} us ({r['gb_s']:.0f} GB/s)" for r in row["results"][:3]
                    if "us_per_layer" in r]
            print(f"{fmt}: tuned {row['tuned']}, error {row['relative_error_vs_dequantized']:.2e}; " + ", ".join(best))
        return 0
    if args.batch:
        out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               **(batch_quantized_rows(device, args.tune) if args.quantized else batch_rows(device, args.tune))}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "decode_kernel_bench_batch_quantized.json" if args.quantized else "decode_kernel_bench_batch.json"
        (Path(args.out) / name).write_text(json.dumps(out, indent=2))
        print(json.dumps(out, indent=2))
        return 0
    torch.manual_seed(0)
    block = 3 * I * H
    block_bytes = block * 2
    start = time.perf_counter()
    store = HostBuffer(E * block, torch.bfloat16, page_locked=True)
    register_s = time.perf_counter() - start
    host = store.tensor.view(E, block)
    host.normal_(0, 0.02)
    slabs = LAYERS * K + 1
    pools = (torch.randn(slabs, 2 * I, H, device=device, dtype=torch.bfloat16) / 50,
             torch.randn(slabs, H, I, device=device, dtype=torch.bfloat16) / 50)
    bank = (torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) / 50,
            torch.randn(E, H, I, device=device, dtype=torch.bfloat16) / 50)
    x = torch.randn(1, H, device=device, dtype=torch.bfloat16)
    w = torch.rand(1, K, device=device)
    ids = [torch.arange(l * K, (l + 1) * K, device=device).view(1, K) % E for l in range(LAYERS)]
    resident = [torch.arange(l * K, (l + 1) * K, device=device) for l in range(LAYERS)]
    on_host = torch.full((K,), -1, dtype=torch.long, device=device)
    no_land = torch.full((K,), -1, dtype=torch.long, device=device)
    identity = torch.arange(E, device=device)
    act = torch.nn.SiLU()

    def grouped():
        for l in range(LAYERS):
            bank_experts(x, ids[l], w, identity, *bank, act)

    def table(slots, land, source):
        def run():
            for l in range(LAYERS):
                table_experts(x, ids[l], w, slots[l], land[l], pools, source, act, True)
        return run

    rows = []
    per_token = LAYERS * K * block_bytes
    for name, run in [("grouped resident", grouped),
                      ("table resident", table(resident, [no_land] * LAYERS, host)),
                      ("table host", table([on_host] * LAYERS, [no_land] * LAYERS, host)),
                      ("table host + land", table([on_host] * LAYERS, resident, host))]:
        seconds = timed(run)
        rows.append({"kernel": name, "us_per_layer": seconds / LAYERS * 1e6, "gb_s": per_token / seconds / 1e9})
    def copies():
        for l in range(LAYERS):
            for k in range(K):
                e = (l * K + k) % E
                pools[0][l * K + k].view(-1).copy_(host[e, :2 * I * H], non_blocking=True)
                pools[1][l * K + k].view(-1).copy_(host[e, 2 * I * H:], non_blocking=True)
    torch.cuda.synchronize()
    seconds = median_seconds(copies, 10)
    rows.append({"kernel": "copy engine", "us_per_layer": seconds / LAYERS * 1e6, "gb_s": per_token / seconds / 1e9})
    rows.extend(prefetch_rows(device, host, pools, table(resident, [no_land] * LAYERS, host), per_token))
    # the table's result from the host equals the one from slabs holding the same bytes (bit for bit)
    for l in range(LAYERS):
        for k in range(K):
            e = (l * K + k) % E
            pools[0][l * K + k].view(-1).copy_(host[e, :2 * I * H])
            pools[1][l * K + k].view(-1).copy_(host[e, 2 * I * H:])
    a = table_experts(x, ids[0], w, resident[0], no_land, pools, host, act, True)
    b = table_experts(x, ids[0], w, on_host, no_land, pools, host, act, True)
    reference = torch.zeros(1, H, device=device)
    for k in range(K):
        e = int(ids[0][0, k])
        gate, up = (host[e, :2 * I * H].view(2 * I, H).to(device).float() @ x[0].float()).chunk(2)
        reference[0] += w[0, k] * (host[e, 2 * I * H:].view(H, I).to(device).float() @ (act(gate) * up))
    error = float((a.float() - reference).norm() / reference.norm())
    tuning = tune(x, ids, resident, no_land, pools, host, block_bytes) if args.tune else None
    quantized = quantized_rows(device, x, args.tune, formats, forms)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "shape": {"experts": E, "hidden": H, "intermediate": I, "top_k": K, "layers_per_graph": LAYERS},
           "register_s_per_gib": register_s / (E * block_bytes / 2**30), "rows": rows,
           "host_equals_slab_bitwise": bool(torch.equal(a, b)), "relative_error_vs_fp32": error, "tuning": tuning,
           "quantized_slabs": quantized}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_kernel_bench.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    store.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
