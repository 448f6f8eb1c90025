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

    from ..operators.vis_decoder import VisDecoder
    from ..predictor.traces import TraceRecorder

    out.mkdir(parents=True, exist_ok=True)
    recorder = TraceRecorder(model, model.vismmoe.adapter)
    decoder = next((m for m in model.modules() if isinstance(m, VisDecoder)), None)
    device = model.get_input_embeddings().weight.device
    paths = []
    try:
        for i, (image, prompt) in enumerate(tqdm(requests, desc="Tracing requests", unit="request", disable=not progress)):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = processor(text=[text], images=[image], return_tensors="pt").to(device)
            recorder.reset()
            if decoder is not None:
                decoder.last_keep = None
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
            visual = inputs["input_ids"][0] == model.config.image_token_id
            path = out / f"request-{i:06d}.safetensors"
            recorder.finish(path, visual, decoder.last_keep if decoder is not None else None, with_visual=decoder is not None)
            paths.append(path)
    finally:
        recorder.remove()
    return paths


def evaluate(model, steps: list[dict], config, budgets=(10, 20, 30)) -> dict[str, Any]:
    """Hot Recall@B for the model (None: random guess), overall, per phase and per layer."""
    from ..predictor.model import hot_recall, samples_from_steps

    report: dict[str, Any] = {}
    for phase in ("all", "prefill", "decode"):
        chosen = [s for s in steps if phase == "all" or s["phase"] == phase]
        if not chosen:
            continue
        data = samples_from_steps(chosen, config)
        report[phase] = {f"@{b}": round(hot_recall(model, data, min(b, config.num_experts)), 4) for b in budgets}
    data = samples_from_steps(steps, config)
    per_layer = {}
    for layer in sorted(set(data.layer.tolist())):
        mask = data.layer == layer
        subset = type(data)(*(getattr(data, f)[mask] for f in ("layer", "past", "hidden", "visual", "target", "nxt")))
        per_layer[layer] = round(hot_recall(model, subset, min(20, config.num_experts)), 4)
    report["per_layer@20"] = per_layer
    return report


def run(args) -> int:
    from .cli import load_from_args
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
