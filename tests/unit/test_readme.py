"""README.md stays a front page: at most 180 lines, the reference material in docs/, and every link from
it to a docs page (and its section) resolving."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 180


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` dropped, spaces as ``-``."""
    heads = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_the_readme_is_at_most_180_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines: move reference material into docs/ (at most {MAX_LINES})"


def test_every_link_from_the_readme_to_a_page_of_the_repo_resolves():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)", text)
    assert links
    for page, anchor in links:
        target = REPO / page
        assert target.is_file(), page
        if anchor:
            assert anchor in anchors(target.read_text()), f"{page}#{anchor}"
