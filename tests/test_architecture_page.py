"""``docs/architecture.md`` stays true: every file its request's-path section names exists, the
line counts of that section's table are within 10% of the files' (``wc -l``), and every module
line of its Modules section names a file that exists (``tests/test_layout.py`` checks the other
way: every module has a line)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def _section(title: str) -> str:
    start = PAGE.index(f"\n## {title}")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start : end if end != -1 else None]


def _lines(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


def test_the_request_path_table_counts_each_file_within_ten_percent() -> None:
    rows = re.findall(r"^\| `([\w/]+\.py)` \| (\d+) \|", _section("A request's path, file by file"), re.M)
    assert len(rows) >= 20
    off = {
        path: (int(count), _lines(path))
        for path, count in rows
        if not (ROOT / path).is_file() or abs(int(count) - _lines(path)) > 0.1 * _lines(path)
    }
    assert not off, f"(page, file) line counts off by more than 10%: {off}"
    total = re.search(r"these (\d+) files, ([\d,]+) lines together", PAGE)
    assert total is not None and int(total.group(1)) == len(rows)
    counted = int(total.group(2).replace(",", ""))
    actual = sum(_lines(path) for path, _ in rows)
    assert abs(counted - actual) <= 0.1 * actual, (counted, actual)


def test_every_file_the_request_path_names_exists() -> None:
    named = set(re.findall(r"\b((?:[a-z_]+/)+[a-z_]+\.py)\b", _section("A request's path, file by file")))
    assert named
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md's request path names missing files: {missing}"


def test_every_module_line_names_a_file_that_exists() -> None:
    named = re.findall(r"^- `((?:[a-z_]+/)+[a-z_]+\.py)`", _section("Modules"), re.M)
    assert len(named) > 100
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md has lines for modules that are gone: {missing}"
