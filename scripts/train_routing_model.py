"""Train the routing-study model: Qwen3-VL-MoE's architecture at 12 layers x 64 experts (top-8, hidden 512), from
scratch, on the scenes task (vismmoe_kt.demo.scenes: crowded shapes, textured backgrounds, digits and words).

    python scripts/train_routing_model.py --device cuda --out out/routing --steps 3000 --batch 64 --workers 12
    python scripts/train_routing_model.py --device cuda --out out/routing --steps 3000 --batch 64 --workers 12 --resume
    ... --stop_after 330      # checkpoint and stop after 330 s of training (exit status 3); --resume continues

Deterministic: step s trains on scenes s*batch .. (s+1)*batch-1 of the train split (seed 0), whatever the number
of data workers, and the weights start from --seed; a checkpoint (weights, AdamW state, step, curve) is written
to OUT/checkpoint.pt every --checkpoint_every steps, and --resume continues from it with the same losses an
uninterrupted run has (--stop_after stops at a step boundary with a checkpoint, for runs cut into calls of
limited length; resuming a checkpoint of the last step goes straight to the evaluation). On a GPU float32
matrix products use TF32 (deterministic still); the attention's backward kernels (flash and memory-efficient)
have no deterministic form in torch, which warns: a GPU run's data and schedule are the same, its bits may
not be. The loss is the answer tokens' cross-entropy plus the router's aux loss (vismmoe_kt.demo.training,
shared with scripts/train_demo_model.py). Each sequence is one scene with one
question of every type it allows plus an extra existence and count question, as turns of one chat, or (a
--describe_share of them) its caption.

At the end: held-out (val, seed 1) teacher-forced exact match per question type, and with --pruned_eval the
greedy-decoded accuracy under optimize_rules/qwen3vl.yaml (affinity pruning of visual tokens after
--prune_layer layers) at keep 1.0 and each --keep ratio (--pruned_per_type questions a type: each one a decode at
batch size 1); OUT is then a Hugging Face model directory
(vismmoe_kt.demo.routing_model.load_routing_model, or vismmoe_kt.load with any rule file) with
training.json (command, seconds, curve, accuracies).
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.demo import scenes
from vismmoe_kt.demo.routing_model import (CHECKPOINT_FILE, DEFAULT_SPEC, ROUTING_SPECS, build_routing_model,
                                           image_size, read_spec, save_model_directory, write_spec)
from vismmoe_kt.demo.training import (Labeller, adamw, caption_conversation, heldout_accuracy, image_dependence,
                                      qa_conversation, train_step, warmup_cosine)
from vismmoe_kt.models.bf16_experts import use_bf16_experts

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "optimize_rules" / "qwen3vl.yaml"
PROFILE_WARMUP = 3  # steps before --profile_steps: the data workers started, the device's kernels loaded and tuned


def conversation(seed: int, index: int, size: int, describe_share: float, simple: bool = False):
    """Scene `index` of split `seed` as one multi-turn chat of its questions, or its caption; (image, messages).
    `simple`: the curriculum's scene (scenes.sample_scene)."""
    rng, scene, image = scenes.make_scene(seed, index, size, simple)
    if rng.random() < describe_share:
        return caption_conversation(image, scenes.DESCRIBE_PROMPT, scenes.describe(scene))
    questions = scenes.questions_for_scene(scene, rng, size)
    questions += [scenes.exist_question(scene, rng, size), scenes.count_question(scene, rng, size)]
    unique = list({q.text: q for q in questions}.values())
    return qa_conversation(image, unique, rng.permutation(len(unique)))


class StepBatches(Labeller, torch.utils.data.Dataset):
    """Batch `step` is a pure function of the step: what makes a resumed run the same run."""

    def __init__(self, processor, batch: int, size: int, describe_share: float, seed: int = scenes.SPLIT_SEEDS["train"],
                 simple_steps: int = 0):
        Labeller.__init__(self, processor)
        self.batch, self.size, self.describe_share, self.seed = batch, size, describe_share, seed
        self.simple_steps = simple_steps

    def __getitem__(self, step: int):
        simple = step < self.simple_steps
        pairs = [conversation(self.seed, step * self.batch + i, self.size, self.describe_share, simple)
                 for i in range(self.batch)]
        return self.labelled([p[0] for p in pairs], [p[1] for p in pairs])


