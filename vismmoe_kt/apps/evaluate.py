"""Exact-match visual QA accuracy of a loaded model, per question type: `vismmoe-kt eval`.

Three sources of items, one code path:
  synthetic-vqa  the seeded shapes task of `vismmoe_kt.demo.vqa` (a split name or a seed);
  scenes         the seeded scenes task of `vismmoe_kt.demo.scenes` (the routing-study model's: crowded
                 scenes, signs to read; a split name or a seed);
  folder         a local benchmark in a simple POPE-like layout: DIR/questions.jsonl, one JSON object a line,
                 {"image": "images/0001.jpg", "question": "Is there a dog in the image?", "answer": "yes",
                  "type": "adversarial"}. POPE's own keys are accepted too ("text" for question, "label" for
                 answer, "category" for type); "type" is optional (default "all"). Image paths are relative to
                 DIR (or absolute).
Each question is asked alone about its image, with greedy decoding; the reply is right when it equals the
answer up to case, surrounding space and a final full stop.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, TextIO

import torch

from ..engine.generation import generate
from ..engine.inputs import ask_inputs
from ..errors import InputError
from .flags import add_model_flags, load_from_args
from .images import load_image

FOLDER_QUESTIONS = "questions.jsonl"


@dataclass
class VqaItem:
    image: Any  # a PIL image, or a path read when the item is asked
    question: str
    answer: str
    type: str


def synthetic_items(split: str | int, limit: int, types: list[str] | None = None,
                    task: str = "synthetic-vqa", size: int | None = None) -> list[VqaItem]:
    """`limit` examples of a split of a seeded task (synthetic-vqa or scenes, pictures of `size` pixels, else the
    task's); question types cycle (or only `types`), so each type gets a fair share."""
    from ..demo import scenes, vqa
    from ..demo.vqa import split_seed

    generator = scenes if task == "scenes" else vqa
    try:
        seed = split_seed(split)
    except ValueError as exc:
        raise InputError(f"--split: {exc}") from None
    types = types or list(generator.QUESTION_TYPES)
    unknown = [t for t in types if t not in generator.QUESTION_TYPES]
    if unknown:
        raise InputError(f"--types: unknown question type(s) {', '.join(unknown)}; choose from {', '.join(generator.QUESTION_TYPES)}")
    items = []
    for index in range(limit):
        example = generator.make_example(seed, index, types[index % len(types)], size or generator.IMAGE_SIZE)
        items.append(VqaItem(example.image, example.question.text, example.question.answer, example.question.type))
    return items


def folder_items(folder: str | Path, limit: int | None = None) -> list[VqaItem]:
    folder = Path(folder)
    questions = folder / FOLDER_QUESTIONS
    if not folder.is_dir():
        raise InputError(f"--data {folder}: no such directory")
    if not questions.is_file():
        raise InputError(f"--data {folder}: no {FOLDER_QUESTIONS} in it (one JSON object a line: image, question, answer)")
    items = []
    for number, line in enumerate(questions.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{questions}, line {number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{where}: not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object")
        question, answer = record.get("question", record.get("text")), record.get("answer", record.get("label"))
        if "image" not in record or question is None or answer is None:
            raise InputError(f"{where}: needs \"image\", \"question\" (or \"text\") and \"answer\" (or \"label\")")
        image = Path(record["image"])
        image = image if image.is_absolute() else folder / image
        if not image.is_file():  # checked now, so a typo fails before the model is loaded
            raise InputError(f"{where}: image {image}: no such file")
        items.append(VqaItem(image, str(question), str(answer),
                             str(record.get("type", record.get("category", "all")))))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise InputError(f"{questions}: no questions in it")
    return items


def normalise(text: str) -> str:
    return text.strip().lower().rstrip(".").strip()


def ask(model: Any, processor: Any, image: Any, question: str, max_new_tokens: int) -> str:
    """One greedy answer to one question about one image."""
    inputs = ask_inputs(model, processor, question, [image])
    with torch.inference_mode():  # the product's own generation (the lean decode path where the rules have it)
        output = generate(model, inputs, max_new_tokens)
    return processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class PrefillWorkingSet:
    """Distinct experts each MoE layer's router picks during a request's prefill (its expert working set).

    Hooks every MoE layer's router (the adapter finds them and reads their choice); the first call of a layer after
    `start()` is the prefill, later calls are decode steps and are not counted.
    """

    def __init__(self, model: Any):
        self.adapter = model.vismmoe.adapter
        self.routers = [r for r in map(self.adapter.router, self.adapter.decoder_layers(model)) if r is not None]
        self.handles = [r.register_forward_hook(self._record(i)) for i, r in enumerate(self.routers)]
        self.current: dict[int, int] = {}
        self.requests: list[list[int]] = []

    def _record(self, layer: int):
        def hook(module, inputs, output):
            if layer not in self.current:
                self.current[layer] = int(torch.unique(self.adapter.routed_experts(output)).numel())
        return hook

    def start(self) -> None:
        self.current = {}

    def finish(self) -> None:
        if self.current:
            self.requests.append([self.current.get(i, 0) for i in range(len(self.routers))])

    def mean_per_layer(self) -> list[float]:
        if not self.requests:
            return []
        return [round(sum(r[i] for r in self.requests) / len(self.requests), 2) for i in range(len(self.routers))]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def iterate_answers(model: Any, processor: Any, items: list[VqaItem], max_new_tokens: int = 8,
                    progress: bool = True, working_set: PrefillWorkingSet | None = None) -> Iterator[dict[str, Any]]:
    from tqdm import tqdm

    for item in tqdm(items, desc="Evaluating", unit="question", disable=not progress):
        image = load_image(item.image) if isinstance(item.image, (str, Path)) else item.image
        if working_set:
            working_set.start()
        reply = ask(model, processor, image, item.question, max_new_tokens)
        if working_set:
            working_set.finish()
        yield {"type": item.type, "question": item.question, "answer": item.answer, "reply": reply,
               "correct": normalise(reply) == normalise(item.answer)}


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Overall and per-type accuracy of answered records."""
    per_type: dict[str, dict[str, Any]] = {}
    for record in records:
        entry = per_type.setdefault(record["type"], {"n": 0, "correct": 0})
        entry["n"] += 1
        entry["correct"] += int(record["correct"])
    for entry in per_type.values():
        entry["accuracy"] = entry["correct"] / entry["n"]
    correct = sum(e["correct"] for e in per_type.values())
    return {"n": len(records), "correct": correct, "accuracy": correct / len(records) if records else 0.0,
            "per_type": dict(sorted(per_type.items()))}


def evaluate(model: Any, processor: Any, items: list[VqaItem], max_new_tokens: int = 8, progress: bool = True) -> dict[str, Any]:
    """Answer every item; accuracy overall and per type, the mean prefill expert working set per layer, the answers."""
    start = time.perf_counter()
    working_set = PrefillWorkingSet(model)
    try:
        records = list(iterate_answers(model, processor, items, max_new_tokens, progress, working_set))
    finally:
        working_set.close()
    return {**summarise(records), "seconds": round(time.perf_counter() - start, 2),
            "experts_per_layer_prefill": working_set.mean_per_layer(), "items": records}


def add_parser(commands) -> None:
    evaluate = commands.add_parser("eval", help="exact-match visual QA accuracy per question type (JSON output)")
    add_model_flags(evaluate)
    evaluate.add_argument("--task", choices=["synthetic-vqa", "scenes", "folder"], default="synthetic-vqa",
                          help="synthetic-vqa: the seeded shapes task; scenes: the routing-study model's task; "
                               "folder: --data DIR with questions.jsonl")
    evaluate.add_argument("--split", default="test", help="synthetic-vqa / scenes split: train, val, test (held out) or a seed")
    evaluate.add_argument("--limit", type=int, help="ask at most N questions (synthetic-vqa default: 200)")
    evaluate.add_argument("--types", help="synthetic-vqa / scenes question types, comma-separated (default: all, cycled)")
    evaluate.add_argument("--data", help="folder task: a directory with questions.jsonl and the images it names")
    evaluate.add_argument("--max_new_tokens", type=int, default=8, help="the longest answer, in tokens")
    evaluate.add_argument("--output", help="write the results (accuracy per type, every answer) to this JSON file")


def eval_items(args: argparse.Namespace) -> list:
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be at least 1, got {args.limit}")
    if args.task == "folder":
        if not args.data:
            raise InputError("--task folder needs --data DIR (a directory with questions.jsonl)")
        return folder_items(args.data, args.limit)
    if args.data:
        raise InputError(f"--data is for --task folder; --task {args.task} makes its own images")
    split = int(args.split) if args.split.lstrip("-").isdigit() else args.split
    types = [t.strip() for t in args.types.split(",")] if args.types else None
    return synthetic_items(split, args.limit or 200, types, args.task)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    import sys

    from ..core.stats import collect_stats

    out = out or sys.stdout
    if args.max_new_tokens < 1:
        raise InputError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise InputError(f"--output {args.output}: its directory does not exist")
    items = eval_items(args)  # bad data fails before the model is loaded
    model, processor = load_from_args(args)
    result = evaluate(model, processor, items, args.max_new_tokens)
    source = f"--data {args.data}" if args.task == "folder" else f"split {args.split}"
    print(f"{args.task} ({source}): accuracy {result['accuracy']:.3f} ({result['correct']}/{result['n']})", file=out)
    for name, entry in result["per_type"].items():
        print(f"  {name:<10} {entry['accuracy']:.3f} ({entry['correct']}/{entry['n']})", file=out)
    if args.output:
        header = {"task": args.task, "split": args.split if args.task != "folder" else None, "data": args.data,
                  "model": str(model.vismmoe.model_dir), "rules": model.vismmoe.rules,
                  "overrides": args.set, "stats": collect_stats(model)}
        Path(args.output).write_text(json.dumps({**header, **result}, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"wrote {args.output}", file=out)
    return 0
