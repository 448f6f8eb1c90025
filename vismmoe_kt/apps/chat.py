"""`vismmoe-kt chat`: talk with a model about images, interactively or one prompt and exit.

Interactive input (chat_input.py): ktransformers' local_chat and `ollama run` habits (`Chat: ` prompt,
`\"\"\"` multi-line input, /image PATH or an image's path typed alone, /clear, /help, /bye); Ctrl-C stops
the answer being written. After each answer, Ollama's timing lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, TextIO

from ..errors import InputError
from .chat_input import HELP, Attach, Command, read_entry
from .flags import TEMPERATURE, TEMPERATURE_HELP, TOP_P, TOP_P_HELP, add_model_flags, load_from_args
from .images import load_image

ATTACH_HINT = "Attach one with /image PATH (or --image PATH)."


def add_parser(commands) -> None:
    chat = commands.add_parser("chat", help="chat with a model about images (interactive unless --prompt)")
    add_model_flags(chat)
    chat.add_argument("--image", action="append", default=[], help="image file for the first turn (repeatable)")
    chat.add_argument("--prompt", help="ask this and exit (non-interactive)")
    chat.add_argument("--prompt_file", help="read the (first) prompt from this file")
    chat.add_argument("--max_new_tokens", type=int, default=1000, help="the longest answer, in tokens")
    chat.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    chat.add_argument("--temperature", type=TEMPERATURE, help=TEMPERATURE_HELP)
    chat.add_argument("--top_p", type=TOP_P, help=TOP_P_HELP)
    chat.add_argument("--stats", action="store_true", help="print runtime statistics after each answer")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout

    if args.max_new_tokens < 1:
        raise InputError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.prompt is not None and args.prompt_file:
        raise InputError("give either --prompt or --prompt_file, not both")
    images = [load_image(path) for path in args.image]  # fail on a bad image before loading the model
    first_prompt = args.prompt
    if args.prompt_file:
        try:
            first_prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"--prompt_file {args.prompt_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"--prompt_file {args.prompt_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    model, processor = load_from_args(args)
    from ..engine.chat import ChatSession
    from ..core.stats import collect_stats, format_stats

    session = ChatSession(model, processor, args.max_new_tokens, args.greedy, args.temperature, args.top_p)

    def answer(text: str, turn_images: list) -> None:
        without_image = not session.images and not turn_images
        if without_image and args.demo:  # it would still answer, with a guess about a picture it never saw
            print(f"note: no image in this conversation: the demo model only answers questions about a picture, "
                  f"so this answer is a guess. {ATTACH_HINT}", file=sys.stderr)
        reply, timings = session.ask(text, turn_images, out=out)
        if not reply.strip():  # a VL model asked without a picture may end its answer at once
            print("note: the answer is empty (the model ended it at once)" +
                  (f"; no image is in this conversation. {ATTACH_HINT}" if without_image and not args.demo else "."),
                  file=sys.stderr)
        print(timings.ollama_lines(), file=out)
        if args.stats:
            print(format_stats(collect_stats(model)), file=out)
        out.flush()

    if first_prompt is not None:
        answer(first_prompt, images)
        return 0
    print("Type a question; /help lists the commands (/image PATH, /clear, /bye).", file=sys.stderr)
    return chat_loop(session, answer, input, images, out)


def chat_loop(session, answer: Callable[[str, list], None], ask: Callable[[str], str], pending: list,
              out: TextIO) -> int:
    """The interactive conversation until /bye, Ctrl-D or Ctrl-C at the prompt (all exit 0).

    `answer(text, images)` streams one answer; Ctrl-C in it (KeyboardInterrupt) stops that answer only:
    the session records a turn once it is answered, so the conversation stays as it was before the
    question, and the question's images wait for the next one."""
    pending = list(pending)
    while True:
        try:
            entry = read_entry(ask)
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as Ctrl-D does
            print(file=out)
            return 0
        if entry is None:  # Ctrl-D: end the prompt's line
            print(file=out)
            return 0
        if entry == Command("bye"):
            return 0
        if entry == Command("help"):
            print(HELP, file=out)
        elif entry == Command("clear"):
            session.clear()
            pending = []
            print("the conversation is cleared (its turns and images)", file=sys.stderr)
        elif isinstance(entry, Attach):
            pending.append(entry.image)
            width, height = entry.image.size
            print(f"attached {entry.path} ({width}x{height}): it goes with your next question", file=sys.stderr)
        elif entry.strip():
            turns = len(session.messages)
            try:
                answer(entry, pending)
            except InputError as exc:  # e.g. over the context: the session dropped this turn, the chat goes on
                print(f"error: {exc}", file=sys.stderr)
                continue  # the turn's images wait for the next one
            except KeyboardInterrupt:
                out.flush()
                if len(session.messages) > turns:  # the answer was whole (Ctrl-C came as its timings printed)
                    print("\n(interrupted after the answer; it stays in the conversation)", file=sys.stderr)
                    pending = []
                    continue
                waiting = f"; its {len(pending)} image(s) wait for the next question" if pending else ""
                print(f"\n(answer stopped: the conversation is as it was before this question{waiting})",
                      file=sys.stderr)
                continue
            pending = []