def scene_example(size: int):
    return lambda seed, index, qtype: scenes.make_example(seed, index, qtype, size)


def save_checkpoint(out: Path, model, optimizer, step: int, curve: list, settings: dict) -> None:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "curve": curve,
             "settings": settings, "torch_rng": torch.get_rng_state()}
    partial = out / (CHECKPOINT_FILE + ".partial")
    torch.save(state, partial)
    os.replace(partial, out / CHECKPOINT_FILE)  # atomic: a run killed while saving keeps the previous checkpoint


def pruned_accuracy(out: Path, keeps: list[float], prune_layer: int, per_type: int, size: int, device: str) -> dict:
    """Greedy-decoded held-out accuracy of the saved model under the VisMMOE rules, per keep ratio."""
    import vismmoe_kt
    from vismmoe_kt.apps.evaluate import evaluate, synthetic_items

    items = synthetic_items("val", per_type * len(scenes.QUESTION_TYPES), task="scenes", size=size)
    results = {}
    for keep in [1.0] + keeps:
        model, processor = vismmoe_kt.load(out, RULES, keep_ratio=keep, prune_layer=prune_layer, progress=False,
                                           generate_device=device, prefill_device=device)
        run = evaluate(model, processor, items, progress=False)
        summary = scenes.score([(r["type"], r["reply"], r["answer"]) for r in run["items"]])
        results[str(keep)] = {**summary, "experts_per_layer_prefill": run["experts_per_layer_prefill"]}
        print(f"  keep {keep}: accuracy {summary['accuracy']:.3f} {summary['per_type']}", flush=True)
        del model
    return results


