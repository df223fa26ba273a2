"""The README and docs/*.md render as written: every table row sits in a table with a header and a
separator, every relative link (and its #anchor) points at something that exists inside the
repository (never at files beside it, which a user does not have), and the README stays short."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250  # the README must stay below this
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]

FENCE = re.compile(r"^\s*(```|~~~)")
SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def cells(row: str) -> int:
    """The number of cells in a table row, as GitHub splits it (unescaped pipes)."""
    row = row.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    return len(re.split(r"(?<!\\)\|", row))


def table_problems(text: str) -> list[str]:
    """Each table row that is not part of a contiguous table whose first line is its header and
    whose second line is its separator, and each row whose cell count differs from the header's."""
    problems, block = [], []
    for number, line in [*prose_lines(text), (-1, "")]:
        if line.lstrip().startswith("|"):
            if block and block[-1][0] != number - 1:  # a fence ended the previous block
                problems += check_table(block)
                block = []
            block.append((number, line))
            continue
        if block:
            problems += check_table(block)
            block = []
    return problems


def check_table(block: list[tuple[int, str]]) -> list[str]:
    if len(block) < 2 or not SEPARATOR.match(block[1][1]) or SEPARATOR.match(block[0][1]):
        return [f"line {number}: table row outside a table with a header and a separator row: {line[:80]}"
                for number, line in block]
    width = cells(block[0][1])
    problems = [f"line {number}: {cells(line)} cells, its header has {width}: {line[:80]}"
                for number, line in block if cells(line) != width]
    problems += [f"line {number}: a second separator row inside a table" for number, line in block[2:]
                 if SEPARATOR.match(line)]
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def links(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(text):
        code_free = re.sub(r"`[^`]*`", "", line)
        found += [(number, m.group(1)) for m in INLINE_LINK.finditer(code_free)]
        match = REFERENCE_LINK.match(code_free)
        if match:
            found.append((number, match.group(1)))
    return found


def link_problems(page: Path) -> list[str]:
    problems = []
    for number, target in links(page.read_text()):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(ROOT):
            problems.append(f"line {number}: {target} points outside the repository")
        elif not resolved.exists():
            problems.append(f"line {number}: {target} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"line {number}: {target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_tables_are_whole(page):
    problems = table_problems(page.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_relative_links_resolve(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_the_checks_catch_what_they_are_for():
    """A stray row after a blank line, a header-less table, a missing file and a missing anchor are
    found; a whole table, a fenced pipe and an existing link are not."""
    broken = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert table_problems(broken) == ["line 5: table row outside a table with a header and a separator row: | 3 | 4 |"]
    assert table_problems("| a | b |\n| 1 | 2 |\n")
    assert table_problems("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n")
    assert not table_problems("| a | b |\n|:--|--:|\n| `x` | 2 |\n\n```\n| not a table\n```\n")
    assert slug("`megarl plan` and the `--json` flag") == "megarl-plan-and-the---json-flag"
    assert links("see [x](docs/cpu.md#a) and `[y](no.md)`\n```\n[z](no.md)\n```\n") == [(1, "docs/cpu.md#a")]
