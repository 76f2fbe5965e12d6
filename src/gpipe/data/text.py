"""The data a causal language model (``gpipe train --model hf``) reads: one sequence, each token
predicting the next.

A causal LM reads one sequence where the built-in data sets hold pairs: :class:`CausalPairs` puts a
pair's source before its target, ``source + target_in``, and counts the loss on the target tokens
only (the source is a prompt: it is random, nothing could predict it). :class:`TextLines` is a plain
text file, one document a line, read with a real tokenizer (a :class:`Tokenizer`: the SentencePiece
vocabulary a run trains on it, or a local ``tokenizer.json``, see :mod:`gpipe.data.tokenizer`).
:func:`text_data` picks one for ``--data``.

Neither transformers nor SentencePiece is imported here: the tokenizer comes in, made elsewhere.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from gpipe.data.base import PAD, TranslationBatch, entropy
from gpipe.data.corpus import TextPairs
from gpipe.rng import derive_seed

__all__ = [
    "SAMPLE_PROMPT",
    "CausalBatch",
    "CausalPairs",
    "TextLines",
    "Tokenizer",
    "decode_text",
    "read_lines",
    "text_data",
]


@dataclass(frozen=True)
class CausalBatch:
    inputs: Tensor  # (B, L) token ids
    target: Tensor  # (B, L) the next token at each position; PAD where nothing is to be predicted

    @property
    def count(self) -> int:
        return int((self.target != PAD).sum())


class _Pairs(Protocol):
    unit: str
    baseline_name: str

    @property
    def vocab(self) -> int: ...

    @property
    def length(self) -> int: ...

    def baseline(self) -> float: ...

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


SAMPLE_PROMPT = 8
"""The most tokens of the held-out prompt an evaluation's sample continues (:meth:`TextLines.sample_prompt`)."""


class CausalPairs:
    """Translation pairs as one sequence each, ``source + target_in``, predicting ``target_out``
    after the source: the decoder-only form of the same task, with the same tokens counted and the
    same baseline (the targets' unigram entropy)."""

    unit = "tokens"

    def __init__(self, pairs: _Pairs) -> None:
        self.pairs = pairs
        self.baseline_name = pairs.baseline_name

    @property
    def vocab(self) -> int:
        return self.pairs.vocab

    @property
    def length(self) -> int:
        return 2 * self.pairs.length

    def baseline(self) -> float:
        return self.pairs.baseline()

    def batch(self, size: int, step: int, *, split: str = "train") -> CausalBatch:
        pair = self.pairs.batch(size, step, split=split)
        return CausalBatch(
            torch.cat([pair.source, pair.target_in], dim=1),
            torch.cat([torch.full_like(pair.source, PAD), pair.target_out], dim=1),
        )

    def sample_prompt(self) -> list[int]:
        """A held-out pair's source and the first token of its target (the language's tag): an
        evaluation's sample continues it with the translation."""
        pair = self.pairs.batch(1, 0, split="eval")
        return [*pair.source[0].tolist(), int(pair.target_in[0, 0])]

    def text(self, ids: Sequence[int]) -> str:
        """``ids`` in the pairs' words (tags and padding read nothing; EOS ends them)."""
        return self.pairs.detokenize(ids)


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    """The non-blank lines of the text file ``path``: its documents."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the data file {str(path)!r}: {exc}") from None


class Tokenizer(Protocol):
    """What :class:`TextLines` reads a text with: a SentencePiece :class:`~gpipe.data.vocab.Vocab`, or a
    :class:`~gpipe.data.tokenizer.HFTokenizer`."""

    @property
    def size(self) -> int: ...

    @property
    def bos(self) -> int | None: ...

    @property
    def eos(self) -> int | None: ...

    def encode_lines(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


def decode_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of ``ids`` read with ``tokenizer`` (special tokens read nothing). A model's vocabulary
    may be larger than its tokenizer's (``--hf-config``'s ``vocab_size``): an id the tokenizer does
    not have reads ``<id N>``, between the texts of the ids around it."""
    parts: list[str] = []
    run: list[int] = []
    for i in [*ids, None]:
        if i is not None and 0 <= i < tokenizer.size:
            run.append(int(i))
            continue
        if run:
            parts.append(tokenizer.decode(run))
            run = []
        if i is not None:
            parts.append(f"<id {i}>")
    return " ".join(part for part in parts if part)


