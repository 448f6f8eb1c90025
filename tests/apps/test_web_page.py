"""The web chat page in headless Chromium: a two-turn conversation about the demo picture (the history
sent with each question, Enter sends, Shift+Enter a new line, the box cleared, the image's thumbnail in
the log, the settings in the request), the Stop button, and a server that needs an API key.

Needs Debian's chromium (`.ci/run` installs it) and the playwright package (a test dependency). With
VISMMOE_KT_SCREENSHOT=PATH the two-turn conversation's screenshot is copied there (docs/web-chat.png).
"""

import os
import shutil
from contextlib import contextmanager

import pytest

from test_server import server  # noqa: F401  (the demo model behind `vismmoe-kt serve`)
from test_server_faults import WORDS, demo, make_server, running, until  # noqa: F401  (SlowWords servers)

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")),
                                 reason="Debian's chromium is not installed (.ci/run installs it)")]

CHAT = "/v1/chat/completions"


@contextmanager
def chat_page(url: str):
    """A page on `url` in headless Chromium, and the JSON bodies it sends to the chat endpoint."""
    from playwright.sync_api import sync_playwright

    sent = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or shutil.which("chromium-browser"), args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 760})
            page.on("request", lambda r: sent.append((r.post_data_json, r.headers)) if r.url.endswith(CHAT) else None)
            page.goto(url + "/")
            yield page, sent
        finally:
            browser.close()


def answered(page, turns: int) -> None:
    """Wait until `turns` answers have ended (each answer's stats line is written at its end)."""
    page.wait_for_function(f"[...document.querySelectorAll('.stats')].filter(s => s.textContent).length === {turns}",
                           timeout=60_000)


def test_a_two_turn_conversation_about_an_image(server, tmp_path):  # noqa: F811
    from vismmoe_kt.demo.pictures import make_vqa_image

    picture = tmp_path / "shapes.png"
    make_vqa_image().save(picture)  # the picture `python -m vismmoe_kt.demo.pictures` writes
    with chat_page(server) as (page, sent):
        page.wait_for_selector("#model:has-text('vismmoe-demo')")
        page.click("#settings summary")
        page.fill("#max-tokens", "8")
        page.set_input_files("#image", str(picture))
        page.wait_for_function("document.getElementById('preview').src.startsWith('data:image')")
        page.fill("#prompt", "What colour is the triangle?")
        page.press("#prompt", "Enter")  # Enter sends
        answered(page, 1)
        assert page.input_value("#prompt") == ""                       # the box is cleared
        assert page.is_hidden("#preview")                              # the image went with that question
        assert page.locator(".user").nth(0).locator("img.thumb").count() == 1
        page.type("#prompt", "What colour")
        page.press("#prompt", "Shift+Enter")                           # a new line, not a question
        assert page.input_value("#prompt") == "What colour\n" and len(sent) == 1
        page.fill("#prompt", "What colour is the square?")
        page.press("#prompt", "Enter")
        answered(page, 2)
        answers = page.locator(".assistant").all_inner_texts()
        users = page.locator(".user").all_inner_texts()
        stats = page.locator(".stats").all_inner_texts()
        shot = tmp_path / "web-chat.png"
        page.screenshot(path=str(shot))
    assert users == ["What colour is the triangle?", "What colour is the square?"]
    assert answers[0].strip() == "green" and answers[1].strip() and "error" not in " ".join(answers)
    assert all("first text after" in s and "tokens" in s for s in stats)
    first, second = (body for body, _ in sent)
    assert first["max_tokens"] == second["max_tokens"] == 8 and first["temperature"] == 0 and first["stream"]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]  # the conversation so far
    assert second["messages"][0] == first["messages"][0] and second["messages"][0]["content"][0]["type"] == "image_url"
    assert second["messages"][1]["content"] == answers[0]
    assert second["messages"][2]["content"] == "What colour is the square?"
    assert shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("VISMMOE_KT_SCREENSHOT"):
        shutil.copy(shot, os.environ["VISMMOE_KT_SCREENSHOT"])


def test_stop_aborts_the_answer_and_the_server_stops_generating(demo):  # noqa: F811
    """SlowWords holds a prompt with HOLD until it is cancelled: only the Stop button can end it."""
    engine, app, _ = make_server(demo)
    with running(app) as port, chat_page(f"http://127.0.0.1:{port}") as (page, sent):
        page.wait_for_selector("#model:has-text('vismmoe-demo')")
        page.fill("#prompt", "HOLD on")
        page.press("#prompt", "Enter")
        page.wait_for_selector("#stop:enabled")
        assert until(lambda: len(engine.runner.calls) == 1)  # generating, nothing sent back yet
        page.click("#stop")
        answered(page, 1)
        assert until(lambda: engine.runner.calls[0]["cancelled"])  # the abort reached the generation
        assert "stopped" in page.inner_text(".stats") and page.is_disabled("#stop") and page.is_enabled("#send")
        page.click("#settings summary")
        page.fill("#max-tokens", "3")
        page.fill("#prompt", "and now?")
        page.click("#send")
        answered(page, 2)
        second = page.locator(".assistant").nth(1).inner_text()
    assert second == WORDS[:len(second)] and second.strip()
    assert len(sent) == 2 and [m["content"] for m in sent[1][0]["messages"]] == ["and now?"]  # the stopped turn had no text


def test_a_server_with_an_api_key_gets_it_from_the_settings(demo):  # noqa: F811
    engine, app, _ = make_server(demo, api_key="s3cret")
    with running(app) as port, chat_page(f"http://127.0.0.1:{port}") as (page, sent):
        page.wait_for_selector("#settings[open] #keyhint.error")  # /v1/models answered 401: the page asks
        assert page.inner_text("#model") == ""
        page.fill("#key", "s3cret")
        page.wait_for_selector("#model:has-text('vismmoe-demo')")
        page.fill("#max-tokens", "2")
        page.fill("#prompt", "hello")
        page.press("#prompt", "Enter")
        answered(page, 1)
        answer = page.inner_text(".assistant")
    assert answer == WORDS[:len(answer)] and answer.strip()
    assert sent[0][1]["authorization"] == "Bearer s3cret"
