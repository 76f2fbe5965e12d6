"""The built-in synthetic language pairs (:class:`SyntheticTranslation`) and the made-up words
:meth:`SyntheticTranslation.write` writes them in."""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from gpipe.data.base import EOS, HeldOut, TranslationBatch, _generator, _Translation, _translation_batch
from gpipe.recipe import temperature_sampling
from gpipe.rng import derive_seed

__all__ = ["SyntheticTranslation"]


class SyntheticTranslation(_Translation):
    """Language pairs of ``sizes`` sentences each, over ``content`` content tokens: in pair p a
    sentence of ``words`` tokens translates token by token through the pair's own permutation of
    the content tokens; both sides end with EOS and the target starts with the pair's tag.

    Pair p is named ``xs-y<letter>`` (``xs-ya`` the largest): one source language, a target
    language per pair. Training draws from each pair's ``sizes[p]`` sentences; the held-out
    sentences (``held_out`` per pair) are others. :meth:`write` writes the corpus as text files
    (made-up words), the layout ``gpipe train --data DIR`` reads."""

    baseline_split = "eval"

    def __init__(
        self,
        *,
        sizes: tuple[int, ...] = (20000, 4000, 800, 150),
        content: int = 48,
        words: int = 8,
        temperature: float = 5.0,
        held_out: int = 64,
        seed: int = 0,
    ) -> None:
        if not 1 <= len(sizes) <= 26 or min(sizes) < 1 or content < 2 or words < 1 or held_out < 1:
            raise ValueError(
                "SyntheticTranslation needs 1 to 26 pairs of at least one sentence, content >= 2, words >= 1 "
                f"and held_out >= 1 (sizes: {sizes}, content: {content}, words: {words}, held_out: {held_out})"
            )
        self.sizes, self.content, self.words, self.seed = sizes, content, words, seed
        self.held = held_out
        self.probabilities = temperature_sampling(sizes, temperature)
        g = torch.Generator().manual_seed(seed)
        self.first_content = 3 + len(sizes)  # PAD, BOS, EOS, then one tag per pair
        self.permutations = [torch.randperm(content, generator=g) for _ in sizes]
        self.targets = [f"y{chr(ord('a') + p)}" for p in range(len(sizes))]
        self.names = [f"xs-{t}" for t in self.targets]

    @property
    def vocab(self) -> int:
        return self.first_content + self.content

    @property
    def length(self) -> int:
        """Tokens of a side: the words and EOS."""
        return self.words + 1

    @property
    def pair_sizes(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    def _sentence(self, pair: int, index: int) -> Tensor:
        """Content tokens (0 .. content-1) of the pair's sentence ``index``: training sentences are
        0 .. size-1, held-out ones size .. size+held_out-1."""
        g = torch.Generator().manual_seed(derive_seed(self.seed, pair, index))
        return torch.randint(0, self.content, (self.words,), generator=g)

    def _encode(self, pairs: Sequence[int], indices: Sequence[int]) -> TranslationBatch:
        sources, targets = [], []
        for p, i in zip(pairs, indices):
            sentence = self._sentence(p, i)
            sources.append([*(sentence + self.first_content).tolist(), EOS])
            targets.append([*(self.permutations[p][sentence] + self.first_content).tolist(), EOS])
        return _translation_batch(sources, targets, [3 + p for p in pairs])

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch:
        g = _generator(self.seed, split, step)
        pairs = torch.multinomial(torch.tensor(self.probabilities), size, replacement=True, generator=g).tolist()
        draws = torch.randint(0, 2**31 - 1, (size,), generator=g).tolist()
        if split == "train":
            indices = [d % self.sizes[p] for p, d in zip(pairs, draws)]
        else:
            indices = [self.sizes[p] + d % self.held for p, d in zip(pairs, draws)]
        return self._encode(pairs, indices)

    def held_out(self) -> dict[str, HeldOut]:
        return dict(self._held_sets)

    @functools.cached_property
    def _held_sets(self) -> dict[str, HeldOut]:  # (encoded once, not at every evaluation)
        sets = {}
        for p, name in enumerate(self.names):
            indices = range(self.sizes[p], self.sizes[p] + self.held)
            batch = self._encode([p] * self.held, indices)
            references = tuple(self.detokenize(row) for row in batch.target_out.tolist())
            sets[name] = HeldOut(name, batch.source, batch.target_in, batch.target_out, references)
        return sets

    def detokenize(self, ids: Sequence[int]) -> str:
        """Content token c reads ``w<c>``; EOS ends the sentence, tags and padding read nothing."""
        words = []
        for i in ids:
            if i == EOS:
                break
            if i >= self.first_content:
                words.append(f"w{i - self.first_content}")
        return " ".join(words)

    def write(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write the corpus as text: ``xs-y?.tsv`` with each pair's training sentences and
        ``eval/xs-y?.tsv`` with its held-out ones, in made-up words (every language its own
        syllables; token c of language l always the same word). Returns the files written."""
        root = Path(directory)
        (root / "eval").mkdir(parents=True, exist_ok=True)
        lexicon = {lang: _lexicon(lang, self.content, self.seed) for lang in ["xs", *self.targets]}
        written = []
        for p, name in enumerate(self.names):
            for folder, indices in (
                (root, range(self.sizes[p])),
                (root / "eval", range(self.sizes[p], self.sizes[p] + self.held)),
            ):
                lines = []
                for i in indices:
                    sentence = self._sentence(p, i).tolist()
                    source = " ".join(lexicon["xs"][c] for c in sentence)
                    target = " ".join(lexicon[self.targets[p]][int(self.permutations[p][c])] for c in sentence)
                    lines.append(f"{source}\t{target}\n")
                path = folder / f"{name}.tsv"
                path.write_text("".join(lines), encoding="utf-8")
                written.append(path)
        return written


_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _lexicon(lang: str, size: int, seed: int) -> list[str]:
    """``size`` distinct made-up words of language ``lang``: two or three syllables (consonant,
    vowel) from the language's own consonants."""
    rng = random.Random(f"{seed}/{lang}")
    consonants = rng.sample(_CONSONANTS, 7)
    words: list[str] = []
    while len(words) < size:
        word = "".join(rng.choice(consonants) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        if word not in words:
            words.append(word)
    return words
