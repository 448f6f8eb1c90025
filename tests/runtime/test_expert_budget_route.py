"""`expert_budget` from the command line (`--set expert_budget=7MiB`) or a rule's kwargs to the slab
count it sizes: the rooms in between forward the rule's kwargs whole (apps/flags.py's `--set`,
core/inject.py's overrides, operators/vis_experts.py's OffloadSettings(**kwargs)), and the budget is
resolved once into the plan (runtime/offload_plan.py resolve_plan: bytes, then `num_slabs`), which
the residency and the executors read. This test holds that: the files of vismmoe_kt/ that name
`expert_budget` in their code stay few (comments and docstrings do not count).
"""

import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vismmoe_kt"
NAME = "expert_budget"
MOST = 6
# today: runtime/offload_settings.py (parsed), offload_plan.py (resolved: bytes, then slabs), offload_stats.py
# (shown), models/placement_facts.py (a family's default) and the rule generator that writes it into rule
# files (core/placements.py: the kwarg, core/rule_text.py: its comment there)


def names_it(source: str) -> bool:
    """`expert_budget` as an identifier, or as a string that is exactly it (a kwarg's key): not inside a
    comment or a longer string (a docstring, a message)."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string == NAME:
            return True
        if token.type == tokenize.STRING and token.string.strip("'\"") == NAME:
            return True
    return False


def files_naming_it() -> set[str]:
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
            if names_it(path.read_text(encoding="utf-8"))}


def test_the_scanner_counts_code_not_comments_or_docstrings():
    assert names_it("settings.expert_budget\n") and names_it("kwargs = {'expert_budget': 1}\n")
    assert not names_it('"""the expert_budget, in bytes"""\n# expert_budget\nx = "--set expert_budget=7MiB"\n')


def test_expert_budget_passes_through_few_files():
    found = files_naming_it()
    assert len(found) <= MOST, (f"{NAME} is named in {len(found)} files of vismmoe_kt/ (at most {MOST}): "
                                f"{', '.join(sorted(found))}; resolve it once into the plan "
                                "(offload_plan.resolve_plan) and pass what it resolves to")
    assert "runtime/offload_plan.py" in found  # where it becomes bytes and the slab count
