"""Instruction and chat records for fine-tuning (``gpipe train --model hf --data FILE.jsonl``): JSON
Lines, one record a line, of either kind, read from the record itself:

- ``{"prompt": "...", "completion": "..."}``: the completion is the answer;
- ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``: a chat, the
  assistant turns the answers, rendered with the tokenizer's chat template (:mod:`gpipe.data.chat`).

Strings may span many lines (JSON escapes them). A record that does not fit is refused as
``file:line: what is wrong``, or with ``skip_bad`` left out and counted by what was wrong, as
``gpipe prepare`` does for pairs. :func:`read_records` reads a file or a folder of ``.jsonl``
files (its ``eval`` sub-folder, if any, is the held-out part: :func:`split_paths`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ROLES",
    "Record",
    "RecordError",
    "is_records",
    "lines",
    "parse",
    "parse_lines",
    "read_records",
    "split_paths",
]

ROLES = ("system", "user", "assistant")
"""The roles a chat's messages may have."""

SUFFIX = ".jsonl"


class RecordError(ValueError):
    """A record that cannot be trained on: ``where`` (``file:line``) and ``kind`` (what is wrong, in
    a few words, what ``skip_bad`` counts by)."""

    def __init__(self, where: str, kind: str, detail: str = "") -> None:
        super().__init__(f"{where}: {kind}{detail}")
        self.where, self.kind, self.detail = where, kind, detail

    def __reduce__(self) -> tuple[Any, ...]:  # (raised in a worker process, as itself in the parent)
        return (type(self), (self.where, self.kind, self.detail))


@dataclass(frozen=True)
class Record:
    """One record: a prompt and its completion, or a chat's messages as (role, content) pairs."""

    where: str  # file:line
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "completion"


def is_records(path: str | os.PathLike[str]) -> bool:
    """Whether ``--data`` names instruction records: a ``.jsonl`` file, or a folder holding some."""
    p = Path(path)
    return p.suffix == SUFFIX if not p.is_dir() else any(p.glob(f"*{SUFFIX}"))


def split_paths(path: str | os.PathLike[str]) -> tuple[list[Path], list[Path]]:
    """The training files and the held-out ones of ``--data``: a file alone (its held-out part is a
    seeded tenth of it), or a folder's ``*.jsonl`` files and those of its ``eval`` sub-folder."""
    p = Path(path)
    if not p.is_dir():
        return [p], []
    train = sorted(p.glob(f"*{SUFFIX}"))
    if not train:
        raise ValueError(f"--data {str(path)!r} holds no {SUFFIX} files; give a {SUFFIX} file or a folder of them")
    return train, sorted((p / "eval").glob(f"*{SUFFIX}"))


def _text(record: dict[str, Any], key: str, where: str, what: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(where, f"{what} is not a string", f" ({key!r} holds a {type(value).__name__})")
    return value


def _chat(messages: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise RecordError(where, "no messages", ' (\'messages\' must be a list of {"role": ..., "content": ...})')
    turns = []
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RecordError(where, "a message without role or content", f" (message {i})")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise RecordError(where, "an unknown role", f" ({role!r} in message {i}; roles: {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise RecordError(where, "a content that is not a string", f" (message {i}: {type(content).__name__})")
        if role == "assistant" and not content.strip():
            raise RecordError(where, "an empty answer", f" (message {i}, the assistant's, is empty)")
        turns.append((role, content))
    if not any(role == "assistant" for role, _ in turns):
        raise RecordError(where, "no answer", " (no assistant message: nothing to learn)")
    return tuple(turns)


def parse(line: str, where: str) -> Record:
    """The record of one line (a :class:`RecordError` naming ``where`` unless it fits)."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise RecordError(where, "not JSON", f" ({exc})") from None
    if not isinstance(record, dict):
        raise RecordError(where, "not a JSON object", f" (a {type(record).__name__})")
    if "messages" in record:
        return Record(where, messages=_chat(record["messages"], where))
    if "prompt" not in record:
        shapes = '{"prompt": ..., "completion": ...} or {"messages": [...]}'
        raise RecordError(where, "no prompt", f" (a record is {shapes})")
    if "completion" not in record:
        raise RecordError(where, "no completion", ' (a prompt record needs its answer as "completion")')
    prompt, completion = (
        _text(record, "prompt", where, "the prompt"),
        _text(record, "completion", where, "the completion"),
    )
    if not completion.strip():
        raise RecordError(where, "an empty answer", " (the completion is empty)")
    return Record(where, prompt=prompt, completion=completion)


def lines(paths: list[Path]) -> Iterator[tuple[str, str]]:
    """The non-blank lines of the ``.jsonl`` files ``paths``, as (``file:line``, text), streamed."""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield f"{path}:{number}", line
        except UnicodeDecodeError as exc:
            raise RecordError(str(path), "not UTF-8", f" ({exc})") from None
        except OSError as exc:
            raise ValueError(f"cannot read the data file {str(path)!r}: {exc.strerror or exc}") from None


def parse_lines(numbered: Iterable[tuple[str, str]], *, skip_bad: bool = False) -> tuple[list[Record], Counter[str]]:
    """The records of ``numbered`` lines (``file:line``, text), and with ``skip_bad`` those left out,
    counted by what was wrong; without it the first bad record raises."""
    records: list[Record] = []
    bad: Counter[str] = Counter()
    for where, line in numbered:
        try:
            records.append(parse(line, where))
        except RecordError as exc:
            if not skip_bad:
                raise
            bad[exc.kind] += 1
    return records, bad


def read_records(paths: list[Path], *, skip_bad: bool = False) -> tuple[list[Record], Counter[str]]:
    """The records of the ``.jsonl`` files ``paths`` (blank lines ignored), and with ``skip_bad``
    those left out, counted by what was wrong; without it the first bad record raises."""
    return parse_lines(lines(paths), skip_bad=skip_bad)
