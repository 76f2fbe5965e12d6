"""What every command shares: the usage error that ends a command with one line and exit status 2,
and an ``argparse`` parser that raises it.

Below every command (``gpipe train``, ``translate``, ``bench``, the small ones in
:mod:`gpipe.commands`) and the dispatcher :mod:`gpipe.cli`; imports nothing of gpipe.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

__all__ = ["ArgumentParser", "UsageError", "description", "positive", "refuse"]


class UsageError(ValueError):
    """A bad flag or setting, found before any work starts: the commands print it as one line
    ``error: ...`` and exit with status 2. (Other exceptions keep their traceback: they are bugs.)"""


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose errors are a :class:`UsageError` (one line, no usage dump)
    instead of ``SystemExit``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} -h)")


def description(doc: str | None) -> str | None:
    """A command module's docstring as its ``-h`` text (with ``RawDescriptionHelpFormatter``, which
    keeps the example lines as written): the reST markup left out, ``name`` for ````name```` and
    ``:mod:`name```."""
    return None if doc is None else re.sub(r"(?::[a-z]+:)?`+([^`]+)`+", r"\1", doc)


def refuse(error: BaseException | str) -> int:
    """Print ``error`` as the one line ``error: ...`` on standard error; the exit status 2."""
    print(f"error: {error}", file=sys.stderr)
    return 2


def positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse any of the flags ``names`` (set on ``args``) that is not positive."""
    for name in names:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive (got {getattr(args, name)})")
