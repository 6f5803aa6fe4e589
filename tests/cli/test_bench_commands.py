"""``tandem bench``'s table: each benchmark once, with its help, its parser built from its
arguments, and the dispatch reaching the command the arguments name."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import bench_commands
from tandem.cli.bench_commands import BENCH_COMMANDS, BenchCommand, run_bench
from tandem.cli.errors import CliError
from tandem.cli.main import build_parser


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = top.choices["bench"]
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_each_benchmark_is_listed_once_with_its_help_and_its_parser() -> None:
    names = [c.name for c in BENCH_COMMANDS]
    assert len(names) == len(set(names)) and all(c.help for c in BENCH_COMMANDS)
    parsers = _bench_parsers()
    assert list(parsers) == names
    for parser in parsers.values():
        options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        assert options, parser.prog


def test_the_dispatch_runs_the_named_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    table = tuple(
        BenchCommand(c.name, c.help, c.arguments, lambda args, name=c.name: ran.append(name) or 7)
        for c in BENCH_COMMANDS
    )
    monkeypatch.setattr(bench_commands, "BENCH_COMMANDS", table)
    assert run_bench(argparse.Namespace(bench_command="router")) == 7 and ran == ["router"]
    with pytest.raises(CliError, match="unknown benchmark"):
        run_bench(argparse.Namespace(bench_command="nope"))
