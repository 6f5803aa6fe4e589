"""How big Tandem's code is, measured one way: modules and lines, files over 600 lines, classes
over 350, functions over 80, and blocks of code that stand twice word for word. Kernels
(``model/kernels``) and generated code (``protos/*_pb2*``) are left out of the limits, tests and
the benchmarks out of the duplicate count. ``python scripts/code_size.py [--json]``."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "autoscaler", "bench", "cli", "client", "cluster", "decode", "engine", "frontend",
    "kvtransfer", "metrics", "model", "prefill", "protos", "router", "wire",
)  # fmt: skip
FILE_LIMIT, CLASS_LIMIT, FUNCTION_LIMIT = 600, 350, 80
BLOCK = 6  # lines that make a duplicated block


@dataclass
class Sizes:
    modules: int = 0
    lines: int = 0
    files_over: dict[str, int] = field(default_factory=dict)
    classes_over: dict[str, int] = field(default_factory=dict)
    functions_over: dict[str, int] = field(default_factory=dict)
    duplicates: list[str] = field(default_factory=list)


def _exempt(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return rel.startswith("model/kernels/") or "_pb2" in path.name


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _spans(tree: ast.AST, rel: str, sizes: Sizes) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef) and length > CLASS_LIMIT:
                sizes.classes_over[f"{rel}:{node.name}"] = length
            elif not isinstance(node, ast.ClassDef) and length > FUNCTION_LIMIT:
                sizes.functions_over[f"{rel}:{node.name}"] = length


def _duplicates(files: dict[str, list[str]]) -> list[str]:
    """Runs of ``BLOCK`` lines (stripped, blanks and comments dropped) standing in two places."""
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for rel, lines in files.items():
        code = [(n, line.strip()) for n, line in enumerate(lines, 1)]
        code = [(n, s) for n, s in code if s and not s.startswith("#")]
        for i in range(len(code) - BLOCK + 1):
            window = tuple(s for _, s in code[i : i + BLOCK])
            if sum(len(s) for s in window) < 120:  # brackets and short keywords are not code
                continue
            seen[window].append((rel, code[i][0]))
    pairs: dict[tuple[str, str], int] = {}
    for places in seen.values():
        if len(places) > 1:
            (a, la), (b, lb) = places[0], places[1]
            pairs.setdefault((f"{a}:{la}", f"{b}:{lb}"), 0)
    # a long duplicated run makes many overlapping windows: keep the first of each run
    out: list[str] = []
    last: dict[tuple[str, str], int] = {}
    for a, b in sorted(pairs):
        fa, la = a.rsplit(":", 1)
        fb, lb = b.rsplit(":", 1)
        key = (fa, fb)
        if key in last and 0 < int(la) - last[key] <= BLOCK:
            last[key] = int(la)
            continue
        last[key] = int(la)
        out.append(f"{a} ~ {b}")
    return out


def measure() -> Sizes:
    sizes = Sizes()
    dup_files: dict[str, list[str]] = {}
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        sizes.modules += 1
        sizes.lines += len(lines)
        if _exempt(path):
            continue
        if len(lines) > FILE_LIMIT:
            sizes.files_over[rel] = len(lines)
        _spans(ast.parse(text), rel, sizes)
        if not rel.startswith("bench/"):
            dup_files[rel] = lines
    sizes.duplicates = _duplicates(dup_files)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    sizes = measure()
    if args.json:
        json.dump(asdict(sizes), sys.stdout, indent=1)
        print()
        return
    print(f"modules {sizes.modules}, lines {sizes.lines}")
    for title, found in (
        (f"files over {FILE_LIMIT} lines", sizes.files_over),
        (f"classes over {CLASS_LIMIT} lines", sizes.classes_over),
        (f"functions over {FUNCTION_LIMIT} lines", sizes.functions_over),
    ):
        print(f"{title}: {len(found)}")
        for name, length in sorted(found.items(), key=lambda kv: -kv[1]):
            print(f"  {length:5d} {name}")
    print(f"duplicated blocks of {BLOCK}+ lines: {len(sizes.duplicates)}")
    for pair in sizes.duplicates:
        print(f"  {pair}")


if __name__ == "__main__":
    main()
