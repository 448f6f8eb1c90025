"""`vismmoe-kt calibrate`: record routing traces, train the lookahead predictor, report Hot Recall.

Requests come from the user (`--images DIR_OR_LIST --prompts FILE`) or, for tests and the demo,
from a seeded generator of synthetic images and prompts (`--synthetic N`). Each request is generated
greedily for `--decode_tokens` tokens with the rule file's operators in place (so a compressed
prefill is traced as the runtime will see it), and written as one trace file (vismmoe_kt.predictor.traces).
Requests are split 80/20 into training and validation; the predictor trains with early stopping on
validation Hot Recall@20 and is saved as `predictor.pt` beside the traces. The report gives Hot
Recall@10/20/30 for the predictor, the history-only ablation and a random guess, overall, per phase
and per layer.
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
    calibrate = commands.add_parser("calibrate", help="record routing traces and train the lookahead predictor")
    add_request_flags(calibrate, decode_tokens=8)
    calibrate.add_argument("--out", required=True, help="directory for traces/, predictor.pt and calibration.json")
    calibrate.add_argument("--window", type=int, default=5, help="lookahead window W (layers)")
    calibrate.add_argument("--gamma", type=float, default=0.8, help="priority decay per layer of distance")
    calibrate.add_argument("--predictor_output", choices=["window", "vector"], default="window")
    calibrate.add_argument("--epochs", type=int, default=80)
    calibrate.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from ..predictor.model import PredictorConfig, train
    from ..predictor.traces import read_trace

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
