"""Data for ``gpipe train``, nothing to download.

:class:`SyntheticTranslation` is a small multilingual "translation" corpus made up on the spot:
several language pairs of very different sizes; in pair p a sentence of content tokens translates
token by token through the pair's own permutation of the vocabulary, and the target starts with the
pair's tag. Pairs are drawn with temperature-based sampling (:func:`gpipe.recipe.temperature_sampling`,
T=5 by default), so the small pairs are seen far more often than their share.

:class:`TextPairs` reads real pairs from a tab-separated file (source<TAB>target per line), with a
whitespace vocabulary built from the file.

Batches are a pure function of (seed, step): a run resumed at step N sees exactly the batches an
uninterrupted run sees.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from gpipe.recipe import temperature_sampling
from gpipe.rng import derive_seed

__all__ = ["SyntheticTranslation", "TextPairs", "TranslationBatch"]

PAD, BOS, EOS = 0, 1, 2
_SPLITS = {"train": 0, "eval": 1}


def _generator(seed: int, split: str, step: int) -> torch.Generator:
    """The generator of one batch: a pure function of (seed, split, step), the same in every process."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {sorted(_SPLITS)} (split: {split!r})")
    return torch.Generator().manual_seed(derive_seed(seed, _SPLITS[split], step))


@dataclass(frozen=True)
class TranslationBatch:
    source: Tensor  # (B, S) token ids
    target_in: Tensor  # (B, T) the target shifted right, starting with the pair's tag
    target_out: Tensor  # (B, T) what the decoder must predict

    @property
    def inputs(self) -> tuple[Tensor, Tensor]:
        return self.source, self.target_in

    @property
    def tokens(self) -> int:
        return int((self.target_out != PAD).sum())


class SyntheticTranslation:
    """``pairs`` language pairs with ``sizes`` sentences each, over ``content`` content tokens."""

    def __init__(
        self,
        *,
        sizes: tuple[int, ...] = (20000, 4000, 800, 150),
        content: int = 48,
        length: int = 8,
        temperature: float = 5.0,
        seed: int = 0,
    ) -> None:
        self.sizes, self.content, self.length, self.seed = sizes, content, length, seed
        self.probabilities = temperature_sampling(sizes, temperature)
        g = torch.Generator().manual_seed(seed)
        self.first_content = 3 + len(sizes)  # PAD, BOS, EOS, then one tag per pair
        self.permutations = [torch.randperm(content, generator=g) for _ in sizes]

    @property
    def vocab(self) -> int:
        return self.first_content + self.content

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the target tokens' unigram distribution: the loss of a model that
        ignores its input."""
        counts = Counter[int]()
        for step in range(20):
            counts.update(self.batch(64, step, split="eval").target_out.flatten().tolist())
        total = sum(counts.values())
        return -sum(c / total * math.log(c / total) for c in counts.values())

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch:
        g = _generator(self.seed, split, step)
        pairs = torch.multinomial(torch.tensor(self.probabilities), size, replacement=True, generator=g)
        # a sentence is one of the pair's `size` sentences: its index seeds its tokens
        sentence = torch.randint(0, 2**31 - 1, (size,), generator=g)
        src = torch.empty(size, self.length, dtype=torch.long)
        for i, (p, s) in enumerate(zip(pairs.tolist(), sentence.tolist())):
            sentence_generator = torch.Generator().manual_seed(derive_seed(self.seed, p, s % self.sizes[p]))
            src[i] = torch.randint(0, self.content, (self.length,), generator=sentence_generator)
        tgt = torch.stack([self.permutations[p][row] for p, row in zip(pairs.tolist(), src)])
        tag = (3 + pairs).unsqueeze(1)
        target = tgt + self.first_content
        return TranslationBatch(
            source=src + self.first_content,
            target_in=torch.cat([tag, target[:, :-1]], dim=1),
            target_out=target,
        )


class TextPairs:
    """Pairs of sentences from a tab-separated file, tokenized on white space."""

    def __init__(self, path: str | os.PathLike[str], *, length: int = 32, seed: int = 0) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the data file {str(path)!r}: {exc}") from None
        bad = [i + 1 for i, parts in enumerate(lines) if len(parts) != 2]
        if not lines or bad:
            where = f"line {bad[0]} has no single tab" if bad else "it is empty"
            raise ValueError(f"{str(path)!r} is not a file of source<TAB>target lines: {where}")
        words = sorted({w for pair in lines for side in pair for w in side.split()})
        self.index = {w: i + 3 for i, w in enumerate(words)}
        self.pairs = [(self._encode(s, length), self._encode(t, length)) for s, t in lines]
        self.length, self.seed = length, seed

    @property
    def vocab(self) -> int:
        return len(self.index) + 3

    def _encode(self, text: str, length: int) -> list[int]:
        ids = [*[self.index[w] for w in text.split()][: length - 1], EOS]
        return ids + [PAD] * (length - len(ids))

    def unigram_entropy(self) -> float:
        counts = Counter(t for _, tgt in self.pairs for t in tgt if t != PAD)
        total = sum(counts.values())
        return -sum(c / total * math.log(c / total) for c in counts.values())

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch:
        g = _generator(self.seed, split, step)
        rows = torch.randint(0, len(self.pairs), (size,), generator=g).tolist()
        src = torch.tensor([self.pairs[r][0] for r in rows])
        tgt = torch.tensor([self.pairs[r][1] for r in rows])
        bos = torch.full((size, 1), BOS)
        return TranslationBatch(src, torch.cat([bos, tgt[:, :-1]], dim=1), tgt)
