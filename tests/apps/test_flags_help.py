"""Every command's flags: help text for each, one spelling (underscores) in the help, the hyphen spelling
accepted too, defaults shown (#26)."""

import argparse
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import benchmarks
from benchmarks.bench import build_parser as bench_parser
from vismmoe_kt.apps import arguments
from vismmoe_kt.apps.cli import build_parser


def parsers(parser, path=("vismmoe-kt",)):
    """(command path, parser) for the parser and every subcommand's under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, path + (name,))


COMMANDS = [*parsers(build_parser()), *parsers(bench_parser(), ("python -m benchmarks.bench",))]
IDS = [" ".join(path) for path, _ in COMMANDS]


def flag_actions(parser):
    parser.format_help()  # spells the flags, as parsing does
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("path,parser", COMMANDS, ids=IDS)
def test_every_flag_and_subcommand_has_help(path, parser):
    missing = sorted(a.option_strings[-1] for a in flag_actions(parser) if not (a.help or "").strip())
    missing += [a.dest for a in parser._actions if not a.option_strings and not (a.help or "").strip()]
    assert missing == [], f"{' '.join(path)}: no help for {missing}"


@pytest.mark.parametrize("path,parser", COMMANDS, ids=IDS)
def test_both_spellings_of_every_flag_reach_the_same_setting(path, parser):
    for action in flag_actions(parser):
        for option in [o for o in action.option_strings if o.startswith("--")]:
            assert "-" not in option[2:], f"{' '.join(path)}: the help spells {option} with a hyphen"
            for spelling in (option, arguments.hyphened(option)):
                assert parser._option_string_actions[spelling] is action, spelling


def test_hyphen_and_underscore_spellings_parse_alike():
    hyphens = bench_parser().parse_args(["--demo", "--decode-tokens", "4", "--image-sizes", "224"])
    underscores = bench_parser().parse_args(["--demo", "--decode_tokens", "4", "--image_sizes", "224"])
    assert vars(hyphens) == vars(underscores) and hyphens.decode_tokens == 4 and hyphens.image_sizes == [224]
    chat = build_parser().parse_args(["chat", "--demo", "--max-new-tokens", "5", "--prompt-file", "q.txt", "--ep-size", "2"])
    assert (chat.max_new_tokens, chat.prompt_file, chat.ep_size) == (5, "q.txt", 2)


def test_help_shows_defaults_and_the_alias_rule(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["chat", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max_new_tokens MAX_NEW_TOKENS" in text and "(default: 1000)" in text
    assert "(default: None)" not in text and "(default: False)" not in text  # no empty defaults
    assert arguments.ALIAS_NOTE in " ".join(parser.format_help().split())


def test_an_abbreviation_of_a_flag_is_not_ambiguous_with_its_own_alias():
    assert build_parser().parse_args(["chat", "--demo", "--max_new", "7"]).max_new_tokens == 7


def test_two_flags_that_differ_only_by_separator_are_refused():
    parser = arguments.FlagParser(prog="x")
    parser.add_argument("--a_b", help="one")
    parser.add_argument("--a-b2", dest="other", help="two")
    parser.add_argument("--a-b", dest="third", help="three")
    with pytest.raises(ValueError, match="--a_b names two flags|--a-b names two flags"):
        parser.parse_args([])


# every module and package of benchmarks/ (bench/, models/ and the measurements)
BENCHMARKS = [m.name for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.")]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_measurement_modules_use_the_same_parser(name):
    """`python -m benchmarks.X` modules: the same spelling rule (their help text is their own)."""
    source = importlib.util.find_spec(name).origin
    text = open(source, encoding="utf-8").read()
    assert "argparse.ArgumentParser(" not in text
    if "add_argument(" in text and "def main(" in text:  # a command (a helper adds flags to its caller's parser)
        assert "FlagParser(" in text


def _words(text: str) -> set[str]:
    """Which of the markers of a command's parser the source holds."""
    return {marker for marker in ("add_argument(", "def main(") if marker in text}


SCRIPTS = sorted(Path(__file__).resolve().parents[2].joinpath("scripts").glob("*.py"))
STANDALONE = [name for name in BENCHMARKS if name != "benchmarks.bench"  # its parser is in COMMANDS above
              and {"add_argument(", "def main("} <= _words(open(importlib.util.find_spec(name).origin).read())]
STANDALONE += [str(p) for p in SCRIPTS if "add_argument(" in p.read_text(encoding="utf-8")]


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def standalone_parser(name, monkeypatch):
    """The parser a measurement module's or script's main() builds, caught at its parse_args (nothing runs)."""
    if name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_script_{Path(name).stem}", name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(name)

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(arguments.FlagParser, "parse_args", caught)
    monkeypatch.setattr(arguments.FlagParser, "parse_known_args", caught)
    with pytest.raises(_Parsed) as parsed:
        module.main()
    return parsed.value.parser


def test_the_standalone_commands_are_found():
    assert len(STANDALONE) >= 20 and "benchmarks.decode_bench" in STANDALONE
    assert any(name.endswith("train_demo_model.py") for name in STANDALONE)


@pytest.mark.parametrize("name", STANDALONE, ids=[Path(n).name if n.endswith(".py") else n.rsplit(".", 1)[1]
                                                   for n in STANDALONE])
def test_every_flag_of_the_measurement_modules_and_scripts_has_help(name, monkeypatch):
    """`python -m benchmarks.X` and `python scripts/X.py`: help for every flag and argument,
    underscores in the help, both spellings parsed (#26)."""
    parser = standalone_parser(name, monkeypatch)
    assert isinstance(parser, arguments.FlagParser)
    missing = sorted(a.option_strings[-1] for a in flag_actions(parser) if not (a.help or "").strip())
    missing += [a.dest for a in parser._actions if not a.option_strings and not (a.help or "").strip()]
    assert missing == [], f"{name}: no help for {missing}"
    for action in flag_actions(parser):
        for option in [o for o in action.option_strings if o.startswith("--")]:
            assert "-" not in option[2:], f"{name}: the help spells {option} with a hyphen"
            assert parser._option_string_actions[arguments.hyphened(option)] is action, option


def test_a_default_of_zero_is_shown():
    parser = arguments.FlagParser(prog="x")
    parser.add_argument("--seed", type=int, default=0, help="seed")
    parser.add_argument("--flag", action="store_true", help="a switch")
    text = " ".join(parser.format_help().split())
    assert "seed (default: 0)" in text and "(default: False)" not in text


def test_the_rules_command_and_the_placement_flag_are_covered():
    """`vismmoe-kt rules` and its actions are among the commands checked above; --placement names its choices
    on every command that takes --optimize_config_path."""
    assert {"vismmoe-kt rules", "vismmoe-kt rules list", "vismmoe-kt rules show", "vismmoe-kt rules write"} <= set(IDS)
    for path, parser in COMMANDS:
        actions = {o: a for a in flag_actions(parser) for o in a.option_strings}
        if "--optimize_config_path" in actions:
            assert "vismmoe | gpu | offload | lru | hybrid | kt-cpu | realb | ep" in actions["--placement"].help, path
