"""Where a prompt's time goes: the host's issue against the GPU's work, stage by stage, and the host's Python.

    PYTHONPATH=. python3 -m benchmarks.prompt_timeline --config NAME[:key=value,...] --out DIR
        [--image-size 448] [--text-tokens 508] [--rounds 3] [--split] [--profile] [--decode-tokens N]

One model load; each prompt (a picture's and/or a text one) is generated to its first token `--rounds` times
after a warm run, with hooks on the vision tower and on every decoder layer. Each hook notes the host's clock
and records a CUDA event, so every stage has two times: when the host finished issuing it and when the GPU
finished running it (ms from the start of the prompt's forward). Where the GPU finishes a layer right after the host issued
it, the GPU was waiting for the host (the prompt is bound by the host's launches); where the GPU finishes long
after, the host ran ahead and the GPU bounds it. The hooks cost a few microseconds a layer. Where the prompt copies
experts (an offloaded configuration), each run also logs the link (benchmarks/bench/link_log.py): every batch of
copies, when the host issued it and when the copy stream ran it, and so how long the link sat idle between the
first copy and the last, because the host had not issued the next batch yet or the batch waited for the compute
still reading its slabs.

`--split`: one more round of prompts with the host's time split by part, each part's forward (or function) timed
on the host's clock, its callees included: a decoder layer, its attention, norms, feed-forward, router and experts
(the family adapter's accessors), and the functions of SPLIT_FUNCTIONS; in ms a prompt and a layer. A timer costs
about a microsecond, so the split stays close to the plain run, where cProfile slows Python down unevenly.
`--profile`: one more prompt under cProfile (the host's Python by function: own time, and time with callees),
what to shorten where the host bounds the prompt. Synthetic routing unless `--routing` says otherwise.
"""

from __future__ import annotations

import cProfile
import importlib
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench.link_log import LinkLog, link_summary
from benchmarks.bench.prompt_setup import add_prompt_flags, check_prompt_flags, load_prompt_model, prompt_requests
from benchmarks.bench.timing import timed_generate, warm_up
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.models import adapter_for


