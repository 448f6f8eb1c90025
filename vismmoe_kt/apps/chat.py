"""`vismmoe-kt chat`: talk with a model about images, interactively or one prompt and exit.

Input habits of ktransformers' local_chat: `Chat: ` prompt, `\"\"\"` opens and closes multi-line input,
a line that is the path of a text file sends that file. After each answer, Ollama's timing lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from ..errors import InputError
from .flags import TEMPERATURE, TOP_P, add_model_flags, load_from_args

MULTILINE = '"""'


def add_parser(commands) -> None:
    chat = commands.add_parser("chat", help="chat with a model about images (interactive unless --prompt)")
    add_model_flags(chat)
    chat.add_argument("--image", action="append", default=[], help="image file for the first turn (repeatable)")
    chat.add_argument("--prompt", help="ask this and exit (non-interactive)")
    chat.add_argument("--prompt_file", help="read the (first) prompt from this file")
    chat.add_argument("--max_new_tokens", type=int, default=1000)
    chat.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    chat.add_argument("--temperature", type=TEMPERATURE)
    chat.add_argument("--top_p", type=TOP_P)
    chat.add_argument("--stats", action="store_true", help="print runtime statistics after each answer")


def read_user_turn(ask: Callable[[str], str]) -> str | None:
    """One turn of ktransformers' input habits: `\"\"\"` opens/closes multi-line input, a path reads a file."""
    while True:
        try:
            line = ask("Chat: ")
        except EOFError:
            return None
        path = line.strip()
        if not (path and not path.startswith(MULTILINE) and os.path.isfile(path)):
            break
        try:
            return Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:  # e.g. an image's path: say so and ask again, the conversation goes on
            print(f"error: {path} is not a UTF-8 text file (a path typed here is read as the prompt)", file=sys.stderr)
        except OSError as exc:
            print(f"error: {path}: {exc.strerror or exc}", file=sys.stderr)
    if line.strip().startswith(MULTILINE):
        lines = [line.strip()[len(MULTILINE):]]
        while not lines[-1].rstrip().endswith(MULTILINE):
            try:
                lines.append(ask(""))
            except EOFError:
                break
        lines[-1] = lines[-1].rstrip().removesuffix(MULTILINE)
        return "\n".join(lines).strip()
    return line


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from .images import load_image

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
        _, timings = session.ask(text, turn_images, out=out)
        print(timings.ollama_lines(), file=out)
        if args.stats:
            print(format_stats(collect_stats(model)), file=out)
        out.flush()

    if args.prompt is not None or args.prompt_file:
        answer(first_prompt, images)
        return 0
    pending = images
    while (text := read_user_turn(input)) is not None:
        if not text.strip():
            continue
        try:
            answer(text, pending)
        except InputError as exc:  # e.g. over the context: the session dropped this turn, the chat goes on
            print(f"error: {exc}", file=sys.stderr)
            continue  # the first turn's images wait for the next one
        pending = []
    return 0
