"""A seeded synthetic visual QA task: shapes on noisy or textured backgrounds, questions with exact answers.

A scene is 1-4 shapes (kind, colour, size, centre) on a background that carries little information,
so that, as in real photos, many visual tokens could be dropped. No two shapes share both kind and
colour, so "the red circle" always names one shape. Question types:

  exist     POPE-style "Is there a red circle?"; half of them negatives, most of those adversarial
            (a shape of that kind or of that colour is in the image, only the pair is not)
  colour    "What colour is the square?" (asked only when exactly one square is present)
  count     "How many triangles are there?" (0-4)
  position  "Is the red circle left of the blue square?" / "... above ..." (only for pairs clearly apart)
and a caption for "Describe the image." (every shape, left to right), which training uses as a dense signal.

Every example is a pure function of (seed, index): a split is a seed, and held-out splits are other seeds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw

KINDS = ("circle", "square", "triangle", "star")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 230), "yellow": (235, 210, 40),
           "purple": (150, 60, 190), "white": (250, 250, 250)}
QUESTION_TYPES = ("exist", "colour", "count", "position")
SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}  # held out = a different seed
IMAGE_SIZE = 224
MIN_GAP = 24  # pixels between centres along the asked axis, so "left of" is never a judgement call


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    radius: int  # half the bounding box side, pixels
    x: int  # centre
    y: int

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass(frozen=True)
class Question:
    type: str
    text: str
    answer: str


@dataclass
class Example:
    image: Image.Image
    shapes: list[Shape]
    question: Question

    def describe(self) -> dict:
        """The scene and question as plain data (JSON-able): what answers are re-derived from."""
        return {"shapes": [asdict(s) for s in self.shapes], "question": asdict(self.question)}


def split_seed(split: str | int) -> int:
    if isinstance(split, int):
        return split
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLIT_SEEDS)} or give a seed")
    return SPLIT_SEEDS[split]


def sample_shapes(rng: np.random.Generator, size: int = IMAGE_SIZE) -> list[Shape]:
    count = int(rng.integers(1, 5))
    pairs = [(k, c) for k in KINDS for c in COLOURS]
    chosen = rng.choice(len(pairs), size=count, replace=False)
    shapes: list[Shape] = []
    for index in chosen:
        kind, colour = pairs[index]
        for _ in range(100):  # rejection sampling for a spot that overlaps nothing placed so far
            radius = int(rng.integers(size // 12, size // 6))
            x, y = (int(v) for v in rng.integers(radius + 2, size - radius - 2, size=2))
            if all((x - s.x) ** 2 + (y - s.y) ** 2 > (radius + s.radius + 4) ** 2 for s in shapes):
                shapes.append(Shape(kind, colour, radius, x, y))
                break
    return shapes


def background(rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """Grey-ish noise or a low-contrast texture: low saturation, so no patch of it looks like a shape."""
    base = rng.uniform(70, 170)
    if rng.random() < 0.5:
        pixels = rng.normal(base, 22, (size, size, 1)) + rng.normal(0, 8, (size, size, 3))
    else:
        yy, xx = np.mgrid[0:size, 0:size]
        angle, period = rng.uniform(0, np.pi), rng.uniform(6, 30)
        waves = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period)
        pixels = (base + 25 * waves)[..., None] + rng.normal(0, 12, (size, size, 3))
    return pixels.clip(0, 255).astype(np.uint8)


def draw_shape(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    x, y, r, fill = shape.x, shape.y, shape.radius, COLOURS[shape.colour]
    if shape.kind == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    elif shape.kind == "square":
        side = r * 0.85  # a square of the same bounding radius looks larger than a circle: even them out
        draw.rectangle([x - side, y - side, x + side, y + side], fill=fill)
    elif shape.kind == "triangle":
        draw.polygon([(x, y - r), (x - r, y + r * 0.8), (x + r, y + r * 0.8)], fill=fill)
    elif shape.kind == "star":
        angles = np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
        draw.polygon([(x + q * np.cos(a), y - q * np.sin(a)) for q, a in zip(radii, angles)], fill=fill)
    else:
        raise ValueError(f"unknown shape kind {shape.kind!r}")


def render(shapes: list[Shape], rng: np.random.Generator, size: int = IMAGE_SIZE) -> Image.Image:
    image = Image.fromarray(background(rng, size))
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        draw_shape(draw, shape)
    return image


def plural(kind: str) -> str:
    return kind + "s"


def exist_question(shapes: list[Shape], rng: np.random.Generator) -> Question:
    present = {(s.kind, s.colour) for s in shapes}
    if rng.random() < 0.5:
        kind, colour = sorted(present)[rng.integers(len(present))]
        return Question("exist", f"Is there a {colour} {kind}?", "yes")
    absent = [(k, c) for k in KINDS for c in COLOURS if (k, c) not in present]
    # adversarial: the kind or the colour is in the image, only not together (POPE's co-occurring negatives)
    near = [(k, c) for k, c in absent if any(k == s.kind or c == s.colour for s in shapes)]
    pool = near if near and rng.random() < 0.75 else absent
    kind, colour = pool[rng.integers(len(pool))]
    return Question("exist", f"Is there a {colour} {kind}?", "no")


def colour_question(shapes: list[Shape], rng: np.random.Generator) -> Question | None:
    unique = [s for s in shapes if sum(t.kind == s.kind for t in shapes) == 1]
    if not unique:
        return None
    shape = unique[rng.integers(len(unique))]
    return Question("colour", f"What colour is the {shape.kind}?", shape.colour)


def count_question(shapes: list[Shape], rng: np.random.Generator) -> Question:
    # ask about a kind in the image three times out of four, so "0" does not dominate the answers
    kinds = sorted({s.kind for s in shapes}) if rng.random() < 0.75 else list(KINDS)
    kind = kinds[rng.integers(len(kinds))]
    return Question("count", f"How many {plural(kind)} are there?", str(sum(s.kind == kind for s in shapes)))


def position_question(shapes: list[Shape], rng: np.random.Generator) -> Question | None:
    candidates = []
    for a in shapes:
        for b in shapes:
            if a is b:
                continue
            if abs(a.x - b.x) >= MIN_GAP:
                candidates.append((a, b, "left of", a.x < b.x))
            if abs(a.y - b.y) >= MIN_GAP:
                candidates.append((a, b, "above", a.y < b.y))
    if not candidates:
        return None
    a, b, relation, truth = candidates[rng.integers(len(candidates))]
    return Question("position", f"Is the {a.name} {relation} the {b.name}?", "yes" if truth else "no")


ASKERS = {"exist": exist_question, "colour": colour_question, "count": count_question, "position": position_question}


def make_scene(seed: int, index: int, size: int = IMAGE_SIZE) -> tuple[np.random.Generator, list[Shape], Image.Image]:
    """Scene `index` of split `seed`, and the generator its questions are drawn from next."""
    rng = np.random.default_rng([seed, index])
    shapes = sample_shapes(rng, size)
    return rng, shapes, render(shapes, rng, size)


def make_example(seed: int, index: int, question_type: str | None = None, size: int = IMAGE_SIZE) -> Example:
    """Example `index` of split `seed`: a scene and one question (of `question_type`, or cycled by index).

    Types a scene cannot ask (no unique kind, no pair apart) fall back to an existence question.
    """
    rng, shapes, image = make_scene(seed, index, size)
    wanted = question_type or QUESTION_TYPES[index % len(QUESTION_TYPES)]
    if wanted not in ASKERS:
        raise ValueError(f"unknown question type {wanted!r}; choose one of {', '.join(QUESTION_TYPES)}")
    question = ASKERS[wanted](shapes, rng) or exist_question(shapes, rng)
    return Example(image, shapes, question)


def questions_for_scene(shapes: list[Shape], rng: np.random.Generator) -> list[Question]:
    """One question of every type the scene allows (training asks them as turns of one conversation)."""
    asked = [ASKERS[t](shapes, rng) for t in QUESTION_TYPES]
    return [q for q in asked if q is not None]


DESCRIBE_PROMPT = "Describe the image."


def describe(shapes: list[Shape]) -> str:
    """The caption the demo model is trained to give: every shape, left to right ("a red circle and a blue square")."""
    names = [f"a {s.name}" for s in sorted(shapes, key=lambda s: s.x)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def normalise_answer(text: str) -> str:
    """Exact match up to case, surrounding space and a final full stop."""
    return text.strip().lower().rstrip(".").strip()
