"""What a reader of prepared data checks, so that damaged files never train silently.

- **When written**, ``manifest.json`` lists every file of the folder with its size and SHA-256
  (``"files"``, as a checkpoint's manifest does: :mod:`gpipe.saving.checksums`): :func:`record_checksums`.
- **At open**, in time O(files): every file listed is there with its size (a ``.tok`` cut short is
  found before training starts), and each pair's (or split's) arrays hold the manifest's counts, their
  offsets starting at 0 and ending at the token count: :func:`check_open`.
- **As batches read it**, per :data:`BLOCK` sentences, the first time one of them is read, vectorized:
  the offsets never decrease and stay within the tokens, each source fits its pair, and each pair's
  key (its longer side, with EOS) is the one the manifest's length histogram puts at that index (the
  sentences are sorted by it): :class:`Blocks`. A garbage ``.off`` or ``.len`` of the right size is
  found at the first batch that reads it; each block costs 12 bytes a sentence to check once.
- **Whole**, ``gpipe prepare --verify PREPARED``: every checksum, then every block and every token id
  (below the vocabulary's size): :func:`verify`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gpipe.saving.checksums import ALGORITHM, FILES, _digest, _listed, _problem, _problems

__all__ = ["BLOCK", "DOCUMENTS", "Blocks", "PreparedError", "check_open", "record_checksums", "verify"]

DOCUMENTS = ("text", "records")
"""The kinds of prepared data held as documents, split into ``train`` and ``eval`` (a text file's
lines; instruction records, with a ``.ans`` mask of their answers' tokens)."""

BLOCK = 4096
"""Sentences (or documents) checked at a time, the first time a batch reads one of them."""

_TOKENS = 1 << 24  # token ids checked at a time by verify


class PreparedError(ValueError):
    """A prepared folder that cannot be read: missing or damaged files, another format, a vocabulary
    that is not the one it was prepared with (:mod:`gpipe.data.prepared` reads it)."""


def _damaged(folder: Path, what: str) -> str:
    return (
        f"{what}; check the folder whole with gpipe prepare --verify {str(folder)!r}, and prepare the data again "
        "(gpipe prepare --overwrite)"
    )


def record_checksums(folder: Path, manifest: dict[str, Any], names: Sequence[str]) -> None:
    """List the files ``names`` of ``folder`` in ``manifest`` with their sizes and digests (read in
    parallel threads)."""
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        found = dict(zip(names, pool.map(lambda n: _digest(folder / n), names)))
    manifest[FILES] = {n: {ALGORITHM: digest, "bytes": size} for n, (digest, size) in sorted(found.items())}


def _arrays(manifest: dict[str, Any]) -> list[tuple[str, int | None, int, int]]:
    """Each array set of a prepared folder: (file stem, tokens (None: a text's split, whose offsets
    end at them), offsets, lengths (0: no ``.len``, a text's splits))."""
    if manifest.get("kind") in DOCUMENTS:
        return [(split, None, int(manifest[split]) + 1, 0) for split in ("train", "eval")]
    return [
        (name, int(e["tokens"]), int(e["sentences"]) + 1, max(int(e["sentences"]), 1))
        for name, e in sorted(manifest["pairs"].items())
    ]


def check_open(folder: Path, manifest: dict[str, Any]) -> str | None:
    """What is wrong with ``folder`` that its file sizes and offsets' ends show (None: nothing)."""
    listing = _listed(manifest, folder / "manifest.json")
    if listing is not None:
        problems = [p for n, e in sorted(listing.items()) if (p := _problem(folder, n, e, read=False)) is not None]
        if problems:
            return _damaged(folder, problems[0])
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for stem, tokens, offsets, lengths in _arrays(manifest):
        expected = {".off": 8 * offsets, **({".len": 4 * lengths} if lengths else {})}
        for suffix in (".off", ".len", ".tok", ".ans"):
            path = folder / f"{stem}{suffix}"
            if suffix == ".tok":
                if tokens is None:  # (a text's split: its offsets' end)
                    tokens = int(np.memmap(folder / f"{stem}.off", dtype=np.int64, mode="r")[-1])
                expected[suffix] = max(tokens, 1) * itemsize
            if suffix == ".ans" and manifest.get("kind") == "records":  # (a record's answer mask, a byte a token)
                expected[suffix] = max(int(expected[".tok"]) // itemsize, 1)
            if suffix not in expected:
                continue
            try:
                actual = path.stat().st_size
            except OSError as exc:
                return _damaged(folder, f"{str(path)!r}: {exc.strerror or exc}")
            if actual != expected[suffix]:
                return _damaged(folder, f"{str(path)!r} holds {actual} bytes, its manifest says {expected[suffix]}: "
                                        "cut short or replaced")  # fmt: skip
        ends = np.memmap(folder / f"{stem}.off", dtype=np.int64, mode="r")[[0, -1]]
        if int(ends[0]) != 0 or int(ends[1]) != tokens:
            return _damaged(folder, f"{str(folder / (stem + '.off'))!r} starts at {int(ends[0])} and ends at "
                                    f"{int(ends[1])}, not 0 and the {tokens} tokens")  # fmt: skip
    return None


class Blocks:
    """The blocks of one pair's (or split's) arrays checked so far (see the module's docstring):
    :meth:`check` the block of index ``i`` before its first read. ``histogram``: the manifest's
    sentences per key (None: no key order to check, a text's documents, whose lengths are at most
    ``longest``)."""

    def __init__(self, folder: Path, stem: str, tokens: int, histogram: Sequence[int] | None, longest: int = 0) -> None:
        self.folder, self.stem, self.tokens, self.longest = folder, stem, tokens, longest
        self.ends = None if histogram is None else np.cumsum(np.asarray(histogram, dtype=np.int64))
        self.done: set[int] = set()

    def check(self, offsets: np.ndarray, sources: np.ndarray | None, i: int) -> None:
        block = i // BLOCK
        if block not in self.done:
            self.check_range(offsets, sources, block * BLOCK, min((block + 1) * BLOCK, len(offsets) - 1))
            self.done.add(block)

    def check_range(self, offsets: np.ndarray, sources: np.ndarray | None, a: int, b: int) -> None:
        """Check sentences ``a`` to ``b`` (excluded); raises :class:`PreparedError`."""
        off = np.asarray(offsets[a : b + 1], dtype=np.int64)
        span = np.diff(off)
        off_file, len_file = (repr(str(self.folder / f"{self.stem}{suffix}")) for suffix in (".off", ".len"))
        if off.min(initial=0) < 0 or off.max(initial=0) > self.tokens or (span < 0).any():
            bad = a + int(np.argmax((span < 0) | (off[1:] > self.tokens) | (off[1:] < 0)))
            raise PreparedError(_damaged(self.folder, f"{off_file}: the offsets of item {bad} are not increasing "
                                                      f"within the {self.tokens} tokens"))  # fmt: skip
        if sources is None:
            if self.longest and (span > self.longest).any():
                bad = a + int(np.argmax(span > self.longest))
                raise PreparedError(_damaged(self.folder, f"{off_file}: document {bad} is longer than the manifest's "
                                                          f"longest, {self.longest} tokens"))  # fmt: skip
            return
        source = np.asarray(sources[a:b], dtype=np.int64)
        target = span - source
        assert self.ends is not None
        key = np.maximum(source, target) + 1
        expected = np.searchsorted(self.ends, np.arange(a, b), side="right")
        wrong = (target < 0) | (key != expected)
        if wrong.any():
            bad = a + int(np.argmax(wrong))
            what = (
                f"{off_file} or {len_file}: sentence pair {bad} is not the one the manifest says is there (its source "
                f"{int(source[bad - a])} of {int(span[bad - a])} tokens, its length key {int(key[bad - a])}, the "
                f"manifest's {int(expected[bad - a])})"
            )
            raise PreparedError(_damaged(self.folder, what))


def verify(folder: Path, manifest: dict[str, Any], say: Callable[[str], None]) -> list[str]:
    """``gpipe prepare --verify``: every problem of the prepared ``folder``, whose manifest is
    ``manifest`` (empty: intact); ``say`` reports what was checked."""
    listing = _listed(manifest, folder / "manifest.json")
    if listing is None:
        say(f"{folder}: its manifest lists no checksums (prepared by an earlier gpipe): the structure alone is checked")
    else:
        problems = _problems(folder, listing)
        if problems:
            return problems
        say(f"{folder}: {len(listing)} files of {sum(e[2] for e in listing.values()) / 1e6:.1f} MB match their "
            "checksums")  # fmt: skip
    problem = check_open(folder, manifest)
    if problem is not None:
        return [problem]
    dtype, text = np.dtype(manifest["dtype"]), manifest.get("kind") in DOCUMENTS
    size = int(manifest["tokenizer" if text else "vocab"]["size"])
    sentences = 0
    for stem, known, count, _ in _arrays(manifest):
        offsets = np.memmap(folder / f"{stem}.off", dtype=np.int64, mode="r")
        tokens = int(offsets[-1]) if known is None else known
        sources = None if text else np.memmap(folder / f"{stem}.len", dtype=np.uint32, mode="r")
        histogram = None if text else manifest["pairs"][stem]["lengths"]
        blocks = Blocks(folder, stem, tokens, histogram, int(manifest.get("longest", 0)) if text else 0)
        try:
            for a in range(0, count - 1, 64 * BLOCK):
                blocks.check_range(offsets, sources, a, min(a + 64 * BLOCK, count - 1))
        except PreparedError as exc:
            return [str(exc)]
        ids = np.memmap(folder / f"{stem}.tok", dtype=dtype, mode="r")
        for a in range(0, int(offsets[-1]), _TOKENS):
            top = int(ids[a : a + _TOKENS].max(initial=0))
            if top >= size:
                return [_damaged(folder, f"{str(folder / (stem + '.tok'))!r} holds token id {top}, beyond the "
                                         f"vocabulary's {size}")]  # fmt: skip
        sentences += count - 1
    say(f"{folder}: {sentences} {'documents' if text else 'sentence pairs'}' offsets and lengths consistent with "
        f"the manifest, every token id below {size}")  # fmt: skip
    return []