class TextLines:
    """A text file, one document a line, read with ``tokenizer``: ``BOS pieces EOS`` (the tokenizer's
    own; a tokenizer.json's may have no BOS), cut at ``length`` + 1 tokens (or the longest line's, if
    shorter) and padded with id 0, which the loss leaves out: a tokenizer that gives id 0 to a token
    of the text is refused. A seeded tenth of the lines (at least one) is held out for the ``eval``
    split."""

    unit = "tokens"
    baseline_name = "unigram entropy"

    def __init__(self, path: str | os.PathLike[str], tokenizer: Tokenizer, *, length: int = 64, seed: int = 0) -> None:
        lines = read_lines(path)
        if len(lines) < 2:
            raise ValueError(
                f"{str(path)!r} holds {len(lines)} non-empty line(s); at least 2 are needed (train and eval)"
            )
        self.tokenizer = tokenizer
        first = [] if tokenizer.bos is None else [tokenizer.bos]
        last = [] if tokenizer.eos is None else [tokenizer.eos]
        documents = [[*first, *ids, *last] for ids in tokenizer.encode_lines(lines)]
        padding = [i for i, ids in enumerate(documents) if PAD in ids]
        if padding:
            raise ValueError(
                f"the tokenizer reads {len(padding)} line(s) of {str(path)!r} with id {PAD} (the first: "
                f"{lines[padding[0]][:60]!r}), which is gpipe's padding, left out of the loss; give a tokenizer whose "
                f"id {PAD} is a special token the text does not produce, such as a pad token"
            )
        self.bos, self.eos = tokenizer.bos, tokenizer.eos
        self.length = min(length, max(len(ids) for ids in documents) - 1)
        rows = torch.tensor([self._pad(ids) for ids in documents])
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0)))
        held = max(len(rows) // 10, 1)
        self.splits = {"eval": rows[order[:held]], "train": rows[order[held:]]}
        self.seed = seed

    @property
    def vocab(self) -> int:
        return self.tokenizer.size

    def _pad(self, ids: list[int]) -> list[int]:
        ids = ids[: self.length + 1]
        return ids + [PAD] * (self.length + 1 - len(ids))

    def baseline(self) -> float:
        """The unigram entropy (nats) of the training targets: the loss of a model ignoring its input."""
        targets = self.splits["train"][:, 1:]
        return entropy(Counter(targets[targets != PAD].tolist()))

    def batch(self, size: int, step: int, *, split: str = "train") -> CausalBatch:
        if split not in self.splits:
            raise ValueError(f"split must be one of {sorted(self.splits)} (split: {split!r})")
        g = torch.Generator().manual_seed(derive_seed(self.seed, 0 if split == "train" else 1, step))
        rows = self.splits[split]
        picked = rows[torch.randint(0, len(rows), (size,), generator=g)]
        return CausalBatch(picked[:, :-1], picked[:, 1:])

    def sample_prompt(self) -> list[int]:
        """The first held-out document's first half (BOS and pieces), at most :data:`SAMPLE_PROMPT`
        tokens and at least one: what an evaluation's sample continues."""
        document = [i for i in self.splits["eval"][0].tolist() if i != PAD]
        if self.eos is not None and document and document[-1] == self.eos:
            document = document[:-1]
        return document[: max(1, min(SAMPLE_PROMPT, len(document) // 2))]

    def text(self, ids: Sequence[int]) -> str:
        """``ids`` read with the tokenizer (:func:`decode_text`)."""
        return decode_text(self.tokenizer, ids)


def text_data(path: str, seed: int, tokenizer: Callable[[], Tokenizer]) -> CausalPairs | TextLines:
    """``--data`` for a causal LM: a file of source<TAB>target lines (every line has one tab) as
    :class:`CausalPairs` (a whitespace vocabulary, :class:`~gpipe.data.TextPairs`), any other text
    file as :class:`TextLines` read with ``tokenizer()`` (called for text only: it may train one)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the data file {path!r}: {exc}") from None
    if lines and all(line.count("\t") == 1 for line in lines):
        return CausalPairs(TextPairs(path, seed=seed))
    return TextLines(path, tokenizer(), seed=seed)