def profile_report(profiler, steps: int, seconds: float, on_gpu: bool) -> str:
    """Where `steps` profiled training steps (`seconds` of wall time) went: the device's busy share, the host's
    synchronisations and kernel launches a step, and the ops by device time (on a GPU) and by host time."""
    from torch.autograd import DeviceType

    averages = profiler.key_averages()
    calls = {e.key: e.count for e in averages}
    kernel_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
    syncs = sum(n for k, n in calls.items() if k in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                       "cudaEventSynchronize"))
    launches = sum(n for k, n in calls.items() if k in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                          "cuLaunchKernelEx"))
    ops = sum(e.count for e in averages if e.key.startswith("aten::"))
    lines = [f"{steps} profiled steps, {seconds / steps * 1000:.1f} ms a step (wall)",
             f"a step: {ops / steps:.0f} aten ops, {launches / steps:.0f} kernel launches, "
             f"{syncs / steps:.0f} host synchronisations, {calls.get('cudaMemcpyAsync', 0) / steps:.0f} copies"]
    if on_gpu:  # kernels' own events: each kernel's time once
        lines.append(f"device busy {kernel_us / 1000 / steps:.1f} ms a step ({kernel_us / 1e6 / seconds:.0%} of the wall)")
        lines += ["", "by device time:", averages.table(sort_by="self_device_time_total", row_limit=25)]
    lines += ["", "by host time:", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    return "\n".join(lines)


def step_profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def write_profile(profiler, out: Path, steps: int, since: float, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - since
    profiler.stop()
    report = profile_report(profiler, steps, seconds, device.type == "cuda")
    (out / "profile.txt").write_text(report + "\n")
    print(report, f"\n--profile_steps: wrote {out / 'profile.txt'} (no checkpoint)", sep="\n", flush=True)
    return {"profile": str(out / "profile.txt"), "ms_per_step": round(seconds / steps * 1000, 1)}


def parse_args(argv=None):
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="training directory: checkpoint.pt, then the model and training.json")
    parser.add_argument("--spec", default=DEFAULT_SPEC, choices=sorted(ROUTING_SPECS), help="model size (routing-tiny: tests)")
    parser.add_argument("--device", default="cpu", help="cuda or cpu")
    parser.add_argument("--steps", type=int, default=3000, help="training steps in all (a resumed run counts the done ones)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; cosine decay to a tenth)")
    parser.add_argument("--warmup", type=int, default=200, help="linear warm-up steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--workers", type=int, default=2, help="processes making batches (0: in the training process)")
    parser.add_argument("--checkpoint_every", type=int, default=200, help="steps between checkpoints")
    parser.add_argument("--bf16", action="store_true",
                        help="the forward under bfloat16 autocast (float32 weights and optimizer), the experts' grouped "
                             "GEMMs in BF16 too (vismmoe_kt.models.bf16_experts: on a GPU one launch a projection, where "
                             "float32 runs one product per expert after a device synchronisation)")
    parser.add_argument("--profile_steps", type=int, default=0,
                        help="profile this many steps after 3 unprofiled ones (torch.profiler): the step's wall time, "
                             "the device's busy share, the host's synchronisations and launches, the ops by device and "
                             "host time, printed and written to OUT/profile.txt; then stop (no checkpoint)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (weights, optimizer, step)")
    parser.add_argument("--describe_share", type=float, default=0.2, help="share of sequences that are captions")
    parser.add_argument("--simple_steps", type=int, default=0,
                        help="a curriculum: the first this many steps train on simple scenes (1-3 large shapes, no sign)")
    parser.add_argument("--eval_per_type", type=int, default=64, help="held-out questions per type at the end (0: none)")
    parser.add_argument("--watch_per_type", type=int, default=16,
                        help="at each checkpoint, held-out questions per type answered with their own picture and "
                             "another scene's: the loss gained by the right picture (0: not watched)")
    parser.add_argument("--pruned_eval", action="store_true",
                        help="also the greedy accuracy under optimize_rules/qwen3vl.yaml at keep 1.0 and each --keep")
    parser.add_argument("--keep", default="0.7,0.5", help="visual-token keep ratios of --pruned_eval, comma-separated")
    parser.add_argument("--prune_layer", type=int, default=2, help="layers before visual tokens are pruned (--pruned_eval)")
    parser.add_argument("--pruned_per_type", type=int, default=None,
                        help="held-out questions per type of --pruned_eval (default: --eval_per_type)")
    parser.add_argument("--stop_after", type=float, default=None,
                        help="seconds of training in this run: then a checkpoint and exit status 3 (--resume continues)")
    parser.add_argument("--no_progress", action="store_true", help="print a line every 50 steps instead of a progress bar")
    args = parser.parse_args(argv)
    for flag in ("steps", "batch", "checkpoint_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.workers < 0 or args.eval_per_type < 0 or args.warmup < 0 or (args.pruned_per_type or 0) < 0 \
            or args.simple_steps < 0 or args.watch_per_type < 0 or args.profile_steps < 0:
        parser.error("--workers, --eval_per_type, --pruned_per_type, --warmup, --simple_steps, --watch_per_type and "
                     "--profile_steps cannot be negative")
    if args.profile_steps and args.profile_steps + PROFILE_WARMUP > args.steps:
        parser.error(f"--profile_steps {args.profile_steps}: the run has {args.steps} --steps, fewer than "
                     f"{PROFILE_WARMUP} unprofiled steps and the profiled ones")
    if args.stop_after is not None and args.stop_after <= 0:
        parser.error(f"--stop_after must be positive, got {args.stop_after}")
    if not 0.0 <= args.describe_share <= 1.0:
        parser.error(f"--describe_share must be between 0 and 1, got {args.describe_share}")
    try:
        args.keep = [float(k) for k in args.keep.split(",") if k.strip()]
    except ValueError:
        parser.error(f"--keep: expected comma-separated numbers, got {args.keep!r}")
    if any(not 0.0 < k <= 1.0 for k in args.keep):
        parser.error(f"--keep ratios must be in (0, 1], got {args.keep}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    checkpoint = Path(args.out) / CHECKPOINT_FILE
    if args.resume and not checkpoint.is_file():
        parser.error(f"--resume: no {checkpoint} to resume from")
    if not args.resume and checkpoint.is_file():
        parser.error(f"{checkpoint} exists: pass --resume to continue it, or choose another --out")
    if args.resume and read_spec(args.out) != args.spec:
        parser.error(f"--resume: {args.out} trains spec {read_spec(args.out)}, not --spec {args.spec}")
    return args


def train(args) -> dict:
    """The training loop; returns the training record (also written to OUT/training.json)."""
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    spec = ROUTING_SPECS[args.spec]
    size = image_size(spec)
    if args.device.startswith("cuda"):  # deterministic kernels where torch has them (a warning names the others)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # which also fills every new tensor (a debugging aid against reads of uninitialised memory): about 7700
        # fill kernels a step, 40% of a step's launches on an H100 (2026-12-05 profile); results do not depend on it
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 products: several times fp32's rate, still deterministic
        torch.backends.cudnn.allow_tf32 = True
        # cuDNN's attention costs ~0.75 ms of host time a call (forward and backward), and the vision tower
        # attends per picture (64 a batch, 4 blocks): 0.4 s a step on an H100 (2026-12-05 profile); the flash and
        # memory-efficient kernels launch in microseconds
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, processor = build_routing_model(args.spec, args.seed)
    device = torch.device(args.device)
    model.to(device).train()
    if args.bf16:
        use_bf16_experts(model)
    optimizer = adamw(model, args.lr)
    settings = {"spec": args.spec, "batch": args.batch, "seed": args.seed, "describe_share": args.describe_share}
    if args.simple_steps:  # another run's data: a checkpoint of one does not resume the other
        settings["simple_steps"] = args.simple_steps
    if args.bf16:  # another run's numerics: a checkpoint of one does not resume the other
        settings["autocast"] = "bfloat16"
    first_step, curve, seconds_before = 0, [], 0.0
    if args.resume:
        state = torch.load(out / CHECKPOINT_FILE, map_location=device, weights_only=False)
        if state["settings"] != settings:
            raise SystemExit(f"--resume: the checkpoint was trained with {state['settings']}, not {settings}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"].cpu())  # map_location moved it to the device
        first_step, curve = state["step"], state["curve"]
        seconds_before = curve[-1]["seconds"] if curve else 0.0
        if first_step > args.steps:
            raise SystemExit(f"--resume: the checkpoint is at step {first_step}, past --steps {args.steps}")
        if first_step == args.steps:
            print(f"the checkpoint is at the last step ({first_step}): evaluating", flush=True)
    else:
        torch.manual_seed(args.seed)
        write_spec(out, args.spec)
    experts = getattr(model.config.text_config, "_experts_implementation", None)
    print(f"{args.spec} on {args.device}: steps {first_step}..{args.steps} of batch {args.batch}, {args.workers} data "
          f"workers, transformers' experts implementation {experts!r}", flush=True)
    batches = StepBatches(processor, args.batch, size, args.describe_share, simple_steps=args.simple_steps)
    # pinned batches copy to the GPU without the host waiting: a step's pictures are about 160 MB of float32 at
    # batch 64, 25 ms a step as pageable copies on an H100 (2026-12-05 profile)
    pinned = device.type == "cuda"
    loader = torch.utils.data.DataLoader(batches, batch_size=None, sampler=range(first_step, args.steps),
                                         num_workers=args.workers, prefetch_factor=4 if args.workers else None,
                                         pin_memory=pinned)
    start = time.perf_counter()
    stopped, waited, ready = False, 0.0, start  # waited: seconds the GPU step waited for the data workers
    bar = tqdm(total=args.steps, initial=first_step, desc=f"Training {args.spec}", unit="step", disable=args.no_progress)
    profiler = None
    for step, (inputs, labels) in enumerate(loader, first_step):
        if args.profile_steps and step - first_step == PROFILE_WARMUP:
            profiler, profiled_from = step_profiler(device), time.perf_counter()
        waited += time.perf_counter() - ready
        lr = warmup_cosine(step, args.lr, args.warmup, args.steps)
        loss, aux = train_step(model, optimizer, inputs.to(device, non_blocking=pinned),
                               labels.to(device, non_blocking=pinned), lr,
                               torch.bfloat16 if args.bf16 else None)
        curve.append({"step": step + 1, "loss": round(loss, 5), "aux_loss": round(aux, 4), "lr": lr,
                      "seconds": round(seconds_before + time.perf_counter() - start, 1)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", aux=f"{aux:.3f}", lr=f"{lr:.1e}")
        done, elapsed = step + 1 - first_step, time.perf_counter() - start
        rate = f"{done / elapsed:.2f} steps/s, {waited / elapsed:.0%} of it waiting for data"
        if args.no_progress and (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps}  loss {np.mean([c['loss'] for c in curve[-50:]]):.4f}  aux {aux:.3f}  "
                  f"{rate}", flush=True)
        elif done in (5, 20):  # the rate early (the first steps include the workers' start and CUDA's warm-up)
            print(f"step {step + 1}: {rate} (this run's {done} steps)", flush=True)
        if profiler is not None and step + 1 - first_step == PROFILE_WARMUP + args.profile_steps:
            bar.close()
            return write_profile(profiler, out, args.profile_steps, profiled_from, device)
        stopped = args.stop_after is not None and time.perf_counter() - start >= args.stop_after and step + 1 < args.steps
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps or stopped:
            if args.watch_per_type:  # the loss alone cannot tell answers from the picture from the priors
                watched = image_dependence(model, batches, scene_example(size), scenes.QUESTION_TYPES,
                                           args.watch_per_type, scenes.SPLIT_SEEDS["val"], device)
                curve[-1]["image_gain"] = {t: v["gain"] for t, v in watched.items()}
                print(f"step {step + 1}: held-out loss gained by the right picture "
                      f"{json.dumps(curve[-1]['image_gain'])}", flush=True)
            save_checkpoint(out, model, optimizer, step + 1, curve, settings)
        if stopped:
            break
        ready = time.perf_counter()
    bar.close()
    if stopped:
        del loader  # the workers stop before the exit
        print(f"--stop_after {args.stop_after}: stopped at step {curve[-1]['step']} of {args.steps} ({rate}); "
              "checkpoint written, --resume continues", flush=True)
        raise SystemExit(3)
    record = {"command": "python " + " ".join(sys.argv), "spec": args.spec, "steps": args.steps, "batch": args.batch,
              "lr": args.lr, "warmup": args.warmup, "seed": args.seed, "device": args.device, "workers": args.workers,
              "describe_share": args.describe_share, "simple_steps": args.simple_steps,
              "autocast": "bfloat16" if args.bf16 else None,
              "resumed_from": first_step if args.resume else None,
              "seconds": curve[-1]["seconds"], "final_loss": float(np.mean([c["loss"] for c in curve[-50:]])),
              "steps_per_second": round(len(curve) / curve[-1]["seconds"], 3) if curve[-1]["seconds"] else None,
              "data_wait_share": round(waited / (time.perf_counter() - start), 3) if len(curve) > first_step else None}
    if args.eval_per_type:
        accuracy = heldout_accuracy(model, batches, scene_example(size), scenes.QUESTION_TYPES, args.eval_per_type,
                                    scenes.SPLIT_SEEDS["val"], device)
        record["heldout"] = {"split_seed": scenes.SPLIT_SEEDS["val"], "per_type": args.eval_per_type,
                             "teacher_forced": accuracy, "mean": float(np.mean(list(accuracy.values()))),
                             "image_dependence": image_dependence(model, batches, scene_example(size),
                                                                  scenes.QUESTION_TYPES, args.eval_per_type,
                                                                  scenes.SPLIT_SEEDS["val"], device)}
        print(f"held-out (seed {scenes.SPLIT_SEEDS['val']}) teacher-forced accuracy: {accuracy}", flush=True)
    save_model_directory(out, model, processor)
    if args.pruned_eval and args.eval_per_type:
        record["pruned"] = {"rules": "optimize_rules/qwen3vl.yaml", "prune_layer": args.prune_layer,
                            "per_type": args.pruned_per_type or args.eval_per_type,
                            "by_keep": pruned_accuracy(out, args.keep, args.prune_layer,
                                                       args.pruned_per_type or args.eval_per_type, size,
                                                       "cuda:0" if args.device.startswith("cuda") else "cpu")}
    record["curve"] = curve
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"trained {args.steps} steps; final loss {record['final_loss']:.4f}; wrote {out}", flush=True)
    return record


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
