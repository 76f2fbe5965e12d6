"""The files of a folder of language pairs, read as a stream: which files make which pair
(:func:`find_pairs`), their records one at a time with their line numbers (:func:`records`), checked
as they go, and the whole pairs in memory for small data (:func:`read_pairs`).

The naming rule (also :mod:`gpipe.data.vocab`'s docstring): one parallel file per language pair,
``<src>-<tgt>.tsv`` (a ``source<TAB>target`` a line) or ``<src>-<tgt>.<src>`` + ``<src>-<tgt>.<tgt>``
(two files aligned line by line). Lines end with ``\\n`` (a ``\\r`` before it is dropped). A line blank
on both sides is skipped; any other line must be UTF-8, hold exactly one tab (``.tsv``) and text on
both sides: else it is *bad*, refused with its file and line number, or skipped and counted where the
caller says so (``gpipe prepare --skip-bad``)."""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BadLineError",
    "PairFiles",
    "Pairs",
    "Position",
    "check_eval",
    "find_pairs",
    "read_pairs",
    "record_batches",
    "records",
]

_PAIR_FILE = re.compile(r"^(?P<src>[A-Za-z0-9_]+)-(?P<tgt>[A-Za-z0-9_]+)\.(?P<ext>[A-Za-z0-9_]+)$")
NAMING = "<src>-<tgt>.tsv, or <src>-<tgt>.<src> + <src>-<tgt>.<tgt> (such as en-de.en + en-de.de)"


class BadLineError(ValueError):
    """A line that is not a sentence pair: ``file:line: what is wrong``; ``reason`` names the kind
    (``tab``, ``utf8``, ``empty``) for the counts of skipped lines."""

    def __init__(self, path: Path, line: int, what: str, reason: str) -> None:
        super().__init__(f"{path}:{line}: {what}")
        self.path, self.line, self.what, self.reason = path, line, what, reason

    def __reduce__(self) -> tuple[Any, ...]:  # (raised in a worker process, it travels pickled)
        return type(self), (self.path, self.line, self.what, self.reason)


@dataclass(frozen=True)
class PairFiles:
    """The file(s) of one language pair, ``src`` → ``tgt``: one ``.tsv``, or the source side's file
    and the target side's."""

    src: str
    tgt: str
    files: tuple[Path, ...]
    text: bool = False  # one text file, a document a line (a record's target is "")

    @property
    def name(self) -> str:
        return "text" if self.text else f"{self.src}-{self.tgt}"

    @property
    def tsv(self) -> bool:
        return len(self.files) == 1 and not self.text

    @classmethod
    def document_file(cls, path: Path) -> PairFiles:
        """A text file of documents, one a line: its records are (index, line, "")."""
        return cls("", "", (path,), text=True)


@dataclass(frozen=True)
class Position:
    """Where reading a pair's files may start: the byte offset in each file, the line number of the
    next line (1-based) and the index of the next record."""

    offsets: tuple[int, ...]
    line: int = 1
    record: int = 0


@dataclass
class Counts:
    """What a pass over a pair's files found: records, blank lines, bad lines by kind."""

    records: int = 0
    blank: int = 0
    bad: Counter[str] = field(default_factory=Counter)


