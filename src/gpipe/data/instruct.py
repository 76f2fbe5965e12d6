"""Instruction and chat data for fine-tuning a causal LM (``gpipe train --model hf --data FILE.jsonl``):
the loss on the answers, and rows packed with examples.

The records (:mod:`gpipe.data.records`) are encoded with their answers marked
(:mod:`gpipe.data.chat`); the loss counts the answers' tokens only (each target that is not an
answer's is :data:`IGNORE`, transformers' -100: an id 0 in the text is a token like any other), or
every token with ``train_on_prompt``. A record longer than ``length`` + 1 tokens loses tokens from
the start of its prompt, as many as it must (the tokens nearest the answer stay); one whose answers
would lose a token is refused as too long (left out and counted with ``skip_bad``). :attr:`cut`
counts the records cut, :attr:`skipped` those left out, by what was wrong.

**Rows.** Without packing a row is one example, padded to the longest of its batch. With ``pack``
the examples are laid end to end in rows of ``length`` tokens, filled best-fit in a seeded order
(:func:`pack_rows`, deterministic): each example's positions restart at 0, and the layers, traced for
packed rows (``cached_layers(model, packed=True)``), let no example attend to another — a packed
row's loss and gradients are its examples' one per row. A batch's ``inputs`` are then
``{"input_ids", "position_ids"}``; its ``padding`` is the share of its positions holding no
example's token (the metrics' ``padding``).

The held-out part is ``DIR/eval``'s records (``--data DIR``) or a seeded tenth of them; a sample
continues the first held-out record's prompt, rendered as its chat template renders one.
"""

from __future__ import annotations

import bisect
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gpipe.data.base import entropy
from gpipe.data.chat import Encoded, Encoder
from gpipe.data.records import Record, RecordError, read_records, split_paths
from gpipe.data.text import Tokenizer, decode_text
from gpipe.rng import derive_seed

__all__ = [
    "IGNORE",
    "Documents",
    "InstructionBatch",
    "InstructionData",
    "as_arrays",
    "encode_records",
    "fitted",
    "held_out",
    "pack_rows",
]

IGNORE = -100
"""The target of a position the loss leaves out: a prompt's token, padding."""


@dataclass(frozen=True)
class InstructionBatch:
    inputs: Any  # (B, L) token ids, or with packing {"input_ids": (B, L), "position_ids": (B, L)}
    target: Tensor  # (B, L) the next token where it is an answer's, else IGNORE
    padding: float  # the share of the positions that hold no example's token

    @property
    def count(self) -> int:
        return int((self.target != IGNORE).sum())


def pack_rows(lengths: Sequence[int], capacity: int, seed: int) -> list[list[int]]:
    """The examples (their indices) of each row when examples of ``lengths`` tokens are laid end to
    end in rows of ``capacity``: taken in a seeded random order, each into the fullest row it still
    fits in (best fit), else a new row; rows in the order they were opened."""
    order = list(range(len(lengths)))
    random.Random(derive_seed(seed, 9, 0)).shuffle(order)
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"an example of {n} tokens does not fit in rows of {capacity}")
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, row))
    return rows


