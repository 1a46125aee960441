"""The README and docs point at what exists: every relative link resolves inside the
repository (an anchor to a heading of its page), and every repository path they name in
backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        *ROOT.glob("docs/**/*.md"),
    ]
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:plugin|hooks|tests|docs|configs)/[\w./-]+)`")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings."""
    found = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"#+ (.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            found.add(text)
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_and_paths_resolve_inside_the_repository(page: Path) -> None:
    text = page.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    for path in CODE_PATH.findall(text):
        if not (ROOT / path).exists():
            broken.append(f"`{path}`: no such path")
    assert broken == []
