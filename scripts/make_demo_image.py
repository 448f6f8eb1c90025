"""Write a synthetic test image (shapes on a noisy background) for the demo: make_demo_image.py OUT.png [SIZE]."""

import sys

import numpy as np
from PIL import Image, ImageDraw


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
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 224
    make_image(size).save(out)
    print(out)
