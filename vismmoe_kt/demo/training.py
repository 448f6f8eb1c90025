"""What training the demo model and the routing-study model share: chats as labelled batches (loss on the
assistant's replies only), AdamW with warm-up and cosine decay, one optimisation step, and held-out exact match
measured teacher-forced (an answer is right when every one of its tokens is the argmax, which is exactly when
greedy decoding produces it). scripts/train_demo_model.py and scripts/train_routing_model.py are the loops.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def answer_mask(input_ids: torch.Tensor, prefix: list[int], end_id: int) -> torch.Tensor:
    """True on the tokens of each assistant reply (after `<|im_start|>assistant\\n`, up to and with `<|im_end|>`)."""
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, ids in enumerate(input_ids.tolist()):
        i = 0
        while i < len(ids):
            if ids[i:i + len(prefix)] == prefix:
                i += len(prefix)
                while i < len(ids):
                    mask[row, i] = True
                    i += 1
                    if ids[i - 1] == end_id:
                        break
            else:
                i += 1
    return mask


def encode(processor, images, messages_list, add_generation_prompt=False):
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=add_generation_prompt)
             for m in messages_list]
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


class Labeller:
    """Chats to model inputs and labels: every token but the assistant's replies is -100."""

    def __init__(self, processor):
        self.processor = processor
        self.prefix = processor.tokenizer.encode("<|im_start|>assistant\n")
        self.end_id = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def labelled(self, images, messages_list):
        inputs = encode(self.processor, images, messages_list)
        labels = inputs["input_ids"].masked_fill(~answer_mask(inputs["input_ids"], self.prefix, self.end_id), -100)
        return inputs, labels


def question_chat(question: str, answer: str) -> list[dict]:
    """One question about the image and its answer: the evaluation format."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def qa_conversation(image, questions, order) -> tuple:
    """`questions` (objects with .text and .answer) as the turns of one chat in `order`; the image in the first."""
    messages = []
    for turn, i in enumerate(order):
        content = ([{"type": "image"}] if turn == 0 else []) + [{"type": "text", "text": questions[i].text}]
        messages.append({"role": "user", "content": content})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": questions[i].answer}]})
    return image, messages


def caption_conversation(image, prompt: str, caption: str) -> tuple:
    return image, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
                   {"role": "assistant", "content": [{"type": "text", "text": caption}]}]


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms and biases)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98))


def warmup_cosine(step: int, lr: float, warmup: int, steps: int, progress: float | None = None) -> float:
    """Linear warm-up over `warmup` steps, then cosine to a tenth of `lr` at `steps` (or at `progress` 1.0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    done = (step - warmup) / max(steps - warmup, 1)
    if progress is not None:
        done = max(done, progress)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def train_step(model, optimizer, inputs, labels, lr: float, autocast: torch.dtype | None = None) -> tuple[float, float]:
    """One AdamW step on the answer-token loss plus the router's weighted aux loss (as the architecture computes
    it, `output_router_logits`); gradients clipped to norm 1. `autocast`: the forward's products in that dtype
    (torch.autocast; the weights and the optimizer stay float32). Returns (loss, unweighted aux loss)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        output = model(**inputs, labels=labels, output_router_logits=True)
    optimizer.zero_grad(set_to_none=True)
    output.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(output.loss.detach()), float(output.aux_loss.detach())


def image_dependence(model, labeller: Labeller, make_example: Callable, question_types, per_type: int, seed: int,
                     device=None, chunk: int = 16) -> dict[str, dict[str, float]]:
    """Whether the answers use the picture: per question type, the held-out answer tokens' mean loss with each
    question's own picture and with the next example's (another scene), and the gain (other - own). A model
    answering from its priors alone gains nothing, however low its loss; accuracy at chance says the same only
    after many questions."""
    model.eval()
    out = {}
    with torch.no_grad():
        for qtype in question_types:
            examples = [make_example(seed, i, qtype) for i in range(per_type)]
            chats = [question_chat(e.question.text, e.question.answer) for e in examples]
            losses = []
            for shift in (0, 1):  # each question with its own picture, then with the next example's
                images = [examples[(i + shift) % per_type].image for i in range(per_type)]
                total = 0.0
                for start in range(0, per_type, chunk):
                    inputs, labels = labeller.labelled(images[start:start + chunk], chats[start:start + chunk])
                    if device is not None:
                        inputs, labels = inputs.to(device), labels.to(device)
                    total += float(model(**inputs, labels=labels).loss) * len(chats[start:start + chunk])
                losses.append(total / per_type)
            out[qtype] = {"own": round(losses[0], 4), "other": round(losses[1], 4), "gain": round(losses[1] - losses[0], 4)}
    model.train()
    return out


def heldout_accuracy(model, labeller: Labeller, make_example: Callable, question_types, per_type: int, seed: int,
                     device=None, chunk: int = 16) -> dict[str, float]:
    """Teacher-forced exact match of single-question examples `make_example(seed, i, type)`, per question type."""
    model.eval()
    correct = {t: 0 for t in question_types}
    with torch.no_grad():
        for qtype in question_types:
            examples = [make_example(seed, i, qtype) for i in range(per_type)]
            for start in range(0, per_type, chunk):
                part = examples[start:start + chunk]
                inputs, labels = labeller.labelled([e.image for e in part],
                                                   [question_chat(e.question.text, e.question.answer) for e in part])
                if device is not None:
                    inputs, labels = inputs.to(device), labels.to(device)
                predicted = model(**inputs).logits[:, :-1].argmax(-1)
                target = labels[:, 1:]
                wrong = ((predicted != target) & (target != -100)).any(dim=1)
                correct[qtype] += int((~wrong).sum())
    model.train()
    return {t: correct[t] / per_type for t in question_types}
