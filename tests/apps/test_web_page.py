"""The web chat page in headless Chromium: load it, attach an image, send a prompt, see streamed text.
Needs Debian's chromium (`.ci/run` installs it) and the playwright package (a test dependency); the
screenshot is kept as docs/web-chat.png when VISMMOE_KT_SCREENSHOT names a path."""

import os
import shutil

import pytest

from conftest import make_image
from test_server import server  # noqa: F401  (the running server fixture)

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_page_streams_an_answer_about_an_image(server, tmp_path):  # noqa: F811
    from playwright.sync_api import sync_playwright

    image = tmp_path / "photo.png"
    make_image(96, 64).save(image)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 900, "height": 700})
        page.goto(server + "/")
        page.wait_for_selector("#model:has-text('vismmoe-demo')")
        page.set_input_files("#image", str(image))
        page.wait_for_function("document.getElementById('preview').src.startsWith('data:image')")
        page.fill("#prompt", "What is in this picture?")
        page.click("#send")
        page.wait_for_selector(".stats:has-text('chunks')", timeout=60_000)
        answer = page.inner_text(".assistant")
        stats = page.inner_text(".stats >> nth=-1")
        shot = tmp_path / "web-chat.png"
        page.screenshot(path=str(shot))
        browser.close()
    assert answer.strip() and "error" not in answer
    assert "first text after" in stats
    assert shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("VISMMOE_KT_SCREENSHOT"):
        shutil.copy(shot, os.environ["VISMMOE_KT_SCREENSHOT"])


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_page_asks_for_the_key_of_a_server_that_needs_one():
    from playwright.sync_api import sync_playwright

    from test_server_faults import running
    from vismmoe_kt.apps.cli import build_parser
    from vismmoe_kt.apps.serve.command import build_server

    args = build_parser().parse_args(["serve", "--demo", "--generate_device", "cpu", "--prefill_device", "cpu",
                                      "--max_new_tokens", "4", "--api_key", "s3cret"])
    with running(build_server(args)) as port, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("#keyrow:not([hidden])")  # /v1/models answered 401: the page asks
        page.fill("#key", "s3cret")
        page.dispatch_event("#key", "change")
        page.wait_for_selector("#model:has-text('vismmoe-demo')")
        page.fill("#prompt", "What is in this picture?")
        page.click("#send")
        page.wait_for_selector(".stats:has-text('chunks')", timeout=60_000)
        answer = page.inner_text(".assistant")
        browser.close()
    assert answer.strip() and "error" not in answer
