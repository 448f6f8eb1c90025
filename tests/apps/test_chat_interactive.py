"""Interactive `vismmoe-kt chat` as `ollama run` and ktransformers' local_chat: commands, images attached
by path, Ctrl-C. The loop is driven by scripted input lines (builtins.input replaced); Ctrl-C is a
KeyboardInterrupt raised through a seam (the input function, or the streamer while it writes an answer),
never a signal."""

import re

import pytest

from vismmoe_kt.apps.chat_input import Attach, Command, read_entry
from vismmoe_kt.apps.cli import main
from vismmoe_kt.demo.pictures import DEMO_QUESTIONS, make_vqa_image
from vismmoe_kt.engine import chat as engine_chat

QUESTION = "What colour is the square?"
# the demo's rule file as `make demo` runs it: offloaded layers and visual-token pruning, on the lean decode path
DEMO_RULES = ["--optimize_config_path", "optimize_rules/qwen3vl.yaml", "--set", "expert_budget=7MiB"]


def chat(*args):
    return ["chat", "--demo", "--greedy", "--max_new_tokens", "8", *map(str, args)]


def scripted(lines, interrupt_at=None):
    """An input function answering `lines` in turn, then Ctrl-D; Ctrl-C at the prompt at index `interrupt_at`."""
    it = iter(enumerate(lines + [None]))

    def ask(prompt=""):
        index, line = next(it)
        if index == interrupt_at:
            raise KeyboardInterrupt
        if line is None:
            raise EOFError
        return line
    return ask


def answers(out):
    """The answer before each block of timings (after the last prompt before it)."""
    parts = re.split(r"prompt eval count:.*?\neval rate:[^\n]*\n", out, flags=re.S)[:-1]
    return [part.rsplit("Chat: ", 1)[-1].strip() for part in parts]


def prompt_counts(out):
    return [int(n) for n in re.findall(r"prompt eval count: +(\d+)", out)]


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "my shapes.png"  # a space: a path pasted in quotes
    make_vqa_image().save(path)
    return path


# reading what is typed, no model
def test_commands_and_paths_are_told_apart(picture, tmp_path, capsys):
    assert read_entry(scripted(["/bye"])) == Command("bye")
    assert read_entry(scripted(["/clear"])) == Command("clear")
    assert read_entry(scripted(["/?"])) == Command("help") == read_entry(scripted(["  /HELP "]))
    attached = read_entry(scripted([f"'{picture}'"]))  # as a terminal pastes a path with a space
    assert isinstance(attached, Attach) and attached.image.size == (224, 224) and attached.path == picture
    assert isinstance(read_entry(scripted([f"/image {picture}"])), Attach)
    assert read_entry(scripted(["What is 1/2?"])) == "What is 1/2?"
    assert capsys.readouterr().err == ""


def test_lines_that_cannot_be_used_say_why_and_ask_again(tmp_path, capsys):
    long_name = "x" * 300 + ".png"  # longer than a file name may be
    lines = ["/image", "/nonsense", "/image nope.png", str(tmp_path / "nope.jpg"), long_name, "the question"]
    assert read_entry(scripted(lines)) == "the question"
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: /image needs a path: /image PATH",
                   "error: unknown command /nonsense (/help lists the commands)",
                   "error: image nope.png: no such file",
                   f"error: image {tmp_path / 'nope.jpg'}: no such file",
                   f"error: image {long_name}: File name too long"]


# the loop on the demo model
def test_a_typed_image_path_goes_with_the_next_question(picture, monkeypatch, capsys):
    monkeypatch.setattr("builtins.input", scripted([f"'{picture}'", QUESTION, "/help", "/bye", "never asked"]))
    assert main(chat()) == 0
    captured = capsys.readouterr()
    assert f"attached {picture} (224x224)" in captured.err
    assert answers(captured.out) == [DEMO_QUESTIONS[QUESTION]]
    assert prompt_counts(captured.out)[0] > 40  # the picture's tokens are in the prompt
    assert "/image PATH" in captured.out and "/bye" in captured.out  # /help's list
    assert "never asked" not in captured.out + captured.err


def test_clear_starts_a_new_conversation(picture, monkeypatch, capsys):
    turn = [f"/image {picture}", QUESTION]
    monkeypatch.setattr("builtins.input", scripted(turn + ["/clear"] + turn + turn))
    assert main(chat()) == 0
    captured = capsys.readouterr()
    first, after_clear, next_turn = prompt_counts(captured.out)
    assert first == after_clear < next_turn  # the cleared conversation is not in the prompt; the next turn's is
    assert answers(captured.out)[:2] == [DEMO_QUESTIONS[QUESTION]] * 2
    assert "the conversation is cleared" in captured.err


