"""Shared fixtures: tiny random Qwen3-VL-MoE models saved once per test session, and inputs for them."""

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image

from vismmoe_kt.demo.tiny import build_tiny_model, save_tiny_model

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


def layer_bytes(spec):
    """GPU memory for one layer of a tiny (fp32) model's experts: the unit of expert budgets in tests."""
    return spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4


def tiny_case(tmp_path_factory, name, seed, question, image_size, image_seed):
    """A saved tiny model, its reference model and an image prompt for it."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp(name), name, seed=seed)
    ref, processor = build_tiny_model(name, seed=seed)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[make_image(*image_size, seed=image_seed)], return_tensors="pt")
    return model_dir, ref, inputs


def run_eager(model, inputs, module, hook) -> None:
    """`model(**inputs)` with transformers' eager attention (which forms the attention weights), `hook` (a forward
    hook with kwargs) on `module` meanwhile; the model's attention implementation restored after."""
    handle = module.register_forward_hook(hook, with_kwargs=True)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
        model.set_attn_implementation(previous)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(app, log_level: str = "warning"):
    """An ASGI app served by uvicorn on a thread, on a free loopback port: yields the port."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def serve_in_thread(serve_args: list[str]):
    """`vismmoe-kt serve ARGS` in this process: yields its base URL, stops it after."""
    from vismmoe_kt.apps.cli import build_parser
    from vismmoe_kt.apps.serve.command import build_server

    app = build_server(build_parser().parse_args(["serve", *serve_args]))
    with running_app(app) as port:
        yield f"http://127.0.0.1:{port}"


# --- Triton kernels without a GPU --------------------------------------------------------------------
UNDER_INTERPRETER = bool(__import__("os").environ.get("TRITON_INTERPRET"))


def run_in_triton_interpreter(script: str, timeout: int = 300) -> None:
    """Run `script` in a fresh process under Triton's interpreter (chosen when kernels are defined, so
    not in this one); it must print "OK" last."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def compile_for_hopper(kernel, signature: dict, constants: dict, aligned: tuple[str, ...] = (), **options):
    """Triton's front end and ptxas on `kernel` for sm_90 (what the interpreter does not check). `aligned`:
    arguments to compile as a launch specializes them (a pointer 16-byte aligned, an integer a multiple of
    16), so the PTX shows the loads a launch gets."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs or None),
                          target=GPUTarget("cuda", 90, 32), options=options or None)
