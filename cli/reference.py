"""The CLI reference page, rendered from the parsers themselves (``build_parser``): every command,
its usage, and each option with its default and help. The docs site's hook puts it in
``docs/reference/cli.md``, so the page cannot drift from the flags."""

from __future__ import annotations

import argparse

from tandem.cli.main import build_parser


def _commands(
    parser: argparse.ArgumentParser, path: list[str]
) -> list[tuple[list[str], str, argparse.ArgumentParser]]:
    """``(words, help, parser)`` of every command below ``parser``, depth first."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                out.append(([*path, name], helps.get(name, ""), sub))
                out += _commands(sub, [*path, name])
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    """The action's help as ``--help`` prints it (``%(default)s`` and the like filled in)."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    try:
        return action.help % {**vars(action), "prog": "tandem"}
    except (KeyError, ValueError, TypeError):
        return action.help


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
        if action.choices is not None:
            names += " {" + ", ".join(str(c) for c in action.choices) + "}"
        default = action.default
        shown = "" if default in (None, argparse.SUPPRESS) or action.required else f"`{default}`"
        help_text = _help(action)
        rows.append(f"| {names} | {shown} | {_cell(help_text)} |")
    return rows


def cli_reference() -> str:
    """The page's Markdown (its title is the page's own)."""
    parser = build_parser()
    parts = [
        "Every command of `tandem`, as `tandem COMMAND --help` prints it, rendered from the parsers.",
        "",
    ]
    for words, help_text, sub in _commands(parser, ["tandem"]):
        parts += [f"## {' '.join(words)}", ""]
        if help_text:
            parts += [_cell(help_text), ""]
        usage = sub.format_usage().removeprefix("usage: ").strip()
        parts += ["```text", usage, "```", ""]
        rows = _option_rows(sub)
        if rows:
            parts += ["| option | default | what |", "|---|---|---|", *rows, ""]
    return "\n".join(parts)