def find_pairs(directory: str | os.PathLike[str]) -> dict[str, PairFiles]:
    """The language pairs of a data directory by name (``"en-de"``), sorted, from the file names
    alone (nothing is read). Raises ``ValueError`` naming the file at fault."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a directory")
    tsv: dict[tuple[str, str], Path] = {}
    halves: dict[tuple[str, str], dict[str, Path]] = {}
    for path in sorted(root.iterdir()):
        match = _PAIR_FILE.match(path.name)
        if match is None or not path.is_file():
            continue
        src, tgt, ext = match["src"], match["tgt"], match["ext"]
        if ext == "tsv":
            tsv[src, tgt] = path
        elif ext in (src, tgt):
            halves.setdefault((src, tgt), {})[ext] = path
        else:
            continue
        if src == tgt:
            raise ValueError(f"{str(path)!r}: a pair's source and target languages must differ")
    pairs: dict[str, PairFiles] = {}
    for src, tgt in sorted(set(tsv) | set(halves)):
        if (src, tgt) in tsv and (src, tgt) in halves:
            both = [tsv[src, tgt].name, *(p.name for p in halves[src, tgt].values())]
            raise ValueError(f"pair {src}-{tgt} is given twice in {str(root)!r}: {', '.join(sorted(both))}")
        if (src, tgt) in tsv:
            files: tuple[Path, ...] = (tsv[src, tgt],)
        else:
            found = halves[src, tgt]
            missing = [f"{src}-{tgt}.{lang}" for lang in (src, tgt) if lang not in found]
            if missing:
                present = next(iter(found.values())).name
                raise ValueError(f"{present} in {str(root)!r} has no other side: {missing[0]} is missing")
            files = (found[src], found[tgt])
        pairs[f"{src}-{tgt}"] = PairFiles(src, tgt, files)
    if not pairs:
        seen = sorted(p.name for p in root.iterdir())[:5]
        raise ValueError(
            f"no language pair files in {str(root)!r} (found: {', '.join(seen) or 'nothing'}); name them {NAMING}"
        )
    return pairs


def check_eval(root: Path, given: Iterable[str], pairs: Iterable[str]) -> None:
    """Refuse held-out files (``root/eval``'s pairs ``given``) of pairs that ``root`` does not have."""
    unknown = sorted(set(given) - set(pairs))
    if unknown:
        raise ValueError(
            f"{str(root / 'eval')!r} holds pairs with no training file in {str(root)!r}: {', '.join(unknown)}"
        )


def _lines(path: Path, start: int, stop: int | None) -> Iterator[bytes]:
    """The lines of ``path`` from byte ``start`` (a line's start) to ``stop`` (another's, or the end),
    each with its line end."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from None
    with f:
        f.seek(start)
        if stop is None:
            yield from f
            return
        left = stop - start
        for line in f:
            if left <= 0:
                return
            left -= len(line)
            yield line


def _text(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.rstrip(b"\n").removesuffix(b"\r").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLineError(path, number, f"not UTF-8 text ({exc.reason} at byte {exc.start})", "utf8") from None


def records(
    pair: PairFiles,
    start: Position | None = None,
    stop: Position | None = None,
    *,
    skip_bad: bool = False,
    counts: Counts | None = None,
    positions: int = 0,
    marks: list[Position] | None = None,
) -> Iterator[tuple[int, str, str]]:
    """The sentence pairs of ``pair``'s files from ``start`` to ``stop`` (default: all), as (record
    index, source, target); blank lines are skipped, a bad line raises :class:`BadLineError` unless
    ``skip_bad`` (then it is counted in ``counts.bad``). ``positions`` > 0: the :class:`Position` of
    every ``positions``-th record is appended to ``marks`` (where a worker may start)."""
    counts = counts if counts is not None else Counts()
    start = start or Position(tuple(0 for _ in pair.files))
    ends = stop.offsets if stop is not None else tuple(None for _ in pair.files)
    streams = [_lines(path, a, b) for path, a, b in zip(pair.files, start.offsets, ends)]
    offsets = list(start.offsets)
    record = start.record
    for number, raw in enumerate(itertools.zip_longest(*streams), start=start.line):
        if any(r is None for r in raw):
            short = pair.files[raw.index(None)]
            other = pair.files[1 - raw.index(None)]
            has = f"has {number - 1} lines" if number > 1 else "is empty"
            raise ValueError(
                f"{str(short)!r} {has} but {str(other)!r} has more: the two sides of a pair must be aligned line "
                "by line"
            )
        if positions and marks is not None and record % positions == 0:
            mark = Position(tuple(offsets), number, record)
            if not marks or marks[-1].record != record:
                marks.append(mark)
        for i, r in enumerate(raw):
            offsets[i] += len(r)
        try:
            texts = [_text(path, number, r) for path, r in zip(pair.files, raw)]
            if pair.text:
                if not texts[0].strip():
                    counts.blank += 1
                    continue
                source, target = texts[0], ""
            elif pair.tsv:
                if not texts[0].strip():
                    counts.blank += 1
                    continue
                parts = texts[0].split("\t")
                if len(parts) != 2:
                    what = f"expected exactly one tab (source<TAB>target), found {len(parts) - 1}"
                    raise BadLineError(pair.files[0], number, what, "tab")
                source, target = parts
            else:
                source, target = texts
                if not source.strip() and not target.strip():
                    counts.blank += 1
                    continue
            if not pair.text and (not source.strip() or not target.strip()):
                side, path = ("source", pair.files[0]) if not source.strip() else ("target", pair.files[-1])
                raise BadLineError(path, number, f"the {side} side is empty", "empty")
        except BadLineError as bad:
            if not skip_bad:
                raise
            counts.bad[bad.reason] += 1
            continue
        counts.records += 1
        yield record, source, target
        record += 1


def record_batches(
    pair: PairFiles, start: Position, stop: Position | None, *, skip_bad: bool, size: int
) -> Iterator[list[tuple[int, str, str]]]:
    """:func:`records` from ``start`` to ``stop`` in lists of ``size`` (the last may be shorter): what a
    tokenizer encodes at once."""
    batch: list[tuple[int, str, str]] = []
    for row in records(pair, start, stop, skip_bad=skip_bad):
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(frozen=True)
class Pairs:
    """The sentence pairs of one language pair, ``src`` → ``tgt``, read from ``files``."""

    src: str
    tgt: str
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    files: tuple[Path, ...]

    @property
    def name(self) -> str:
        return f"{self.src}-{self.tgt}"

    def __len__(self) -> int:
        return len(self.sources)


def read_pairs(directory: str | os.PathLike[str]) -> dict[str, Pairs]:
    """The language pairs of a data directory (:func:`find_pairs`), read whole into memory, by name,
    sorted. Raises ``ValueError`` naming the file and line at fault (a bad line, an empty pair)."""
    found = find_pairs(directory)
    pairs: dict[str, Pairs] = {}
    for name, files in found.items():
        rows = [(s, t) for _, s, t in records(files)]
        if not rows:
            raise ValueError(f"{', '.join(repr(str(p)) for p in files.files)}: no sentence pairs")
        pairs[name] = Pairs(files.src, files.tgt, tuple(s for s, _ in rows), tuple(t for _, t in rows), files.files)
    return pairs
