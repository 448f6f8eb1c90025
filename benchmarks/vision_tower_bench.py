"""A picture's vision tower alone: its time a picture and where its GPU time goes, kernel by kernel.

    PYTHONPATH=. python3 -m benchmarks.vision_tower_bench --out DIR [--image-sizes 448 896] [--reps 20]
        [--compile] [--tiny NAME --device cpu]

Qwen3-VL-30B-A3B's tower at full size (27 blocks, hidden 1152, MLP 4304, random weights made here; the text
model cut to one layer, which the tower does not touch), loaded as the resident configuration loads it: the
vision attention with fewer launches (engine/vision_attention.py) and, on a GPU, one CUDA graph a picture size
(engine/vision_graph.py). Per picture size: the replayed tower's time (CUDA events, median of `--reps`), the
eager forward's for scale, and one replay under torch.profiler, its kernels grouped by kind (GEMMs, attention,
norms, element-wise) with their count and time a picture, the longest ones listed.

`--attention-backends flash efficient cudnn`: then the same with torch's sdpa held to each backend in turn
(torch.nn.attention.sdpa_kernel; the committed run takes torch's own choice, cuDNN's flash kernel on an H100 at
head dim 72). `--compile`: then the same with every block compiled by torch.compile (inductor fuses a block's
norms, rotary, GELU and residual adds). Each alternative captures every picture size again and compares its
output with the committed tower's. Measurement only: the package neither pins a backend nor compiles the tower.

The tower's work does not depend on routing (no experts in it).
"""

from __future__ import annotations

import json
import statistics
import time
import types
from pathlib import Path

import torch

from benchmarks.bench.inputs import make_request
from benchmarks.bench.timing import timed_generate
from benchmarks.configurations import parse_configuration
from benchmarks.decode_bench import family_of, load_model
from benchmarks.models.synthetic import DEFAULT_MODEL
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.models import adapter_for

