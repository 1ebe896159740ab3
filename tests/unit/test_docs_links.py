"""Every relative link in the repository's Markdown resolves: the file exists and, where the
link names a heading, the heading is there under the anchor GitHub gives it.

The README and benchmarks/RESULTS.md link into each other by anchor; a heading reworded on
one side would otherwise break the other side's links without anyone noticing.
"""
from __future__ import annotations

import functools
import re
import subprocess
import unicodedata
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (word characters,
    spaces and hyphens kept), each space a hyphen."""
    text = heading.strip().lower()
    kept = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks (a '#' there is a comment, not a
    heading)."""
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield number, line


@functools.lru_cache(maxsize=None)  # a page is read once, however many links name it
def anchors(path: Path) -> frozenset:
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: Counter = Counter()
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return frozenset(found)


def markdown_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(REPO)) for p in REPO.rglob("*.md") if ".venv" not in p.parts]
    return [REPO / name for name in listed]


def relative_links(path: Path):
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            yield number, target


def test_the_slug_follows_githubs_rules():
    assert github_slug("Where dgt stands against the benchmark's targets") == \
        "where-dgt-stands-against-the-benchmarks-targets"
    assert github_slug("dgt's own CPU against the 5 % target") == "dgts-own-cpu-against-the-5--target"
    assert github_slug("2026-12-03: AlexNet time to 70 %, seeds 2–5") == \
        "2026-12-03-alexnet-time-to-70--seeds-25"
    assert github_slug("`make demo`") == "make-demo"


def test_a_repeated_heading_gets_a_numbered_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Runs\n\n```\n# not a heading\n```\n## Runs\n## Other\n", encoding="utf-8")
    assert anchors(page) == {"runs", "runs-1", "other"}


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"line {number}: {target} (no heading with that anchor)")
    return broken


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("## Kept heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](#top) [gone](#bottom) `[code](#skip)`\n"
                    "[there](other.md#kept-heading) [renamed](other.md#old-heading)\n"
                    "[missing](nowhere.md) [site](https://example.org/#x)\n", encoding="utf-8")
    assert broken_links(page) == ["line 2: #bottom (no heading with that anchor)",
                                  "line 3: other.md#old-heading (no heading with that anchor)",
                                  "line 4: nowhere.md (no such file)"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    broken = broken_links(path)
    assert not broken, f"{path.relative_to(REPO)}: " + "; ".join(broken)
