"""`vismmoe-kt calibrate`: record routing traces, train the lookahead predictor, report Hot Recall.

Requests come from the user (`--images DIR_OR_LIST --prompts FILE`) or, for tests and the demo,
from a seeded generator of synthetic images and prompts (`--synthetic N`). Each request is generated
greedily for `--decode_tokens` tokens with the rule file's operators in place (so a compressed
prefill is traced as the runtime will see it), and written as one trace file (vismmoe_kt.predictor.traces).
Requests are split 80/20 into training and validation; the predictor trains with early stopping on
validation Hot Recall@20 and is saved as `predictor.pt` beside the traces. The report gives Hot
Recall@10/20/30 for the predictor, the history-only ablation and a random guess, overall, per phase
and per layer.

`vismmoe-kt calibrate synthetic` (also `python -m vismmoe_kt.apps.calibrate synthetic`) calibrates a
predictor for the synthetic router (vismmoe_kt/routing/synthetic.py) without any model: each request is
a prompt with a block of vision tokens (one prefill step) and `--tokens` decode tokens, routed from
seeds; the predictor's hidden-state feature is the router's latent state (`hidden_source: synthetic`),
what a trained model's hidden state is to its routing. Training requests have seeds (seed + 1) * 10**6
+ i, validation requests (seed + 1) * 10**6 + 900000 + i: none is a request that a serving run's
`--routing synthetic[:S]` (request i from seed S + i) routes. It writes predictor.pt and
calibration.json (Hot Recall of the validation requests' decode and prefill steps, the training log,
the forward time on the CPU).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..predictor.calibration import evaluate
from .flags import add_model_flags, load_from_args

PROMPTS = ("Describe the image.", "What shapes do you see?", "Is there a red circle?", "How many objects are there?",
           "What colour is the largest shape?", "Is the square left of the circle?")


def synthetic_image(seed: int, size: int = 224):
    """Shapes of random kinds, colours and places on a noisy background (seeded)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.normal(128, 30, (size, size, 3)).clip(0, 255).astype("uint8"))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(1, 5))):
        x, y = rng.integers(0, size * 3 // 4, 2)
        w = int(rng.integers(size // 8, size // 3))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = rng.integers(3)
        box = [int(x), int(y), int(x) + w, int(y) + w]
        if kind == 0:
            draw.ellipse(box, fill=colour)
        elif kind == 1:
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(box[0], box[3]), ((box[0] + box[2]) // 2, box[1]), (box[2], box[3])], fill=colour)
    return image


def requests_from_args(images: str | None, prompts: str | None, synthetic: int, seed: int, size: int) -> list[tuple[Any, str]]:
    from .images import load_image

    if synthetic:
        rng = random.Random(seed)
        return [(synthetic_image(seed * 100_003 + i, size), rng.choice(PROMPTS)) for i in range(synthetic)]
    if not images:
        raise InputError("calibrate needs --images DIR_OR_LIST (with --prompts FILE) or --synthetic N")
    path = Path(images)
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp", ".bmp")) \
        if path.is_dir() else [Path(p) for p in images.split(",")]
    if not files:
        raise InputError(f"--images {images}: no image files found")
    lines = PROMPTS
    if prompts:
        try:
            lines = tuple(line.strip() for line in Path(prompts).read_text(encoding="utf-8").splitlines() if line.strip())
        except OSError as exc:
            raise InputError(f"--prompts {prompts}: {exc.strerror or exc}") from None
        if not lines:
            raise InputError(f"--prompts {prompts}: no prompts in the file")
    return [(load_image(f), lines[i % len(lines)]) for i, f in enumerate(files)]


def record_traces(model, processor, requests: list[tuple[Any, str]], out: Path, decode_tokens: int,
                  progress: bool = True) -> list[Path]:
    from tqdm import tqdm

    from ..engine.inputs import ask_inputs
    from ..predictor.traces import TraceRecorder

    out.mkdir(parents=True, exist_ok=True)
    adapter, context = model.vismmoe.adapter, model.vismmoe.context
    recorder = TraceRecorder(model, adapter)
    ours = context.text_model is not None  # the text model's forward is ours: pruning, and h_v for the predictor
    paths = []
    try:
        for i, (image, prompt) in enumerate(tqdm(requests, desc="Tracing requests", unit="request", disable=not progress)):
            inputs = ask_inputs(model, processor, prompt, [image])
            recorder.reset()
            context.pruning.keep = None
            # transformers' loop: every step calls the routers, whose hooks record the trace (the lean
            # step's fused router does not call them)
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
            visual = adapter.image_token_mask(model.config, inputs["input_ids"][0])
            path = out / f"request-{i:06d}.safetensors"
            recorder.finish(path, visual, context.pruning.keep, with_visual=ours)
            paths.append(path)
    finally:
        recorder.remove()
    return paths


def add_request_flags(parser, decode_tokens: int) -> None:
    """Where the requests come from (`requests_from_args`): the user's images and prompts, or synthetic ones."""
    add_model_flags(parser)
    parser.add_argument("--images", help="a directory of images or a comma-separated list of files")
    parser.add_argument("--prompts", help="a text file, one prompt per line (cycled over the images)")
    parser.add_argument("--synthetic", type=int, default=0, metavar="N", help="use N synthetic images and prompts")
    parser.add_argument("--image_size", type=int, default=224, help="size of synthetic images")
    parser.add_argument("--decode_tokens", type=int, default=decode_tokens, help="tokens generated per request")


def add_parser(commands) -> None:
    calibrate = commands.add_parser("calibrate", help="record routing traces and train the lookahead predictor",
                                    description="Record routing traces of a model and train the lookahead predictor; "
                                                "`calibrate synthetic --help`: a predictor for synthetic routing, "
                                                "no model needed.")
    add_request_flags(calibrate, decode_tokens=8)
    calibrate.add_argument("--out", help="directory for traces/, predictor.pt and calibration.json (required)")
    calibrate.add_argument("--window", type=int, default=5, help="lookahead window W (layers)")
    calibrate.add_argument("--gamma", type=float, default=0.8, help="priority decay per layer of distance")
    calibrate.add_argument("--predictor_output", choices=["window", "vector"], default="window",
                           help="window: a (W layers x experts) map of scores | vector: one score per expert (the paper's)")
    calibrate.add_argument("--epochs", type=int, default=80, help="training epochs of the predictor")
    calibrate.add_argument("--seed", type=int, default=0, help="seed of the synthetic images and prompts (with --synthetic N)")
    sources = calibrate.add_subparsers(dest="source", metavar="{synthetic}",
                                       help="synthetic: calibrate for the synthetic router instead (no model)")
    add_synthetic_parser(sources)


def add_synthetic_parser(sources) -> None:
    syn = sources.add_parser(
        "synthetic", help="calibrate for the synthetic router, from seeds (no model)",
        description="Train the lookahead predictor on the synthetic router's routing (vismmoe_kt/routing), "
                    "its latent state as the hidden-state feature (hidden_source: synthetic); no model runs. "
                    "Writes OUT/predictor.pt and OUT/calibration.json.")
    shape = syn.add_argument_group("routing (the serving run's --routing synthetic must match)")
    shape.add_argument("--layers", type=int, default=48, help="MoE layers (Qwen3-VL-30B-A3B: 48)")
    shape.add_argument("--experts", type=int, default=128, help="routed experts per layer (128)")
    shape.add_argument("--top_k", type=int, default=8, help="experts per token (8)")
    shape.add_argument("--corpus_seed", type=int, default=0, help="the synthetic corpus (its expert skew)")
    data = syn.add_argument_group("requests")
    data.add_argument("--requests", type=int, default=SYNTHETIC_DEFAULTS["requests"], help="training requests")
    data.add_argument("--valid_requests", type=int, default=SYNTHETIC_DEFAULTS["valid_requests"],
                      help="validation requests (early stopping, the reported Hot Recall)")
    data.add_argument("--tokens", type=int, default=SYNTHETIC_DEFAULTS["tokens"], help="decode tokens per request")
    data.add_argument("--prompt_tokens", type=int, default=236, help="prompt tokens per request (448 px: 236)")
    data.add_argument("--visual_tokens", type=int, default=200, help="vision tokens in the prompt, after 10 text tokens")
    data.add_argument("--seed", type=int, default=0, help="request seeds: (seed + 1) * 10**6 + i")
    model = syn.add_argument_group("predictor and training")
    model.add_argument("--window", type=int, default=5, help="lookahead window W (layers)")
    model.add_argument("--gamma", type=float, default=0.8, help="priority decay per layer of distance")
    model.add_argument("--recent_decay", type=float, default=SYNTHETIC_DEFAULTS["recent_decay"],
                       help="decay of the recent-usage feature per decode token")
    model.add_argument("--epochs", type=int, default=SYNTHETIC_DEFAULTS["epochs"], help="at most this many epochs")
    model.add_argument("--lr", type=float, default=SYNTHETIC_DEFAULTS["lr"], help="peak learning rate (cosine decay)")
    model.add_argument("--batch", type=int, default=SYNTHETIC_DEFAULTS["batch"], help="rows per training step")
    model.add_argument("--device", default="cpu", help="where to train: cpu, cuda, cuda:1 ...")
    syn.add_argument("--out", required=True, help="directory for predictor.pt and calibration.json")


def run(args) -> int:
    if getattr(args, "source", None) == "synthetic":
        return run_synthetic(args)
    from ..predictor.model import PredictorConfig, train
    from ..predictor.traces import read_trace

    if not args.out:
        raise InputError("calibrate needs --out DIR (for traces/, predictor.pt and calibration.json)")
    out = Path(args.out)
    requests = requests_from_args(args.images, args.prompts, args.synthetic, args.seed, args.image_size)
    if len(requests) < 2:
        raise InputError("calibrate needs at least 2 requests (training and validation)")
    model, processor = load_from_args(args)
    paths = record_traces(model, processor, requests, out / "traces", args.decode_tokens)
    by_request = [read_trace(p) for p in paths]
    split = max(1, int(0.8 * len(by_request)))
    train_steps = [s for r in by_request[:split] for s in r]
    valid_steps = [s for r in by_request[split:] for s in r] or train_steps
    first = train_steps[0]
    layers, experts = first["active"].shape
    config = PredictorConfig(num_layers=layers, num_experts=experts, hidden_size=first["hidden"].shape[1],
                             visual_size=first["visual"].shape[0], window=args.window, gamma=args.gamma,
                             output=args.predictor_output)
    from ..predictor.model import samples_from_steps

    train_data, valid_data = samples_from_steps(train_steps, config), samples_from_steps(valid_steps, config)
    budget = min(20, experts)
    predictor, log = train(config, train_data, valid_data, epochs=args.epochs, budget=budget)
    history_only, _ = train(PredictorConfig(**{**config.__dict__, "use_features": False}), train_data, valid_data,
                            epochs=args.epochs, budget=budget)
    predictor.save(out / "predictor.pt")
    report = {"requests": len(by_request), "train_requests": split, "epochs_run": len(log),
              "predictor": evaluate(predictor, valid_steps, config), "history_only": evaluate(history_only, valid_steps, config),
              "random": evaluate(None, valid_steps, config)}
    (out / "calibration.json").write_text(json.dumps(report, indent=2))
    print(f"traces: {len(paths)} requests in {out / 'traces'}; predictor: {out / 'predictor.pt'}")
    print("Hot Recall (validation requests)   " + "   ".join(f"{p:>22}" for p in ("all", "prefill", "decode")))
    for name in ("predictor", "history_only", "random"):
        cells = ["/".join(f"{100 * v:.1f}" for v in report[name].get(p, {}).values()) or "-" for p in ("all", "prefill", "decode")]
        print(f"  {name:<14} @10/@20/@30 %     " + "   ".join(f"{c:>22}" for c in cells))
    per_layer = report["predictor"]["per_layer@20"]
    print("  predictor @20 per layer: " + ", ".join(f"{l}:{100 * v:.0f}%" for l, v in per_layer.items()))
    return 0


# the full-size calibration's settings (BENCHMARKS.md, predictor section)
SYNTHETIC_DEFAULTS = {"requests": 400, "valid_requests": 24, "tokens": 48, "recent_decay": 0.95, "epochs": 3,
                      "lr": 3e-3, "batch": 1024}
# the predictor's size for synthetic routing: a latent of D = 32 needs no wider per-layer map than r = 32
SYNTHETIC_ARCHITECTURE = {"width": 256, "layer_heads": 32, "history_dim": 64}
VALID_SEEDS = 900_000  # validation requests' seeds start here (within each --seed's block of 10**6)


def synthetic_seeds(seed: int, requests: int, valid_requests: int) -> tuple[range, range]:
    """(training, validation) request seeds of `calibrate synthetic --seed seed`: block seed + 1 of 10**6
    seeds, clear of the small seeds serving runs route (`--routing synthetic:S`, request i: S + i)."""
    base = (seed + 1) * 10**6
    return range(base, base + requests), range(base + VALID_SEEDS, base + VALID_SEEDS + valid_requests)


def synthetic_request(seed: int, layers: int = 48, experts: int = 128, top_k: int = 8, prompt_tokens: int = 236,
                      visual_tokens: int = 200, tokens: int = 48, corpus_seed: int = 0) -> list[dict]:
    """One synthetic request as predictor steps: the prompt's prefill (10 text tokens, then
    `visual_tokens` vision tokens, then text) and `tokens` decode tokens. Each step's hidden feature is
    the router's latent state per layer, the mean over the step's tokens (what the serving routing source
    gives a `hidden_source: synthetic` predictor); the visual summary is a zero (the source has none)."""
    from ..routing.synthetic import SyntheticRouter

    router = SyntheticRouter(layers, experts, top_k, seed=seed, corpus_seed=corpus_seed)
    steps = []
    if prompt_tokens:
        modality = torch.zeros(prompt_tokens, dtype=torch.bool)
        modality[10:10 + visual_tokens] = True
        prompt = router.route(prompt_tokens, modality, "prefill")
        active = torch.zeros(prompt_tokens, layers, experts, dtype=torch.bool).scatter_(2, prompt.ids, True).any(0)
        steps.append({"active": active, "hidden": prompt.hidden.mean(0).float(), "visual": torch.zeros(1),
                      "phase": "prefill", "new_request": True})
    routing = router.route(tokens, None, "decode")
    active = torch.zeros(tokens, layers, experts, dtype=torch.bool).scatter_(2, routing.ids, True)
    hidden = routing.hidden.float()
    for t in range(tokens):
        steps.append({"active": active[t], "hidden": hidden[t], "visual": torch.zeros(1), "phase": "decode",
                      "new_request": t == 0 and not prompt_tokens})
    return steps


def synthetic_config(layers: int, experts: int, window: int = 5, gamma: float = 0.8,
                     recent_decay: float = SYNTHETIC_DEFAULTS["recent_decay"], dim: int = 32, **options: Any):
    """The predictor's config for synthetic routing: the latent (dim D) as its hidden state, no visual summary
    (visual_size 1, fed zeros), `SYNTHETIC_ARCHITECTURE` unless `options` say otherwise."""
    from ..predictor.model import PredictorConfig

    return PredictorConfig(num_layers=layers, num_experts=experts, hidden_size=dim, visual_size=1, window=window,
                           gamma=gamma, recent_decay=recent_decay, hidden_source="synthetic",
                           **{**SYNTHETIC_ARCHITECTURE, **options})


def check_synthetic_args(args) -> None:
    for name in ("layers", "experts", "top_k", "requests", "valid_requests", "tokens", "window", "epochs", "batch"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.layers < 2:
        raise InputError("--layers must be at least 2: the predictor looks from one MoE layer to the next")
    if args.top_k > args.experts:
        raise InputError(f"--top_k ({args.top_k}) cannot exceed --experts ({args.experts})")
    if args.visual_tokens < 0 or (args.visual_tokens and 10 + args.visual_tokens > args.prompt_tokens):
        raise InputError(f"--visual_tokens ({args.visual_tokens}) must fit in --prompt_tokens ({args.prompt_tokens}) "
                         "after its 10 leading text tokens")
    if args.prompt_tokens < 0 or args.seed < 0 or args.corpus_seed < 0:
        raise InputError("--prompt_tokens, --seed and --corpus_seed must not be negative")
    if not 0 <= args.recent_decay < 1:
        raise InputError(f"--recent_decay must be in [0, 1), got {args.recent_decay}")
    if not 0 < args.gamma <= 1:
        raise InputError(f"--gamma must be in (0, 1], got {args.gamma}")
    if args.lr <= 0:
        raise InputError(f"--lr must be positive, got {args.lr}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise InputError(f"--device {args.device!r} is not a device (cpu, cuda, cuda:1 ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {args.device}: CUDA is not available here")


def run_synthetic(args) -> int:
    from tqdm import tqdm

    from ..predictor.calibration import calibrate_requests, samples_from_requests

    check_synthetic_args(args)
    out = Path(args.out)
    config = synthetic_config(args.layers, args.experts, args.window, args.gamma, args.recent_decay)
    shape = dict(layers=args.layers, experts=args.experts, top_k=args.top_k, prompt_tokens=args.prompt_tokens,
                 visual_tokens=args.visual_tokens, tokens=args.tokens, corpus_seed=args.corpus_seed)

    def rows(seeds: range, what: str):
        bar = tqdm(total=len(seeds), desc=f"Routing {what} requests", unit="request")
        try:
            return samples_from_requests((synthetic_request(s, **shape) for s in seeds), config,
                                         progress=lambda done: bar.update(1))
        finally:
            bar.close()

    train_seeds, valid_seeds = synthetic_seeds(args.seed, args.requests, args.valid_requests)
    train_data = rows(train_seeds, "training")
    valid_data = rows(valid_seeds, "validation")
    print(f"training on {len(train_data.layer)} rows ({args.requests} requests x {args.tokens + (args.prompt_tokens > 0)} "
          f"steps x {args.layers - 1} layers) on {args.device}", flush=True)
    predictor, report = calibrate_requests(config, train_data, valid_data, epochs=args.epochs, lr=args.lr,
                                           batch=args.batch, device=args.device,
                                           progress=lambda line: print(line, flush=True))
    out.mkdir(parents=True, exist_ok=True)
    predictor.save(out / "predictor.pt")
    report = {"routing": {**shape, "seed": args.seed}, "requests": args.requests, "valid_requests": args.valid_requests,
              "config": dict(vars(config)), **report}
    (out / "calibration.json").write_text(json.dumps(report, indent=2))
    decode, prefill = report["predictor"].get("decode", {}), report["predictor"].get("prefill", {})
    guess = report["random"].get("decode", {})
    print(f"predictor: {out / 'predictor.pt'} ({(out / 'predictor.pt').stat().st_size / 2**20:.1f} MiB), "
          f"report: {out / 'calibration.json'}")
    print("Hot Recall, validation requests   decode @10/@20/@30 %      prefill @10/@20/@30 %")
    for name, cells in (("predictor", (decode, prefill)), ("random guess", (guess, report["random"].get("prefill", {})))):
        print(f"  {name:<31}" + "".join(f"{'/'.join(f'{100 * v:.1f}' for v in c.values()) or '-':<26}" for c in cells))
    print(f"forward, batch 1, CPU: {report['forward_ms_cpu_batch1']:.3f} ms; training {report['train_seconds']:.0f} s, "
          f"{report['epochs_run']} epochs")
    return 0


if __name__ == "__main__":
    import sys

    from .cli import main

    sys.exit(main(["calibrate", *sys.argv[1:]]))
