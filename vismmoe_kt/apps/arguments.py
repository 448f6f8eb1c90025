"""The command lines' parser: one flag spelling, defaults in the help.

Flags are spelt with underscores, as ktransformers spells them (`--max_new_tokens`); the hyphen
spelling (`--max-new-tokens`) is accepted for every flag, whichever way its command wrote it, but the
help shows only the underscore one. The help shows each flag's default where it has one.
"""

from __future__ import annotations

import argparse

ALIAS_NOTE = "Every --flag_name is also accepted as --flag-name."


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in the help, but not the empty ones (None, False, []) and not twice."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        empty = action.default is None or action.default is False or action.default == [] \
            or action.default is argparse.SUPPRESS  # by identity: a default of 0 (== False) is shown
        if empty or "default" in text.lower():
            return text
        return super()._get_help_string(action)


class RawHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter that prints the description as written (a module's docstring)."""


def underscored(option: str) -> str:
    return "--" + option[2:].replace("-", "_")


def hyphened(option: str) -> str:
    return "--" + option[2:].replace("_", "-")


def spell_flags(parser: argparse.ArgumentParser) -> None:
    """Give every long flag of `parser` its underscore spelling in the help and both spellings on the
    command line (subcommands' parsers spell their own when they parse). Runs again harmlessly."""
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs:
            continue
        shorts = [o for o in action.option_strings if not o.startswith("--")]
        shown = list(dict.fromkeys(underscored(o) for o in longs))
        action.option_strings = shorts + shown
        for spelling in {s for o in longs for s in (underscored(o), hyphened(o))}:
            taken = parser._option_string_actions.setdefault(spelling, action)
            if taken is not action:
                raise ValueError(f"{parser.prog}: {spelling} names two flags")


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser with `HelpFormatter` and both spellings of every flag (`spell_flags`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        spell_flags(self)
        return super().parse_known_args(args, namespace)

    def _get_option_tuples(self, option_string):
        # an abbreviation (`--max`) matches both spellings of one flag: that is one flag, not an ambiguity
        matches, seen = [], set()
        for match in super()._get_option_tuples(option_string):
            if id(match[0]) not in seen:
                seen.add(id(match[0]))
                matches.append(match)
        return matches

    def format_usage(self) -> str:
        spell_flags(self)
        return super().format_usage()

    def format_help(self) -> str:
        spell_flags(self)
        return super().format_help()
