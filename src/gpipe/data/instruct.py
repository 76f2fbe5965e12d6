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

import torch
from torch import Tensor

from gpipe.data.base import entropy
from gpipe.data.chat import Encoded, Encoder
from gpipe.data.records import Record, RecordError, read_records, split_paths
from gpipe.data.text import Tokenizer, decode_text
from gpipe.rng import derive_seed

__all__ = ["IGNORE", "InstructionBatch", "InstructionData", "pack_rows"]

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


class InstructionData:
    """Instruction or chat records (a ``.jsonl`` file or a folder of them) as a causal LM's data:
    see the module docstring. ``length``: the most tokens a row's inputs hold (``--max-length``)."""

    unit = "tokens"
    baseline_name = "unigram entropy"
    ignore_index = IGNORE

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
        self.tokenizer, self.seed, self.pack, self.train_on_prompt = tokenizer, seed, pack, train_on_prompt
        self.bos, self.eos = tokenizer.bos, tokenizer.eos
        self.pad = next(i for i in (getattr(tokenizer, "pad", None), tokenizer.eos, 0) if i is not None)
        self.cut, self.max_length = 0, length
        self.skipped: Counter[str] = Counter()
        train_paths, eval_paths = split_paths(path)
        encoder = Encoder(tokenizer)
        train = self._encoded(train_paths, encoder, length, skip_bad)
        if eval_paths:
            held = self._encoded(eval_paths, encoder, length, skip_bad)
        else:
            if len(train) < 2:
                raise ValueError(
                    f"--data {str(path)!r} holds {len(train)} usable record(s); at least 2 are needed (train and eval)"
                )
            order = torch.randperm(
                len(train), generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0))
            ).tolist()
            count = max(len(train) // 10, 1)
            held, train = [train[i] for i in order[:count]], [train[i] for i in order[count:]]
        if not train or not held:
            raise ValueError(f"--data {str(path)!r}: no usable training or held-out records")
        longest = max(len(e.tokens) for e in (*train, *held)) - 1
        self.length = length if pack else min(length, longest)
        self.examples = {"train": train, "eval": held}
        self.rows = {split: self._rows(split) for split in self.examples}
        self.records = len(train) + len(held)

    def _encoded(self, paths: list[Any], encoder: Encoder, length: int, skip_bad: bool) -> list[Encoded]:
        records, bad = read_records(paths, skip_bad=skip_bad)
        self.skipped.update(bad)
        kept = []
        for record in records:
            try:
                kept.append(self._fitted(encoder.encode(record), record, length))
            except RecordError as exc:
                if not skip_bad:
                    raise
                self.skipped[exc.kind] += 1
        return kept

    def _fitted(self, example: Encoded, record: Record, length: int) -> Encoded:
        """``example`` within ``length`` + 1 tokens: its prompt cut from the start, never an answer."""
        over = len(example.tokens) - (length + 1)
        if over <= 0:
            return example
        if any(example.answer[:over]):
            needed = len(example.tokens) - example.answer.index(True) + 1
            raise RecordError(
                record.where,
                "an answer longer than --max-length",
                f" (from the token before its first answer to its end it holds {needed} tokens, --max-length {length} "
                f"+ 1 allows {length + 1}; the prompt alone is cut): raise --max-length, or --skip-bad",
            )
        self.cut += 1
        return Encoded(example.tokens[over:], example.answer[over:], example.where)

    def _rows(self, split: str) -> list[list[int]]:
        examples = self.examples[split]
        if not self.pack:
            return [[i] for i in range(len(examples))]
        return pack_rows(
            [len(e.tokens) - 1 for e in examples], self.length, derive_seed(self.seed, 10, split == "eval")
        )

    @property
    def vocab(self) -> int:
        return self.tokenizer.size

    def baseline(self) -> float:
        """The unigram entropy (nats) of the training targets the loss counts."""
        counts: Counter[int] = Counter()
        for e in self.examples["train"]:
            counts.update(t for t, counted in zip(e.tokens[1:], self._counted(e)) if counted)
        return entropy(counts)

    def _counted(self, example: Encoded) -> list[bool]:
        """Per target (each token but the first): whether the loss counts it."""
        return [True] * (len(example.tokens) - 1) if self.train_on_prompt else example.answer[1:]

    def batch(self, size: int, step: int, *, split: str = "train") -> InstructionBatch:
        if split not in self.rows:
            raise ValueError(f"split must be one of {sorted(self.rows)} (split: {split!r})")
        g = torch.Generator().manual_seed(derive_seed(self.seed, 0 if split == "train" else 1, step))
        rows = self.rows[split]
        picked = [rows[i] for i in torch.randint(0, len(rows), (size,), generator=g).tolist()]
        return self.make(split, picked)

    def make(self, split: str, rows: list[list[int]]) -> InstructionBatch:
        """The batch of ``rows`` (each a list of examples of ``split``, laid end to end)."""
        examples = self.examples[split]
        width = self.length if self.pack else max(len(examples[r[0]].tokens) - 1 for r in rows)
        ids, positions, targets, used = [], [], [], 0
        for row in rows:
            row_ids: list[int] = []
            row_positions: list[int] = []
            row_targets: list[int] = []
            for i in row:
                e = examples[i]
                row_ids += e.tokens[:-1]
                row_positions += range(len(e.tokens) - 1)
                row_targets += [t if c else IGNORE for t, c in zip(e.tokens[1:], self._counted(e))]
            used += len(row_ids)
            rest = width - len(row_ids)
            ids.append(row_ids + [self.pad] * rest)
            positions.append(row_positions + list(range(rest)))
            targets.append(row_targets + [IGNORE] * rest)
        inputs: Any = torch.tensor(ids)
        if self.pack:
            inputs = {"input_ids": inputs, "position_ids": torch.tensor(positions)}
        return InstructionBatch(inputs, torch.tensor(targets), 1.0 - used / (width * len(rows)))

    def sample_prompt(self) -> list[int]:
        """The first held-out example's prompt: its tokens before its first answer's."""
        e = self.examples["eval"][0]
        return e.tokens[: max(1, e.answer.index(True))]

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