class StageClock:
    """Forward hooks noting, at each watched module's start and end, the host's time and a CUDA event, from the
    start of the prompt's forward: the first of `origins` to start (the model's forward; where the runner builds a
    picture prompt's text model inputs itself, the vision tower or the token embedding), or of a call `watch_call`
    names (the expert runtime's `begin_prompt`, which the runner calls just before the forward and which may
    start the prompt's copies). That is the prompt's own time, without what the caller does before it, such as
    the synthetic routing's table made before timed_generate's clock, or the runner reading the prompt's ids on
    the host."""

    def __init__(self, origins: list[torch.nn.Module], modules: dict[str, torch.nn.Module], cuda: bool):
        self.cuda = cuda
        self.marks: list[tuple[str, str, float, object]] = []  # (stage, "start" | "end", host s, event)
        self.armed = False
        self.origin: tuple[float, object] | None = None
        self.last_origin: tuple[float, object] | None = None  # the stopped prompt's, for the link's batches
        # the origins' hooks go first: a module that is both an origin and a stage starts the clock, then its stage
        self.handles = [origin.register_forward_pre_hook(self._begin) for origin in origins]
        self._wrapped: list[tuple[object, str]] = []
        for name, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._hook(name, "start")))
            self.handles.append(module.register_forward_hook(self._hook(name, "end")))

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self, *_):
        if self.armed and self.origin is None:  # the prompt's forward (decode steps run the layers, not it)
            self.origin = (time.perf_counter(), self._event())

    def _hook(self, name: str, edge: str):
        def hook(*_):
            if self.origin is not None:
                self.marks.append((name, edge, time.perf_counter(), self._event()))
        return hook

    def start(self) -> None:
        self.marks, self.armed, self.origin = [], True, None

    def stop(self) -> list[dict]:
        """Each mark as {stage, edge, host_ms, gpu_ms} from the prompt's forward's start (gpu_ms None without CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        self.armed = False
        if self.origin is None:
            raise RuntimeError("the prompt's forward never ran: no prompt was timed")
        host0, event0 = self.last_origin = self.origin
        self.origin = None
        return [{"stage": name, "edge": edge, "host_ms": (host - host0) * 1e3,
                 "gpu_ms": event0.elapsed_time(event) if event is not None else None}
                for name, edge, host, event in self.marks]

    def watch_call(self, owner: object, name: str) -> None:
        """`owner.name(...)` starts the clock too (an instance attribute in front of the method; `remove` drops it)."""
        call = getattr(owner, name)

        def begin_then_call(*args, **kwargs):
            self._begin()
            return call(*args, **kwargs)
        setattr(owner, name, begin_then_call)
        self._wrapped.append((owner, name))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for owner, name in self._wrapped:
            delattr(owner, name)
        self._wrapped = []


# functions timed by --split ("module:name", looked up where its callers find it; "module:Class.method" for a method)
SPLIT_FUNCTIONS = ("vismmoe_kt.runtime.executors.placement:block_experts",
                   "vismmoe_kt.runtime.kernels.quantized_major:experts_quantized_major",
                   "vismmoe_kt.runtime.kernels.quantized_major:block_plan",
                   "vismmoe_kt.runtime.table_experts:combine",
                   "vismmoe_kt.engine.prompt_attention:grouped_decode_attention",
                   # a streamed prompt's offloaded layer: its start on the streamed slabs, the next layer's copies
                   "vismmoe_kt.runtime.executors.placement:PlacementExecutor._begin_streamed",
                   "vismmoe_kt.runtime.executors.placement:experts_from_slabs",
                   "vismmoe_kt.runtime.residency:Residency.upload_rows",
                   "vismmoe_kt.runtime.transfers:Transfers.stream_layer",
                   "vismmoe_kt.runtime.transfers:Transfers._copy_batch",
                   "vismmoe_kt.runtime.slab_cache:SlabCache.assign_many")
# the decoder layer's parts by the adapter's accessor
LAYER_PARTS = ("attention", "input_norm", "post_attention_norm", "feed_forward", "router", "experts")


class HostSplit:
    """Each watched callable replaced by a timed one: host seconds and calls by part, callees included, counted
    only within a decoder layer's call (the `LAYER` part): the decode steps after the prompt reach the same
    experts and functions from the decode engine, not through the layers."""

    LAYER = "layer"

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []
        self._inside = 0

    def _timed(self, name: str, call):
        layer = name == self.LAYER

        def timed(*args, **kwargs):
            if not (layer or self._inside):
                return call(*args, **kwargs)
            self._inside += layer
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
                self._inside -= layer
        return timed

    def watch_forward(self, name: str, module: torch.nn.Module) -> None:
        """The module's forward (its own, or one an operator put on the instance) timed under `name`."""
        had = "forward" in vars(module)
        previous = module.forward
        module.forward = self._timed(name, previous)
        self._undo.append(lambda: setattr(module, "forward", previous) if had else delattr(module, "forward"))

    def watch_function(self, spec: str) -> None:
        """"module:function", or "module:Class.method" (timed for every instance, under "Class.method")."""
        module_name, _, path = spec.partition(":")
        owner = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        previous = vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, self._timed(path, previous))
        self._undo.append(lambda: setattr(owner, attr, previous))

    def reset(self) -> None:
        self.seconds, self.calls = {}, {}

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def watch_layers(split: HostSplit, adapter, layers) -> None:
    """Every decoder layer's forward and its parts' (LAYER_PARTS, where the family has them)."""
    for layer in layers:
        split.watch_forward(HostSplit.LAYER, layer)
        for part in LAYER_PARTS:
            module = getattr(adapter, part)(layer)
            if module is not None:
                split.watch_forward(part, module)


