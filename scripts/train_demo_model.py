"""Train the `--demo` model: a small Qwen3-VL-MoE, from scratch, on the synthetic VQA task (CPU or GPU).

    nice -n 10 python scripts/train_demo_model.py --out vismmoe_kt/demo/weights [--steps 2200] [--threads 1]
    # continue from a checkpoint: --init OLD/model.safetensors --first_scene N [--extra_exist 3 --describe_share 0.1]

The model is transformers' Qwen3VLMoeForConditionalGeneration with the demo spec of
`vismmoe_kt.demo.tiny` (4 text layers x 32 experts, top-4, hidden 96, a 2-block vision tower of width
64: about 2.9 M parameters, 2.4 M of them experts, 11.8 MB in fp32). The size was set by the machine it was first trained on, one
shared CPU core (0.85-1.5 s a step of 16): 1750 steps, 37 min, in two stages. A third stage continued those
weights on one GPU (`--device cuda --workers 12`, batch 64, 2115 steps in 7.5 min) until the model answered
held-out existence questions (BENCHMARKS.md); the shipped weights are that stage's.
The loss is next-token cross-entropy on the answer tokens only, plus the
router's auxiliary load-balancing loss exactly as the architecture computes it (`output_router_logits`,
weighted by `router_aux_loss_coef`).

Each training sequence is one scene (split seed 0) with one question of every type the scene allows, plus
a second existence question, as the turns of one conversation in random order (the vision tower runs once
for several supervised answers); a quarter of the sequences are instead the scene's caption for
"Describe the image." (a first run without captions stayed at the answer prior for 500 steps: captions
give the vision path a dense signal). Held-out accuracy (split seed 1) is measured teacher-forced: an answer is
right when every one of its tokens is the argmax, which is exactly when greedy decoding produces it.

Writes OUT/model.safetensors and OUT/training.json (command, time, loss curve, held-out accuracy) and,
with --plot, a PNG of the loss curve.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


from vismmoe_kt.demo.vqa import (DESCRIBE_PROMPT, QUESTION_TYPES, SPLIT_SEEDS, describe, exist_question,
                                 make_example, make_scene, questions_for_scene)
from vismmoe_kt.apps.plots import line_png
from vismmoe_kt.demo.tiny import DEMO_SPEC, build_tiny_model
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.demo.training import Labeller, adamw, caption_conversation, qa_conversation, train_step, warmup_cosine
from vismmoe_kt.demo.training import heldout_accuracy as shared_heldout_accuracy


def conversation(seed: int, index: int, describe_share: float = 0.25, extra_exist: int = 1):
    """A scene and its questions as one multi-turn chat, or (a `describe_share` of them) its caption; (image, messages).

    Captions are a dense signal (every word comes from the image) that gets the vision path learning early;
    they are never in the same chat as questions, so no answer can be read off a caption in the context.
    """
    rng, shapes, image = make_scene(seed, index)
    if rng.random() < describe_share:
        return caption_conversation(image, DESCRIBE_PROMPT, describe(shapes))
    questions = questions_for_scene(shapes, rng) + [exist_question(shapes, rng) for _ in range(extra_exist)]
    unique = list({q.text: q for q in questions}.values())
    return qa_conversation(image, unique, rng.permutation(len(unique)))


class Batches(Labeller, torch.utils.data.IterableDataset):
    """Endless labelled batches of training conversations (made in a DataLoader worker, beside the training)."""

    def __init__(self, processor, batch_size: int, seed: int, first_scene: int = 0, describe_share: float = 0.25,
                 extra_exist: int = 1):
        Labeller.__init__(self, processor)
        self.batch_size, self.seed = batch_size, seed
        self.describe_share, self.extra_exist = describe_share, extra_exist
        self.next_index = first_scene

    def __iter__(self):
        while True:
            pairs = [conversation(self.seed, self.next_index + i, self.describe_share, self.extra_exist)
                     for i in range(self.batch_size)]
            self.next_index += self.batch_size
            yield self.labelled([p[0] for p in pairs], [p[1] for p in pairs])


def _offset_worker_scenes(worker: int) -> None:
    """DataLoader workers each hold a copy of the dataset: worker w takes scenes w * 10^7 onwards."""
    info = torch.utils.data.get_worker_info()
    info.dataset.next_index += worker * 10_000_000


def heldout_accuracy(model, batches: Batches, per_type: int, seed: int, device=None) -> dict[str, float]:
    """Teacher-forced exact match of single-question examples (the eval format), per question type."""
    return shared_heldout_accuracy(model, batches, make_example, QUESTION_TYPES, per_type, seed, device)


def main():
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for model.safetensors and training.json")
    parser.add_argument("--steps", type=int, default=2200, help="training steps")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW; cosine decay to a tenth)")
    parser.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (data is made in one more process)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and torch's RNG")
    parser.add_argument("--eval_every", type=int, default=250, help="steps between held-out evaluations (each saves a checkpoint)")
    parser.add_argument("--eval_per_type", type=int, default=64, help="held-out questions per question type in an evaluation")
    parser.add_argument("--plot", help="write the loss curve to this PNG")
    parser.add_argument("--init", help="start from these weights (a model.safetensors of an earlier run) instead of random")
    parser.add_argument("--first_scene", type=int, default=0, help="index of the first training scene (continue past a run)")
    parser.add_argument("--describe_share", type=float, default=0.25, help="share of sequences that are captions")
    parser.add_argument("--extra_exist", type=int, default=1, help="existence questions per chat beyond one of each type")
    parser.add_argument("--device", default="cpu", help="where the model trains (cuda: minutes instead of the CPU's hour)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes making batches (pictures and chat templates); a GPU step needs several to stay fed")
    parser.add_argument("--minutes", type=float, default=None,
                        help="stop (evaluate and save) after this many minutes, whatever --steps says")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, processor = build_tiny_model(DEMO_SPEC, args.seed)
    if args.init:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(args.init))
    device = torch.device(args.device)
    model.to(device).train()
    batches = Batches(processor, args.batch, SPLIT_SEEDS["train"], args.first_scene, args.describe_share, args.extra_exist)
    optimizer = adamw(model, args.lr)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine to a tenth over --steps or --minutes, which ends first
        progress = None if args.minutes is None else (time.perf_counter() - start) / (60 * args.minutes)
        return warmup_cosine(step, args.lr, args.warmup, args.steps, progress)

    curve, evals = [], []
    # each worker makes its own scenes (worker_init_fn offsets its first index), so no two batches repeat
    stream = iter(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=args.workers, prefetch_factor=4,
                                              worker_init_fn=_offset_worker_scenes))
    start = time.perf_counter()
    for step in range(args.steps):
        if args.minutes is not None and time.perf_counter() - start > 60 * args.minutes:
            print(f"stopping at step {step}: --minutes {args.minutes} reached", flush=True)
            accuracy = heldout_accuracy(model, batches, args.eval_per_type, SPLIT_SEEDS["val"], device)
            evals.append({"step": step, **accuracy})
            print(f"  held-out (seed {SPLIT_SEEDS['val']}) accuracy: {accuracy}", flush=True)
            break
        inputs, labels = next(stream)
        inputs, labels = inputs.to(device), labels.to(device)
        loss, aux = train_step(model, optimizer, inputs, labels, lr_at(step))
        curve.append({"step": step + 1, "loss": loss, "aux_loss": aux,
                      "seconds": round(time.perf_counter() - start, 1)})
        if (step + 1) % 20 == 0:
            recent = np.mean([c["loss"] for c in curve[-20:]])
            print(f"step {step + 1}/{args.steps}  loss {recent:.4f}  aux {aux:.3f}  lr {lr_at(step):.2e}  "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            accuracy = heldout_accuracy(model, batches, args.eval_per_type, SPLIT_SEEDS["val"], device)
            evals.append({"step": step + 1, **accuracy})
            print(f"  held-out (seed {SPLIT_SEEDS['val']}) accuracy: {accuracy}", flush=True)
            model.save_pretrained(str(out))  # a checkpoint at every evaluation: a stopped run still leaves weights
    seconds = time.perf_counter() - start

    model.to("cpu").save_pretrained(str(out))
    (out / "config.json").unlink(missing_ok=True)  # the demo directory's config comes from tiny_models
    (out / "generation_config.json").unlink(missing_ok=True)
    record = {"command": "python " + " ".join(sys.argv), "spec": DEMO_SPEC, "init": args.init,
              "first_scene": args.first_scene, "describe_share": args.describe_share, "extra_exist": args.extra_exist, "steps": args.steps, "batch": args.batch,
              "threads": args.threads, "device": args.device, "workers": args.workers, "seconds": round(seconds, 1), "final_loss": float(np.mean([c["loss"] for c in curve[-50:]])),
              "heldout": evals, "curve": curve[::5] + ([curve[-1]] if len(curve) % 5 != 1 else [])}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        steps = [c["step"] for c in curve]
        smooth = np.convolve([c["loss"] for c in curve], np.ones(10) / 10, mode="valid")
        line_png({"loss (10-step mean)": (steps[9:], smooth)}, args.plot,
                 f"demo model training: {DEMO_SPEC}, batch {args.batch}, {seconds / 60:.0f} min on {args.threads} CPU thread(s)",
                 x_label="step", y_label="loss", log_y=True)
    print(f"trained in {seconds:.0f}s; final loss {record['final_loss']:.4f}; wrote {out}")


if __name__ == "__main__":
    main()