@pytest.mark.parametrize("rules", [[], DEMO_RULES], ids=["stock", "make-demo-rules"])
def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(rules, picture, monkeypatch, capsys):
    """Ctrl-C while the first answer is written: that answer stops, its picture waits for the next question,
    which is answered as if the stopped one had never been asked (on the lean path, after the engine's
    half-written cache is dropped)."""
    put, calls = engine_chat.TimingStreamer.put, []

    def interrupted_put(self, value):
        calls.append(self)
        if len(calls) == 2:  # the first generated token (the first call is the prompt)
            raise KeyboardInterrupt
        put(self, value)
    monkeypatch.setattr(engine_chat.TimingStreamer, "put", interrupted_put)
    monkeypatch.setattr("builtins.input", scripted([str(picture), QUESTION, QUESTION, "How many triangles are there?"]))
    assert main(chat(*rules)) == 0
    captured = capsys.readouterr()
    assert "(answer stopped: the conversation is as it was before this question; its 1 image(s) wait" in captured.err
    assert answers(captured.out) == [DEMO_QUESTIONS[QUESTION], DEMO_QUESTIONS["How many triangles are there?"]]
    monkeypatch.setattr(engine_chat.TimingStreamer, "put", put)
    monkeypatch.setattr("builtins.input", scripted([str(picture), QUESTION, "How many triangles are there?"]))
    assert main(chat(*rules)) == 0
    assert prompt_counts(capsys.readouterr().out) == prompt_counts(captured.out)  # as if never interrupted


def test_ctrl_c_while_a_next_turn_is_prefilled_leaves_no_half_written_cache(picture, monkeypatch, capsys):
    """On the lean path a next turn continues the engine's cache; Ctrl-C inside that prefill (here in the last
    decoder layer, after the first layers wrote the new tokens) must not leave the cache claiming them."""
    from vismmoe_kt.apps import chat as chat_app

    armed, load = [], chat_app.load_from_args

    def load_with_a_seam(args):
        model, processor = load(args)
        layer = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")][-1]

        def interrupt(module, inputs):
            if armed and inputs[0].shape[1] > 1:  # a prefill, on the armed turn
                armed.clear()
                raise KeyboardInterrupt
        layer.register_forward_pre_hook(interrupt)
        return model, processor
    monkeypatch.setattr(chat_app, "load_from_args", load_with_a_seam)
    lines = [str(picture), QUESTION, "How many triangles are there?", "What colour is the square?"]
    ask = scripted(lines)

    def ask_and_arm(prompt=""):
        line = ask(prompt)
        if line == lines[2]:
            armed.append(True)
        return line
    monkeypatch.setattr("builtins.input", ask_and_arm)
    assert main(chat(*DEMO_RULES)) == 0
    interrupted = capsys.readouterr()
    assert "(answer stopped" in interrupted.err
    monkeypatch.setattr("builtins.input", scripted([lines[0], lines[1], lines[3]]))
    assert main(chat(*DEMO_RULES)) == 0
    reference = capsys.readouterr().out
    assert answers(interrupted.out) == answers(reference) and prompt_counts(interrupted.out) == prompt_counts(reference)


def test_ctrl_c_after_the_answer_keeps_that_turn(picture, monkeypatch, capsys):
    """Ctrl-C while the timings print: the answer was whole and recorded, so it stays in the conversation."""
    lines, calls = engine_chat.TurnTimings.ollama_lines, []

    def interrupted_lines(self):
        calls.append(self)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return lines(self)
    monkeypatch.setattr(engine_chat.TurnTimings, "ollama_lines", interrupted_lines)
    monkeypatch.setattr("builtins.input", scripted([str(picture), QUESTION, QUESTION]))
    assert main(chat()) == 0
    captured = capsys.readouterr()
    assert "(interrupted after the answer; it stays in the conversation)" in captured.err
    monkeypatch.setattr(engine_chat.TurnTimings, "ollama_lines", lines)
    monkeypatch.setattr("builtins.input", scripted([str(picture), QUESTION, QUESTION]))
    assert main(chat()) == 0
    assert prompt_counts(captured.out) == prompt_counts(capsys.readouterr().out)[1:]  # the second turn carries the first


def test_ctrl_c_at_the_prompt_leaves_with_status_0(picture, monkeypatch, capsys):
    monkeypatch.setattr("builtins.input", scripted([str(picture), QUESTION, "not read"], interrupt_at=2))
    assert main(chat()) == 0
    out = capsys.readouterr().out
    assert answers(out) == [DEMO_QUESTIONS[QUESTION]] and out.endswith("\n")


def test_a_question_without_an_image_says_why_its_answer_is_empty_or_a_guess(capsys):
    assert main(chat("--prompt", QUESTION)) == 0
    captured = capsys.readouterr()
    assert "note: no image in this conversation: the demo model only answers questions about a picture" in captured.err
    assert "Attach one with /image PATH (or --image PATH)" in captured.err
    reply = captured.out[:captured.out.index("prompt eval count:")]
    if not reply.strip():  # the demo model ends at once here; the timings then say there was no decode step
        assert "note: the answer is empty" in captured.err
        assert re.search(r"eval rate: +n/a \(no decode step\)", captured.out)
