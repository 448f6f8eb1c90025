"""A richer seeded synthetic visual QA task for the routing-study model: crowded scenes on textured backgrounds,
with digits and words to read.

A scene is 3-8 shapes (the shapes task's kinds and colours, `vismmoe_kt.demo.vqa`, at two sizes; a kind and
colour may repeat, so counts go past one), one sign with a digit on it and, half of the time, a second sign with
a short word, drawn in PIL's default font on a background of stripes, noise, a gradient or a checkerboard:
large regions that carry nothing, so that dropping visual tokens is meaningful. Question types:

  exist     "Is there a red circle?"; half negatives, most of them adversarial (the kind or the colour is there)
  colour    "What colour is the star?" (asked only when exactly one star is present)
  count     "How many circles are there?" / "How many red shapes are there?" (0-8)
  position  "Is the red circle left of the blue square?" / "... above ...", the signs included, or
            "Is the green star on the left or the right?" (only for things clearly apart)
  read      "What digit is written in the image?" / "What word is written in the image?"
and a caption for "Describe the image." (the signs, then every shape left to right) as a dense training signal.

Every example is a pure function of (seed, index): a split is a seed (`vqa.SPLIT_SEEDS`: train 0, val 1,
test 2), and held-out splits are other seeds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .vqa import COLOURS, KINDS, SPLIT_SEEDS, Question, Shape, draw_shape, normalise_answer, plural, split_seed

QUESTION_TYPES = ("exist", "colour", "count", "position", "read")
BACKGROUNDS = ("stripes", "noise", "gradient", "checker")
WORDS = ("cat", "dog", "sun", "box", "car", "map", "cup", "key", "hat", "pen", "bus", "fox")
NUMBER_WORDS = {w: str(i) for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven",
                                                 "eight", "nine", "ten"))}
IMAGE_SIZE = 320  # 20 x 20 patches of 16 pixels: 100 visual tokens after the 2 x 2 merge
MIN_GAP = 32  # pixels between centres along the asked axis, so "left of" is never a judgement call
DESCRIBE_PROMPT = "Describe the image."
__all__ = ["SPLIT_SEEDS", "split_seed", "Scene", "Sign", "make_scene", "make_example", "questions_for_scene",
           "describe", "normalise", "score"]


@dataclass(frozen=True)
class Sign:
    """A light plate with dark text on it: a digit or a word to read."""
    kind: str  # "digit" or "word"
    text: str
    x: int  # centre
    y: int
    half_width: int
    half_height: int
    font_size: int

    @property
    def name(self) -> str:
        return "digit" if self.kind == "digit" else "word"


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]
    signs: tuple[Sign, ...]
    background: str

    def describe(self) -> dict:
        """The scene as plain data (JSON-able): what answers are re-derived from."""
        return {"shapes": [asdict(s) for s in self.shapes], "signs": [asdict(s) for s in self.signs],
                "background": self.background}


@dataclass
class Example:
    image: Image.Image
    scene: Scene
    question: Question


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)  # Pillow's embedded font: nothing to download


def _apart(box, boxes, margin: int = 4) -> bool:
    x, y, w, h = box
    return all(abs(x - bx) > w + bw + margin or abs(y - by) > h + bh + margin for bx, by, bw, bh in boxes)


def _place(rng: np.random.Generator, half_w: int, half_h: int, size: int, boxes: list) -> tuple[int, int] | None:
    for _ in range(100):  # rejection sampling for a spot that overlaps nothing placed so far
        x = int(rng.integers(half_w + 2, size - half_w - 2))
        y = int(rng.integers(half_h + 2, size - half_h - 2))
        if _apart((x, y, half_w, half_h), boxes):
            return x, y
    return None


def sample_scene(rng: np.random.Generator, size: int = IMAGE_SIZE, simple: bool = False) -> Scene:
    """A scene; `simple`: a training curriculum's first scenes, 1-3 large shapes and no sign. A model from
    scratch learns to read colours off such scenes (the demo model's sizes: by step 875 of 16 on the CPU),
    and off none with a sign in every scene, however large and few the shapes (benchmarks/results/2026-12-04)."""
    boxes: list[tuple[int, int, int, int]] = []
    signs = []
    texts = [] if simple else [("digit", str(int(rng.integers(10))))]
    if not simple and rng.random() < 0.5:
        texts.append(("word", WORDS[int(rng.integers(len(WORDS)))]))
    for kind, text in texts:
        font_size = int(rng.integers(size // 11, size // 8))
        left, top, right, bottom = _font(font_size).getbbox(text)
        half_w, half_h = (right - left) // 2 + 5, (bottom - top) // 2 + 5
        spot = _place(rng, half_w, half_h, size, boxes)
        if spot is not None:
            boxes.append((*spot, half_w, half_h))
            signs.append(Sign(kind, text, spot[0], spot[1], half_w, half_h, font_size))
    shapes = []
    for _ in range(int(rng.integers(1, 4) if simple else rng.integers(3, 9))):
        kind, colour = KINDS[int(rng.integers(len(KINDS)))], list(COLOURS)[int(rng.integers(len(COLOURS)))]
        radius = int(size // 9 if simple else size // 22 if rng.random() < 0.5 else size // 13) + int(rng.integers(0, 4))
        spot = _place(rng, radius, radius, size, boxes)
        if spot is not None:
            boxes.append((*spot, radius, radius))
            shapes.append(Shape(kind, colour, radius, *spot))
    return Scene(tuple(shapes), tuple(signs), BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))])


def background(kind: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """Low-saturation texture (no patch of it looks like a shape or a sign), mostly redundant by design."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)  # float32 throughout: data making feeds a GPU
    base, tint = rng.uniform(80, 160), rng.normal(0, 6, 3)
    if kind == "stripes":
        angle, period = rng.uniform(0, np.pi), rng.uniform(10, 40)
        grey = base + 25 * np.sign(np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period))
    elif kind == "noise":
        grey = base + 20 * rng.standard_normal((size, size), dtype=np.float32)
    elif kind == "gradient":
        angle = rng.uniform(0, 2 * np.pi)
        grey = base + 50 * ((xx * np.cos(angle) + yy * np.sin(angle)) / size - 0.5)
    elif kind == "checker":
        cell = int(rng.integers(16, 48))
        grey = base + 20 * (((xx // cell) + (yy // cell)) % 2 * 2 - 1)
    else:
        raise ValueError(f"unknown background {kind!r}; choose one of {', '.join(BACKGROUNDS)}")
    pixels = grey[..., None] + tint.astype(np.float32) + 4 * rng.standard_normal((size, size, 3), dtype=np.float32)
    return pixels.clip(0, 255).astype(np.uint8)


def render(scene: Scene, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Image.Image:
    image = Image.fromarray(background(scene.background, rng, size))
    draw = ImageDraw.Draw(image)
    for sign in scene.signs:
        draw.rectangle([sign.x - sign.half_width, sign.y - sign.half_height, sign.x + sign.half_width,
                        sign.y + sign.half_height], fill=(245, 240, 225))
        font = _font(sign.font_size)
        left, top, right, bottom = font.getbbox(sign.text)  # the inked box, centred on the plate
        draw.text((sign.x - (left + right) / 2, sign.y - (top + bottom) / 2), sign.text, fill=(20, 20, 20), font=font)
    for shape in scene.shapes:
        draw_shape(draw, shape)
    return image


def make_scene(seed: int, index: int, size: int = IMAGE_SIZE,
               simple: bool = False) -> tuple[np.random.Generator, Scene, Image.Image]:
    """Scene `index` of split `seed` (`simple`: sample_scene's), and the generator its questions are drawn from next."""
    rng = np.random.default_rng([seed, index, 46])  # 46: not the shapes task's stream for the same (seed, index)
    scene = sample_scene(rng, size, simple)
    return rng, scene, render(scene, rng, size)


def _unique_shapes(scene: Scene) -> list[Shape]:
    """Shapes that "the <colour> <kind>" names unambiguously."""
    return [s for s in scene.shapes if sum((t.kind, t.colour) == (s.kind, s.colour) for t in scene.shapes) == 1]


def exist_question(scene: Scene, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Question:
    present = sorted({(s.kind, s.colour) for s in scene.shapes})
    if present and rng.random() < 0.5:
        kind, colour = present[int(rng.integers(len(present)))]
        return Question("exist", f"Is there a {colour} {kind}?", "yes")
    absent = [(k, c) for k in KINDS for c in COLOURS if (k, c) not in present]
    near = [(k, c) for k, c in absent if any(k == s.kind or c == s.colour for s in scene.shapes)]
    pool = near if near and rng.random() < 0.75 else absent
    kind, colour = pool[int(rng.integers(len(pool)))]
    return Question("exist", f"Is there a {colour} {kind}?", "no")


def colour_question(scene: Scene, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Question | None:
    alone = [s for s in scene.shapes if sum(t.kind == s.kind for t in scene.shapes) == 1]
    if not alone:
        return None
    shape = alone[int(rng.integers(len(alone)))]
    return Question("colour", f"What colour is the {shape.kind}?", shape.colour)


def count_question(scene: Scene, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Question:
    if rng.random() < 0.5:  # by kind, a kind in the image three times out of four so "0" does not dominate
        kinds = sorted({s.kind for s in scene.shapes}) if scene.shapes and rng.random() < 0.75 else list(KINDS)
        kind = kinds[int(rng.integers(len(kinds)))]
        return Question("count", f"How many {plural(kind)} are there?", str(sum(s.kind == kind for s in scene.shapes)))
    colours = sorted({s.colour for s in scene.shapes}) if scene.shapes and rng.random() < 0.75 else list(COLOURS)
    colour = colours[int(rng.integers(len(colours)))]
    return Question("count", f"How many {colour} shapes are there?", str(sum(s.colour == colour for s in scene.shapes)))


def position_question(scene: Scene, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Question | None:
    named = [(f"the {s.name}", s.x, s.y) for s in _unique_shapes(scene)] + [(f"the {s.name}", s.x, s.y) for s in scene.signs]
    candidates = []
    for a in named:
        if abs(a[1] - size / 2) >= MIN_GAP:
            side = "left" if a[1] < size / 2 else "right"
            candidates.append(Question("position", f"Is {a[0]} on the left or the right?", side))
        for b in named:
            if a is b:
                continue
            if abs(a[1] - b[1]) >= MIN_GAP:
                candidates.append(Question("position", f"Is {a[0]} left of {b[0]}?", "yes" if a[1] < b[1] else "no"))
            if abs(a[2] - b[2]) >= MIN_GAP:
                candidates.append(Question("position", f"Is {a[0]} above {b[0]}?", "yes" if a[2] < b[2] else "no"))
    return candidates[int(rng.integers(len(candidates)))] if candidates else None


def read_question(scene: Scene, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Question | None:
    if not scene.signs:
        return None
    sign = scene.signs[int(rng.integers(len(scene.signs)))]
    return Question("read", f"What {sign.name} is written in the image?", sign.text)


# every asker takes (scene, rng, size) and returns None when the scene cannot ask its type
ASKERS = {"exist": exist_question, "colour": colour_question, "count": count_question,
          "position": position_question, "read": read_question}


def make_example(seed: int, index: int, question_type: str | None = None, size: int = IMAGE_SIZE) -> Example:
    """Example `index` of split `seed`: a scene and one question (of `question_type`, or cycled by index).

    Types a scene cannot ask (no kind alone, nothing apart, no sign) fall back to an existence question.
    """
    wanted = question_type or QUESTION_TYPES[index % len(QUESTION_TYPES)]
    if wanted not in ASKERS:
        raise ValueError(f"unknown question type {wanted!r}; choose one of {', '.join(QUESTION_TYPES)}")
    rng, scene, image = make_scene(seed, index, size)
    question = ASKERS[wanted](scene, rng, size) or exist_question(scene, rng, size)
    return Example(image, scene, question)


def questions_for_scene(scene: Scene, rng: np.random.Generator, size: int = IMAGE_SIZE) -> list[Question]:
    """One question of every type the scene allows (training asks them as turns of one conversation)."""
    asked = [ASKERS[t](scene, rng, size) for t in QUESTION_TYPES]
    return [q for q in asked if q is not None]


def describe(scene: Scene) -> str:
    """The caption: the signs, then every shape left to right ("the digit 7, the word cat; a red circle, ...")."""
    signs = ", ".join(f"the {s.kind} {s.text}" for s in scene.signs)
    shapes = ", ".join(f"a {s.name}" for s in sorted(scene.shapes, key=lambda s: s.x))
    return "; ".join(part for part in (signs, shapes) if part)


def normalise(text: str) -> str:
    """The shapes task's normalisation (case, space, a final full stop), with number words as digits."""
    text = normalise_answer(text)
    return NUMBER_WORDS.get(text, text)


def score(records: list[tuple[str, str, str]]) -> dict:
    """Exact-match accuracy of (question type, reply, answer) records, overall and per type."""
    per_type: dict[str, list[int]] = {}
    for qtype, reply, answer in records:
        per_type.setdefault(qtype, []).append(int(normalise(reply) == normalise(answer)))
    total = sum(sum(v) for v in per_type.values())
    return {"n": len(records), "accuracy": total / len(records) if records else 0.0,
            "per_type": {t: sum(v) / len(v) for t, v in sorted(per_type.items())}}
