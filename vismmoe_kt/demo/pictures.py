"""The demo's pictures. `python -m vismmoe_kt.demo.pictures OUT.png` writes the demo picture and prints
the questions it was made for and their answers.

The picture is a scene of the synthetic VQA task the demo model was trained on (vismmoe_kt.demo.vqa): a red
circle, a blue square and a green triangle on a noisy background. `make_image` (shapes on noise at any size)
is the older generic test picture, which the compression and pinned-depth studies use.
"""

import sys

import numpy as np
from PIL import Image, ImageDraw

from .vqa import Shape, render

DEMO_SHAPES = [Shape("circle", "red", 30, 60, 64), Shape("square", "blue", 28, 160, 150), Shape("triangle", "green", 30, 62, 168)]
DEMO_QUESTIONS = {"What colour is the circle?": "red", "What colour is the square?": "blue", "Is there a red circle?": "yes", "Is there a red square?": "no",
                  "How many triangles are there?": "1", "Is the red circle above the green triangle?": "yes"}


def make_vqa_image(seed: int = 0) -> Image.Image:
    return render(DEMO_SHAPES, np.random.default_rng(seed))


def make_image(size: int = 224, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    noise = rng.normal(128, 24, (size, size, 3)).clip(0, 255).astype("uint8")
    image = Image.fromarray(noise)
    draw = ImageDraw.Draw(image)
    draw.ellipse([size * 0.1, size * 0.15, size * 0.45, size * 0.5], fill=(220, 40, 40))
    draw.rectangle([size * 0.55, size * 0.55, size * 0.9, size * 0.85], fill=(40, 90, 220))
    draw.polygon([(size * 0.2, size * 0.9), (size * 0.35, size * 0.6), (size * 0.5, size * 0.9)], fill=(40, 180, 60))
    return image


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "demo.png"
    make_vqa_image().save(out)
    print(out + "  (questions it was made for: " + "; ".join(f"{q} -> {a}" for q, a in DEMO_QUESTIONS.items()) + ")")