class Documents:
    """What in-memory and prepared records share: each split's documents as arrays (``tokens``,
    ``answer``: whether each token is an answer's, ``offsets``), their rows, batches, sample and
    summary. Set by the subclasses: ``seed``, ``pack``, ``train_on_prompt``, ``length``, ``pad``,
    ``max_length``, ``cut``, ``skipped``, ``records``, ``bos``, ``eos``."""

    unit = "tokens"
    baseline_name = "unigram entropy"
    ignore_index = IGNORE

    seed: int
    pack: bool
    train_on_prompt: bool
    length: int
    max_length: int
    pad: int
    cut: int
    records: int
    skipped: Counter[str]
    bos: int | None
    eos: int | None
    rows: dict[str, list[list[int]]]

    @property
    def tokenizer(self) -> Any:
        raise NotImplementedError

    def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``split``'s tokens, answer mask and offsets (document i is ``offsets[i]:offsets[i + 1]``)."""
        raise NotImplementedError

    def document(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Document ``index`` of ``split``: its tokens and answer mask."""
        tokens, answer, offsets = self.arrays(split)
        a, b = int(offsets[index]), int(offsets[index + 1])
        return np.asarray(tokens[a:b], dtype=np.int64), np.asarray(answer[a:b], dtype=bool)

    def _rows(self, split: str) -> list[list[int]]:
        offsets = self.arrays(split)[2]
        if not self.pack:
            return [[i] for i in range(len(offsets) - 1)]
        lengths = (np.diff(np.asarray(offsets, dtype=np.int64)) - 1).tolist()
        return pack_rows(lengths, self.length, derive_seed(self.seed, 10, split == "eval"))

    @property
    def vocab(self) -> int:
        return int(self.tokenizer.size)

    def batch(self, size: int, step: int, *, split: str = "train") -> InstructionBatch:
        if split not in self.rows:
            raise ValueError(f"split must be one of {sorted(self.rows)} (split: {split!r})")
        g = torch.Generator().manual_seed(derive_seed(self.seed, 0 if split == "train" else 1, step))
        rows = self.rows[split]
        return self.make(split, [rows[i] for i in torch.randint(0, len(rows), (size,), generator=g).tolist()])

    def make(self, split: str, rows: list[list[int]]) -> InstructionBatch:
        """The batch of ``rows`` (each a list of documents of ``split``, laid end to end)."""
        docs = [[self.document(split, i) for i in row] for row in rows]
        width = self.length if self.pack else max(len(row[0][0]) - 1 for row in docs)
        ids = np.full((len(rows), width), self.pad, dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64)
        targets = np.full((len(rows), width), IGNORE, dtype=np.int64)
        used = 0
        for r, row in enumerate(docs):
            at = 0
            for tokens, answer in row:
                n = len(tokens) - 1
                counted = answer[1:] | self.train_on_prompt
                ids[r, at : at + n] = tokens[:-1]
                positions[r, at : at + n] = np.arange(n)
                targets[r, at : at + n] = np.where(counted, tokens[1:], IGNORE)
                at += n
            positions[r, at:] = np.arange(width - at)  # (the padding: a segment of its own)
            used += at
        inputs: Any = torch.from_numpy(ids)
        if self.pack:
            inputs = {"input_ids": inputs, "position_ids": torch.from_numpy(positions)}
        return InstructionBatch(inputs, torch.from_numpy(targets), 1.0 - used / (width * len(rows)))

    def sample_prompt(self) -> list[int]:
        """The first held-out document's prompt: its tokens before its first answer's."""
        tokens, answer = self.document("eval", 0)
        first = int(np.argmax(answer)) if answer.any() else len(tokens)
        return [int(t) for t in tokens[: max(1, first)]]

    def text(self, ids: Sequence[int]) -> str:
        return decode_text(self.tokenizer, ids)

    def summary(self) -> str | None:
        """A line on the records cut or left out (None: none were)."""
        parts = []
        if self.cut:
            parts.append(
                f"{self.cut} of the {self.records} records are longer than --max-length {self.max_length} tokens: "
                "their prompts are cut from the start"
            )
        if self.skipped:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in self.skipped.most_common())
            parts.append(f"{sum(self.skipped.values())} bad records are left out (--skip-bad; {kinds})")
        return "note: " + "; ".join(parts) if parts else None


def as_arrays(examples: Sequence[Encoded]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents as the arrays :class:`Documents` reads: tokens, answer mask, offsets."""
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(e.tokens) for e in examples])
    tokens = np.fromiter((t for e in examples for t in e.tokens), dtype=np.int64, count=int(offsets[-1]))
    answer = np.fromiter((a for e in examples for a in e.answer), dtype=bool, count=int(offsets[-1]))
    return tokens, answer, offsets