RESIDENT = "offload:expert_budget=1TiB,graphs=cuda"
# --attention-backends' names: torch.nn.attention.SDPBackend members
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
# kernel name fragments, first match wins: what a kernel of the tower is
KINDS = (("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk")),
         ("attention", ("flash", "fmha", "attention", "softmax")),
         ("norm", ("layer_norm", "layernorm", "rms")),
         ("copy", ("copy", "cat", "index", "gather", "fill")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, fragments in KINDS:
        if any(f in low for f in fragments):
            return kind
    return "element-wise"


def tower_flops(grid: torch.Tensor, config) -> float:
    """The blocks' matrix products of one forward (2 x multiply-adds): qkv, output, MLP in and out."""
    patches = int(grid.prod(dim=1).sum())
    hidden, width, depth = config.hidden_size, config.intermediate_size, config.depth
    return 2.0 * patches * depth * (4 * hidden * hidden + 2 * hidden * width)


def timed(call, reps: int, cuda: bool) -> list[float]:
    """Milliseconds of each of `reps` calls (CUDA events on the GPU)."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def kernel_table(call, runs: int) -> dict:
    """`runs` calls under torch.profiler: each kernel's count and microseconds a call, and totals by kind."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            call()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name:
            row = kernels.setdefault(event.name, [0, 0.0])
            row[0] += 1
            row[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    rows = sorted(({"kernel": name[:140], "kind": kind_of(name), "count": n / runs, "us": us / runs}
                   for name, (n, us) in kernels.items()), key=lambda r: -r["us"])
    kinds: dict[str, dict] = {}
    for r in rows:
        k = kinds.setdefault(r["kind"], {"count": 0.0, "us": 0.0})
        k["count"] += r["count"]
        k["us"] += r["us"]
    return {"kinds": kinds, "kernels": rows, "total_us": sum(r["us"] for r in rows),
            "count": sum(r["count"] for r in rows)}


def measure(name: str, tower, requests: dict, reps: int, cuda: bool, graphed, reference: dict | None) -> dict:
    """Each picture size's row (times, the graph's counters, the kernels) under alternative `name`; a reference's
    outputs compared, or (none given) this run's outputs kept under "_outputs"."""
    if graphed is not None:
        graphed.grids.clear()  # each alternative captured anew
    out = {}
    for label, request in requests.items():
        pixels, grid = request["pixel_values"], request["image_grid_thw"]
        call = lambda: tower(pixels, grid_thw=grid)  # noqa: E731
        first = call()  # eager, then captured and checked (vision_graph.py)
        replayed = timed(call, reps, cuda)
        row = {"replay_ms": replayed, "replay_ms_median": statistics.median(replayed),
               "tflops": tower_flops(grid, tower.config) / statistics.median(replayed) / 1e9}
        if graphed is not None:
            row["graph"] = graphed.stats()
            eager = timed(lambda: graphed.own_forward(pixels, grid_thw=grid), max(3, reps // 4), cuda)
            row["eager_ms_median"] = statistics.median(eager)
        output = first[0] if isinstance(first, (tuple, list)) else getattr(first, "last_hidden_state", first)
        if reference is not None and label in reference:
            row["max_difference"] = float((output.float() - reference[label].float()).abs().max())
            row["reference_max"] = float(reference[label].float().abs().max())
        else:
            out.setdefault("_outputs", {})[label] = output.detach().clone()
        if cuda:
            row["profile"] = kernel_table(call, 3)
        out[label] = row
        kinds = row.get("profile", {}).get("kinds", {})
        print(f"{name}, {label}: replay {row['replay_ms_median']:.3f} ms ({row['tflops']:.3g} TFLOP/s of its products)"
              + (f", eager {row['eager_ms_median']:.2f} ms" if "eager_ms_median" in row else "")
              + (f", max difference {row['max_difference']:.3g} of {row['reference_max']:.3g}"
                 if "max_difference" in row else "")
              + "".join(f"; {k} {v['count']:.0f} kernels {v['us'] / 1e3:.3f} ms" for k, v in kinds.items()),
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for vision_tower_bench.json")
    parser.add_argument("--image-sizes", type=int, nargs="+", default=[448, 896], help="picture sizes in pixels")
    parser.add_argument("--reps", type=int, default=20, help="timed replays a picture size (20)")
    parser.add_argument("--attention-backends", nargs="*", default=[], choices=sorted(BACKENDS),
                        help="then sdpa held to each of these backends in turn, compared")
    parser.add_argument("--compile", action="store_true", help="then every block under torch.compile, compared")
    parser.add_argument("--top", type=int, default=15, help="kernels printed a picture size (15)")
    parser.add_argument("--tiny", help="a tiny random model instead (a sanity run, with --device cpu)")
    parser.add_argument("--device", default="cuda:0", help="where the tower runs (cpu with --tiny)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps {args.reps}: at least one")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (--device cpu with --tiny for a sanity run)")
    bench_args = types.SimpleNamespace(device=args.device, routing="synthetic", tiny=args.tiny, model=DEFAULT_MODEL,
                                       tiny_dir=None, layers=1, dtype="bfloat16", narrow=False)
    config_text = RESIDENT if cuda else "offload:expert_budget=1TiB,graphs=replay"
    if args.tiny:
        import atexit
        import shutil
        import tempfile

        from vismmoe_kt.demo.tiny import save_tiny_model
        root = tempfile.mkdtemp(prefix="vision-tower-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        bench_args.tiny_dir = save_tiny_model(root, args.tiny, seed=0)
    model, processor = load_model(bench_args, parse_configuration(config_text, family_of(bench_args)))
    adapter = adapter_for(model.config.model_type)
    requests = {f"{size} px": make_request(processor, size, args.device) for size in args.image_sizes}
    for request in requests.values():  # the decode engine, made at the first prompt, installs the tower's
        timed_generate(model, request, 1)  # attention and graph; each picture size captured
    tower = adapter.vision_tower(model)
    while getattr(tower, "is_injected_operator", False):
        tower = tower.orig_module
    graphed = tower.forward if hasattr(tower.forward, "grids") else None
    result = {"device": torch.cuda.get_device_name(0) if cuda else args.device, "routing": "none (no experts)",
              "committed": None}
    with torch.inference_mode():
        committed = measure("committed", tower, requests, args.reps, cuda, graphed, None)
        reference = committed.pop("_outputs", {})
        result["committed"] = committed
        for backend in args.attention_backends:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            name = f"sdpa {backend}"
            try:
                with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
                    result[name] = measure(name, tower, requests, args.reps, cuda, graphed, reference)
            except RuntimeError as error:  # the backend cannot take these shapes or dtype here
                result[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
                print(f"{name}: {result[name]['error']}", flush=True)
        if args.compile:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            # the blocks: the modules holding an attention the adapter describes
            for block in [m for m in tower.modules()
                          if any(adapter.vision_attention_parts(c) is not None for c in m.children())]:
                block.compile()
            began = time.perf_counter()
            compiled = measure("compiled", tower, requests, args.reps, cuda, graphed, reference)
            compiled.pop("_outputs", None)
            compiled["_first_calls_s"] = time.perf_counter() - began
            result["compiled"] = compiled
    for name, rows in result.items():
        if not isinstance(rows, dict) or "error" in rows:
            continue
        for label, row in rows.items():
            if isinstance(row, dict) and "profile" in row:
                print(f"== {name}, {label}: {row['profile']['count']:.0f} kernels, {row['profile']['total_us'] / 1e3:.3f}"
                      " ms of kernels")
                for r in row["profile"]["kernels"][:args.top]:
                    print(f"  {r['us']:8.1f} us {r['count']:5.0f}x  {r['kind']:12s} {r['kernel'][:90]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_tower_bench.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