def split_table(split: HostSplit, prompts: int, layers: int) -> dict[str, dict[str, float]]:
    """{part: {ms a prompt, ms a layer, calls a prompt}}."""
    return {name: {"ms_per_prompt": seconds * 1e3 / prompts, "ms_per_layer": seconds * 1e3 / prompts / layers,
                   "calls_per_prompt": split.calls[name] / prompts}
            for name, seconds in sorted(split.seconds.items(), key=lambda item: -item[1])}


def summarize(marks: list[dict], prefill_ms: float) -> dict:
    """One run's marks in a few numbers: when the first layer started (host, GPU), the layers' span, each
    layer's host issue and GPU time (medians), and how many layers the GPU finished within 50 us of the host's
    issuing them (the GPU waited for the host there)."""
    ends = [m for m in marks if m["edge"] == "end" and m["stage"].startswith("layer")]
    starts = [m for m in marks if m["edge"] == "start" and m["stage"].startswith("layer")]
    out = {"prefill_ms": prefill_ms, "layers": len(ends)}
    vision = [m for m in marks if m["stage"] == "vision"]
    if vision:
        out["vision_host_ms"] = [m["host_ms"] for m in vision]
        out["vision_gpu_ms"] = [m["gpu_ms"] for m in vision]
    if not ends:
        return out
    out["first_layer_start_host_ms"] = starts[0]["host_ms"]
    out["first_layer_start_gpu_ms"] = starts[0]["gpu_ms"]
    out["last_layer_end_host_ms"] = ends[-1]["host_ms"]
    out["last_layer_end_gpu_ms"] = ends[-1]["gpu_ms"]
    out["layer_host_ms_median"] = statistics.median(e["host_ms"] - s["host_ms"] for s, e in zip(starts, ends))
    if ends[0]["gpu_ms"] is not None:
        out["layer_gpu_ms_median"] = statistics.median(e["gpu_ms"] - s["gpu_ms"] for s, e in zip(starts, ends))
        out["layers_gpu_waiting_for_host"] = sum(e["gpu_ms"] - e["host_ms"] < 0.05 for e in ends)
        out["gpu_behind_host_ms_at_last_layer"] = ends[-1]["gpu_ms"] - ends[-1]["host_ms"]
    return out


def link_line(link: dict) -> str:
    """The link's part of a run's line ("" where the prompt copied nothing)."""
    if not link.get("batches"):
        return ""
    return (f"; link: {link['copies']} copies in {link['batches']} batches, {link['first_copy_ms']:.1f}-"
            f"{link['last_copy_end_ms']:.1f} ms, busy {link['busy_ms']:.1f}, idle {link['idle_ms']:.1f} (host late "
            f"{link['idle_host_ms']:.1f}, waiting on compute {link['idle_waiting_ms']:.1f})")


