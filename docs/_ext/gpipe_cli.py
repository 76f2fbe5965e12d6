"""The command-line reference, drawn from the commands' own parsers at build time.

When a build starts (``builder-inited``), ``reference/cli.md`` is written from :data:`gpipe.cli.COMMANDS` and
:func:`gpipe.cli.command_parser`: for each command its one-line summary, its usage, its description and every
argument that ``gpipe COMMAND -h`` lists, each as a Sphinx ``option`` (so a page can link to one with
``{option}`gpipe train --steps```), with the help text argparse prints. The file is ignored by git and
rewritten only when its text changes (an unchanged page is not read again).

The descriptions are the commands' docstrings: ``code`` and ``:role:`target``` become code spans, indented
blocks become code blocks, and everything else is escaped so that it reads as ``-h`` prints it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

PAGE = "reference/cli.md"

# Inline code as the docstrings write it: ``code``, or a role :mod:`gpipe.x` / :func:`~gpipe.y`.
_CODE = re.compile(r"``(.+?)``|:[\w:]+:`~?(.+?)`")
# A flag in prose: --steps, -h (not the hyphen of AmoebaNet-D or K-stage).
_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z](?:[\w-]*\w)?")
# Markdown's (and MyST's) inline punctuation, escaped in plain text.
_SPECIAL = re.compile(r"([\\`*_\[\]<>{}|$#~!&^=+-])")


def _escape(text: str) -> str:
    return _SPECIAL.sub(r"\\\1", text)


def _flags(text: str, options: frozenset[str]) -> str:
    """Plain text escaped, its flags as code: a flag of the command (``options``) links to its entry."""
    out, at = [], 0
    for match in _FLAG.finditer(text):
        out.append(_escape(text[at : match.start()]))
        flag = match.group(0)
        out.append(f"{{option}}`{flag}`" if flag in options else f"`{flag}`")
        at = match.end()
    out.append(_escape(text[at:]))
    return "".join(out)


def _inline(text: str, options: frozenset[str] = frozenset()) -> str:
    """One paragraph of docstring or help text as markdown: its code spans kept, flags as code (linked to
    the command's own, ``options``), the rest escaped."""
    out, at = [], 0
    for match in _CODE.finditer(text):
        out.append(_flags(text[at : match.start()], options))
        code = match.group(1) or match.group(2)
        fence = "``" if "`" in code else "`"
        out.append(f"{fence}{code}{fence}")
        at = match.end()
    out.append(_flags(text[at:], options))
    return "".join(out)


def _prose(text: str, options: frozenset[str] = frozenset()) -> list[str]:
    """A description: paragraphs, and indented blocks (examples, ``::`` blocks) as code blocks."""
    blocks = [b for b in re.split(r"\n\s*\n", text.strip("\n")) if b.strip()]
    lines: list[str] = []
    for block in blocks:
        rows = block.splitlines()
        if all(r.startswith("    ") or not r.strip() for r in rows):
            width = min(len(r) - len(r.lstrip()) for r in rows if r.strip())
            lines += ["```text", *(r[width:] for r in rows), "```", ""]
        else:
            paragraph = " ".join(r.strip() for r in rows)
            paragraph = paragraph[:-1] if paragraph.endswith("::") else paragraph  # 'Then::' reads 'Then:'
            lines += [_inline(paragraph, options), ""]
    return lines


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as ``-h`` prints it (``%(default)s`` and the like filled in)."""
    formatter = parser._get_formatter()
    return " ".join(formatter._expand_help(action).split())


def _signature(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """``--steps N``, ``-h, --help``, ``--fsdp, --no-fsdp``, ``PATH``: the invocation ``-h`` shows."""
    formatter = parser._get_formatter()
    return formatter._format_action_invocation(action)


def _shown(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS


def command_markdown(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    """The section of one command: summary, usage, description, then each group of its arguments."""
    options = frozenset(o for a in parser._actions if _shown(a) for o in a.option_strings)
    lines = [f"(cli-{name})=", f"## gpipe {name}", "", "```{program} " + parser.prog, "```", ""]
    lines += [_inline(summary, options), "", "```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        lines += _prose(parser.description, options)
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _shown(a)]
        if not actions:
            continue
        lines += [f"### {group.title}" if group.title else "### arguments", ""]
        if group.description:
            lines += _prose(group.description, options)
        for action in actions:
            lines += ["```{option} " + _signature(parser, action), _inline(_help(parser, action), options), "```", ""]
    if parser.epilog:
        lines += _prose(parser.epilog, options)
    return lines


def reference_markdown() -> str:
    """``reference/cli.md``: ``gpipe``'s commands, then a section per command."""
    from gpipe.cli import COMMANDS, command_parser

    lines = [
        "% Generated by docs/_ext/gpipe_cli.py from the commands' parsers at each build: do not edit.",
        "",
        "# Command line",
        "",
        "`gpipe COMMAND [flags]` runs a command; `gpipe COMMAND -h` lists its flags, as below. Each command owns "
        "its parser, and this page is drawn from those parsers when the documentation is built.",
        "",
        "| command | what it does |",
        "|---|---|",
        *(f"| [`gpipe {name}`](#cli-{name}) | {_inline(summary)} |" for name, summary in COMMANDS.items()),
        "",
    ]
    for name, summary in COMMANDS.items():
        lines += command_markdown(name, summary, command_parser(name))
    return "\n".join(lines).rstrip() + "\n"


def write_reference(app: Sphinx) -> None:
    """Write ``reference/cli.md`` into the source folder, unless it holds this text already."""
    path = Path(app.srcdir) / PAGE
    text = reference_markdown()
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", write_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