def fitted(example: Encoded, length: int) -> Encoded | None:
    """``example`` within ``length`` + 1 tokens: its prompt cut from the start, never an answer (a
    :class:`RecordError` where its answers alone do not fit); None where it fits as it is."""
    over = len(example.tokens) - (length + 1)
    if over <= 0:
        return None
    if any(example.answer[:over]):
        needed = len(example.tokens) - example.answer.index(True) + 1
        raise RecordError(
            example.where,
            "an answer longer than --max-length",
            f" (from the token before its first answer to its end it holds {needed} tokens, --max-length {length} "
            f"+ 1 allows {length + 1}; the prompt alone is cut): raise --max-length, or --skip-bad",
        )
    return Encoded(example.tokens[over:], example.answer[over:], example.where)


def encode_records(
    records: Sequence[Record], encoder: Encoder, length: int, skip_bad: bool, skipped: Counter[str]
) -> tuple[list[Encoded], int]:
    """``records`` encoded and fitted to ``length`` (bad ones raise, or with ``skip_bad`` are counted
    in ``skipped``); and how many were cut."""
    kept, cut = [], 0
    for record in records:
        try:
            example = encoder.encode(record)
            shorter = fitted(example, length)
        except RecordError as exc:
            if not skip_bad:
                raise
            skipped[exc.kind] += 1
            continue
        cut += shorter is not None
        kept.append(shorter or example)
    return kept, cut


def held_out(count: int, seed: int) -> tuple[list[int], list[int]]:
    """The seeded tenth (at least one) of ``count`` documents held out, and the others: their indices."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0))).tolist()
    held = max(count // 10, 1)
    return order[:held], order[held:]


class InstructionData(Documents):
    """Instruction or chat records (a ``.jsonl`` file or a folder of them), read into memory, as a
    causal LM's data: see the module docstring. ``length``: the most tokens a row's inputs hold
    (``--max-length``)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: Tokenizer,
        *,
        length: int = 256,
        seed: int = 0,
        pack: bool = False,
        train_on_prompt: bool = False,
        skip_bad: bool = False,
    ) -> None:
        if length < 2:
            raise ValueError(f"--max-length must be at least 2 tokens for instruction data (--max-length: {length})")
        self._tokenizer, self.seed, self.pack, self.train_on_prompt = tokenizer, seed, pack, train_on_prompt
        self.bos, self.eos = tokenizer.bos, tokenizer.eos
        self.pad = next(i for i in (tokenizer.eos, 0) if i is not None)
        self.max_length = length
        self.skipped = Counter()
        train_paths, eval_paths = split_paths(path)
        encoder = Encoder(tokenizer)
        records, bad = read_records(train_paths, skip_bad=skip_bad)
        self.skipped.update(bad)
        train, self.cut = encode_records(records, encoder, length, skip_bad, self.skipped)
        if eval_paths:
            records, bad = read_records(eval_paths, skip_bad=skip_bad)
            self.skipped.update(bad)
            held, cut = encode_records(records, encoder, length, skip_bad, self.skipped)
            self.cut += cut
        else:
            if len(train) < 2:
                raise ValueError(
                    f"--data {str(path)!r} holds {len(train)} usable record(s); at least 2 are needed (train and eval)"
                )
            held_indices, train_indices = held_out(len(train), seed)
            held, train = [train[i] for i in held_indices], [train[i] for i in train_indices]
        if not train or not held:
            raise ValueError(f"--data {str(path)!r}: no usable training or held-out records")
        longest = max(len(e.tokens) for e in (*train, *held)) - 1
        self.length = length if pack else min(length, longest)
        self._arrays = {"train": as_arrays(train), "eval": as_arrays(held)}
        self.rows = {split: self._rows(split) for split in self._arrays}
        self.records = len(train) + len(held)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._arrays[split]

    def baseline(self) -> float:
        """The unigram entropy (nats) of the training targets the loss counts."""
        tokens, answer, offsets = self._arrays["train"]
        counted = answer.copy() if not self.train_on_prompt else np.ones_like(answer)
        counted[offsets[:-1]] = False  # (a document's first token is no target)
        return entropy(Counter(tokens[counted].tolist()))