def profile_prompt(model, request: dict, top: int) -> str:
    """One prompt to its first token under cProfile: the top functions by own time and by time with callees."""
    profiler = cProfile.Profile()
    profiler.enable()
    timed_generate(model, request, 1)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    add_prompt_flags(parser)
    parser.add_argument("--out", required=True, help="directory for prompt_timeline.json (and profile.txt)")
    parser.add_argument("--rounds", type=int, default=3, help="timed prompts of each kind (default 3)")
    parser.add_argument("--split", action="store_true",
                        help="one more round of each prompt with the host's time split by part (decoder layer parts, "
                             "SPLIT_FUNCTIONS)")
    parser.add_argument("--profile", action="store_true", help="one more prompt of each kind under cProfile")
    parser.add_argument("--top", type=int, default=30, help="functions listed by --profile in each order (30)")
    parser.add_argument("--decode-tokens", type=int, default=0,
                        help="before each timed (and the profiled) prompt, an untimed request decoding this many "
                             "tokens: the prompt then starts from the cache a decode left, as decode_bench's reps do, "
                             "after warm-ups of that length (default 0: prompts back to back; the split's prompts "
                             "stay back to back)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    if args.decode_tokens < 0:
        parser.error(f"--decode-tokens {args.decode_tokens}: a count of tokens, 0 or more")
    check_prompt_flags(parser, args)
    cuda = args.device.startswith("cuda")
    model, processor = load_prompt_model(parser, args, "prompt-timeline-")
    adapter = adapter_for(model.config.model_type)
    layers = adapter.decoder_layers(model)
    modules = {f"layer {i}": layer for i, layer in enumerate(layers)}
    if args.image_size:
        modules["vision"] = adapter.vision_tower(model)
    requests = prompt_requests(processor, args)
    clock = StageClock([model, model.get_input_embeddings(), *([modules["vision"]] if "vision" in modules else [])],
                       modules, cuda)
    context = getattr(getattr(model, "vismmoe", None), "context", None)
    runtime = getattr(context, "offload_runtime", None)
    if runtime is not None:  # a prompt's copies may begin there, before the forward
        clock.watch_call(runtime, "begin_prompt")
    link = LinkLog(getattr(runtime, "transfers", None))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0) if cuda else args.device, "config": args.config,
              "routing": args.routing, "prompts": {}}
    profiles = []
    for label, request in requests.items():
        if args.decode_tokens:  # warm at the decodes' length, until they capture nothing (as decode_bench's reps)
            warm_up(model, request, args.decode_tokens)
        else:
            timed_generate(model, request, 1)  # warm: compiled, captured
        summaries = []
        for _ in range(args.rounds):
            if args.decode_tokens:
                timed_generate(model, request, args.decode_tokens)
            clock.start()
            link.start()
            prefill_s = timed_generate(model, request, 1).prefill_s
            marks = clock.stop()
            batches = link.stop(clock.last_origin)
            summaries.append({**summarize(marks, prefill_s * 1e3), "link": link_summary(batches)})
        # every run's summary, and the last run's marks stage by stage and its copy batches
        result["prompts"][label] = {"runs": summaries, "last_marks": marks, "last_link": batches}
        for s in summaries:
            print(f"{label}: prefill {s['prefill_ms']:.1f} ms; first layer issued at {s.get('first_layer_start_host_ms', 0):.1f}"
                  f" (GPU {s.get('first_layer_start_gpu_ms') or 0:.1f}); last layer issued at "
                  f"{s.get('last_layer_end_host_ms', 0):.1f} (GPU done {s.get('last_layer_end_gpu_ms') or 0:.1f}); a layer "
                  f"host {s.get('layer_host_ms_median', 0):.3f} ms, GPU {s.get('layer_gpu_ms_median', 0):.3f} ms; GPU "
                  f"waiting for the host at {s.get('layers_gpu_waiting_for_host', '-')} of {s['layers']} layers; "
                  f"vision host {s.get('vision_host_ms')}, GPU {s.get('vision_gpu_ms')}{link_line(s['link'])}", flush=True)
        if args.split:
            split = HostSplit()
            watch_layers(split, adapter, layers)
            for spec in SPLIT_FUNCTIONS:
                split.watch_function(spec)
            try:
                timed_generate(model, request, 1)  # the timers' first calls
                split.reset()
                prefill = [timed_generate(model, request, 1).prefill_s for _ in range(args.rounds)]
                table = split_table(split, args.rounds, len(layers))
            finally:
                split.remove()
            result["prompts"][label]["split"] = {"prefill_ms": [p * 1e3 for p in prefill], "parts": table}
            print(f"{label}, host time by part (prefill {statistics.median(prefill) * 1e3:.1f} ms with the timers):")
            for name, row in table.items():
                print(f"  {name:28s} {row['ms_per_prompt']:7.2f} ms a prompt {row['ms_per_layer'] * 1e3:7.1f} us a layer"
                      f" {row['calls_per_prompt']:6.0f} calls", flush=True)
        if args.profile:
            if args.decode_tokens:
                timed_generate(model, request, args.decode_tokens)
            profiles.append(f"== {label}\n" + profile_prompt(model, request, args.top))
    clock.remove()
    link.remove()
    (out_dir / "prompt_timeline.json").write_text(json.dumps(result, indent=1))
    if profiles:
        (out_dir / "profile.txt").write_text("\n".join(profiles))
        print("\n".join(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
