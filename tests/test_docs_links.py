"""Every relative Markdown link of the user-facing pages resolves inside the repository.

Pages: README.md, BENCHMARKS.md and docs/*.md. A link's file (or folder) must exist inside the
repository, so a clone carries everything its pages point at; a link with `#anchor` into a Markdown
file must name one of that file's headings, by GitHub's rule for heading anchors. Web links
(http, https, mailto) are not followed. Links inside code (fenced blocks, inline spans) are text.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text(encoding="utf-8")))
            if not re.match(r"(https?|mailto):", target)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces become hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    names = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"),
                                                          flags=re.S | re.M), re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        names.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return names


def broken(page: Path, target: str) -> str | None:
    file_part, _, anchor = target.partition("#")
    resolved = (page.parent / file_part).resolve() if file_part else page
    if ROOT not in resolved.parents and resolved != ROOT:
        return "points outside the repository"
    if not resolved.exists():
        return "no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"no heading #{anchor} in {resolved.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    problems = [f"{target}: {why}" for target in links(page) if (why := broken(page, target))]
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_anchor_rule_matches_githubs():
    assert slug("2026-12-02 — VisMMOE's ablation against `lru`, and the pinned depth") == \
        "2026-12-02--vismmoes-ablation-against-lru-and-the-pinned-depth"
    assert slug("CPU experts (kt-kernel): decode and prefill") == "cpu-experts-kt-kernel-decode-and-prefill"
    assert slug("Offloaded Q4_K batching past 3x") == "offloaded-q4_k-batching-past-3x"


def test_a_link_outside_the_repository_or_to_a_missing_file_is_caught():
    page = ROOT / "README.md"
    assert broken(page, "../shared/papers/VisMMOE.txt") == "points outside the repository"
    assert broken(page, "docs/no-such-page.md") == "no such file"
    assert broken(page, "docs/design.md#no-such-heading").startswith("no heading")
    assert broken(page, "docs/design.md#predictor") is None
