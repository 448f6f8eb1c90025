"""Shared fixtures: tiny random Qwen3-VL-MoE models saved once per test session, and inputs for them."""

import numpy as np
import pytest
import torch
from PIL import Image

from vismmoe_kt.tiny_models import build_tiny_model, save_tiny_model

torch.set_num_threads(2)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """The demo model and any other cache go to a per-session folder, never the user's cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VISMMOE_KT_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-4x16"), "tiny-4x16", seed=0)


@pytest.fixture(scope="session")
def reference():
    """The unmodified HF model and processor, same seed as `tiny_dir`."""
    return build_tiny_model("tiny-4x16", seed=0)


def make_image(width=150, height=100, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="session")
def image_inputs(reference):
    _, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[prompt], images=[make_image()], return_tensors="pt")


@pytest.fixture
def image_file(tmp_path):
    path = tmp_path / "image.png"
    make_image(64, 48).save(path)
    return path
