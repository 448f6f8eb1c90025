"""What the user types at `vismmoe-kt chat`'s prompt: a question, a command, an image to attach.

The habits of `ollama run` (`/bye`, `/clear`, `/help` or `/?`, an image's path typed alone attaches it)
and of ktransformers' local_chat (`\"\"\"` opens and closes multi-line input, the path of a text file
sends its text). A line that cannot be used (an unreadable image, an unknown command) prints
`error: ...` and the prompt asks again: nothing typed ends the conversation but `/bye` and Ctrl-D.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from ..errors import InputError
from .images import load_image

MULTILINE = '"""'
PROMPT = "Chat: "
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff"}
COMMANDS = {"/bye": "bye", "/clear": "clear", "/help": "help", "/?": "help", "/image": "image"}
HELP = f"""\
Type a question and press Enter. Commands:
  /image PATH   attach an image to the next question (typing the image's path alone does the same)
  /clear        forget the conversation: its turns and images
  /help, /?     this list
  /bye          leave (Ctrl-D too)
  {MULTILINE}           starts multi-line input, ended by a line that ends with {MULTILINE}
  the path of a text file sends that file's text
  Ctrl-C stops an answer and returns to the prompt; at the prompt it leaves."""


@dataclass(frozen=True)
class Command:
    name: str  # bye, clear, help


@dataclass(frozen=True)
class Attach:
    path: Path
    image: Any  # a decoded RGB PIL image


def unquote(text: str) -> tuple[str, bool]:
    """A path as a terminal pastes it ('quoted', "quoted", or with backslash-escaped spaces), and whether
    the text is one word once unquoted."""
    text = text.strip()
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote: take the text as it is
        return text, len(text.split()) == 1
    return (words[0], True) if len(words) == 1 else (text, False)


def typed_path(line: str) -> Path | None:
    """The file a line names, if the line is nothing but a path: an existing file, or one word that ends
    like an image (so that a mistyped image path is an error, not a question)."""
    text = line.strip()
    if not text or text.startswith(MULTILINE):
        return None
    name, one_word = unquote(text)
    path = Path(os.path.expanduser(name))
    # os.path.isfile, not Path.is_file: a long line of text is a name too long for the system, not an error
    if os.path.isfile(path) or (one_word and path.suffix.lower() in IMAGE_SUFFIXES):
        return path
    return None


def read_file_entry(path: Path) -> str | Attach:
    """An image to attach, or a text file's contents to send; InputError for anything else."""
    if path.suffix.lower() in IMAGE_SUFFIXES or not path.exists() or _is_image(path):
        return Attach(path, load_image(path))  # its InputError names the file and the problem
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path} is neither an image nor a UTF-8 text file (a typed path attaches an image "
                         "or sends a text file's contents)") from None
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None


def _is_image(path: Path) -> bool:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):
            return True
    except (UnidentifiedImageError, OSError, ValueError):
        return False


def command(line: str, err: TextIO) -> Command | Attach | None:
    """A `/command` line; None after an error printed to `err` (the prompt asks again)."""
    word, _, rest = line.strip().partition(" ")
    name = COMMANDS.get(word.lower())
    if name is None:
        print(f"error: unknown command {word} (/help lists the commands)", file=err)
        return None
    if name != "image":
        return Command(name)
    if not rest.strip():
        print("error: /image needs a path: /image PATH", file=err)
        return None
    path = Path(os.path.expanduser(unquote(rest)[0]))
    try:
        return Attach(path, load_image(path))
    except InputError as exc:
        print(f"error: {exc}", file=err)
        return None


def is_command(line: str) -> bool:
    """`/bye`, `/image x.png`, `/nonsense`: a slash and a word; `/tmp/a.png` is a path."""
    word = line.strip().split(" ", 1)[0]
    return word.startswith("/") and "/" not in word[1:]


def read_entry(ask: Callable[[str], str], err: TextIO | None = None) -> str | Command | Attach | None:
    """The next thing the user typed: question text, a Command, an image to Attach; None at Ctrl-D.
    KeyboardInterrupt (Ctrl-C at the prompt) goes to the caller."""
    err = err or sys.stderr
    while True:
        try:
            line = ask(PROMPT)
        except EOFError:
            return None
        path = typed_path(line)
        if path is not None:
            try:
                return read_file_entry(path)
            except InputError as exc:  # e.g. a corrupt image: say so, the conversation goes on
                print(f"error: {exc}", file=err)
                continue
        if is_command(line):
            entry = command(line, err)
            if entry is None:
                continue
            return entry
        if line.strip().startswith(MULTILINE):
            return read_multiline(line, ask)
        return line


def read_multiline(first: str, ask: Callable[[str], str]) -> str:
    lines = [first.strip()[len(MULTILINE):]]
    while not lines[-1].rstrip().endswith(MULTILINE):
        try:
            lines.append(ask(""))
        except EOFError:
            break
    lines[-1] = lines[-1].rstrip().removesuffix(MULTILINE)
    return "\n".join(lines).strip()
