"""Translation data read from files: :class:`ParallelCorpus` (a folder of language pairs, one shared
SentencePiece vocabulary) and :class:`TextPairs` (one tab-separated file, a whitespace vocabulary)."""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from gpipe.data.base import (
    BOS,
    EOS,
    PAD,
    HeldOut,
    TranslationBatch,
    _generator,
    _Translation,
    _translation_batch,
    entropy,
)
from gpipe.data.vocab import Vocab, read_pairs
from gpipe.recipe import temperature_sampling
from gpipe.rng import derive_seed

__all__ = ["ParallelCorpus", "TextPairs"]


class ParallelCorpus(_Translation):
    """Every language pair of a data directory (see :func:`gpipe.data.vocab.read_pairs` for the file
    names), encoded with one shared SentencePiece :class:`~gpipe.data.vocab.Vocab`: each side's pieces
    and EOS, the target starting with its language's tag ``<2xx>``.

    Training batches draw a pair per sentence with temperature T (p_l ∝ (D_l/ΣD)^(1/T)), then one
    of its sentences uniformly; pairs with a side longer than ``length`` tokens are left out of
    training (:attr:`skipped` counts them). Held-out sentences per pair: the pair's file in
    ``DIR/eval/`` if there is one (same naming), else a seeded ``min(held_out, D_l // 10)`` (at
    least one) of its sentences, taken out of training; they are cut to ``length`` tokens for the
    model, and their references stay whole."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        vocab: Vocab,
        *,
        length: int = 64,
        temperature: float = 5.0,
        held_out: int = 100,
        seed: int = 0,
    ) -> None:
        if length < 2 or held_out < 1:
            raise ValueError(
                f"ParallelCorpus needs length >= 2 and held_out >= 1 (length: {length}, held_out: {held_out})"
            )
        root = Path(directory)
        pairs = read_pairs(root)
        given = read_pairs(root / "eval") if (root / "eval").is_dir() else {}
        unknown = sorted(set(given) - set(pairs))
        if unknown:
            raise ValueError(
                f"{str(root / 'eval')!r} holds pairs with no training file in {str(root)!r}: {', '.join(unknown)}"
            )
        self.vocab_model, self.length_cap, self.seed = vocab, length, seed
        self.tags = {}
        for name, pair in pairs.items():
            try:
                self.tags[name] = vocab.tag(pair.tgt)
            except KeyError:
                raise ValueError(
                    f"the vocabulary {str(vocab.path)!r} has no tag <2{pair.tgt}> for pair {name}: train it on this "
                    f"data (gpipe vocab --data {str(root)!r}, or leave --vocab out)"
                ) from None
        self.train: dict[str, list[tuple[list[int], list[int]]]] = {}
        self.sets: dict[str, HeldOut] = {}
        self.skipped: dict[str, int] = {}
        for name, pair in pairs.items():
            sources, targets = self._encode(pair.sources), self._encode(pair.targets)
            rows = list(range(len(pair)))
            if name in given:
                held_pair = given[name]
                held_sources, held_targets = self._encode(held_pair.sources), self._encode(held_pair.targets)
                references = held_pair.targets
            else:
                if len(pair) < 2:
                    raise ValueError(
                        f"pair {name} has {len(pair)} sentence pair: too few to hold some out for evaluation; give "
                        f"more, or its held-out sentences in {str(root / 'eval' / (name + '.tsv'))!r}"
                    )
                count = min(held_out, max(len(pair) // 10, 1))
                held = sorted(random.Random(derive_seed(seed, 9, len(self.sets))).sample(rows, count))
                rows = sorted(set(rows) - set(held))
                held_sources, held_targets = [sources[i] for i in held], [targets[i] for i in held]
                references = tuple(pair.targets[i] for i in held)
            kept = [(sources[i], targets[i]) for i in rows if len(sources[i]) <= length and len(targets[i]) <= length]
            self.skipped[name] = len(rows) - len(kept)
            if not kept:
                raise ValueError(
                    f"pair {name}: every training sentence pair has a side longer than {length} tokens; raise the "
                    "length (--max-length)"
                )
            self.train[name] = kept
            tag = self.tags[name]
            batch = _translation_batch(
                [self._cut(s) for s in held_sources], [self._cut(t) for t in held_targets], [tag] * len(held_sources)
            )
            self.sets[name] = HeldOut(name, batch.source, batch.target_in, batch.target_out, tuple(references))
        self.names = sorted(self.train)
        self.probabilities = temperature_sampling([len(self.train[n]) for n in self.names], temperature)

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [[*ids, EOS] for ids in self.vocab_model.encode_lines(texts)]

    def _cut(self, ids: list[int]) -> list[int]:
        return ids if len(ids) <= self.length_cap else [*ids[: self.length_cap - 1], EOS]

    @property
    def vocab(self) -> int:
        return self.vocab_model.size

    @property
    def length(self) -> int:
        """The most tokens of a side (EOS included)."""
        return self.length_cap

    @property
    def pair_sizes(self) -> dict[str, int]:
        return {n: len(self.train[n]) for n in self.names}

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch:
        g = _generator(self.seed, split, step)
        chosen = torch.multinomial(torch.tensor(self.probabilities), size, replacement=True, generator=g).tolist()
        draws = torch.randint(0, 2**31 - 1, (size,), generator=g).tolist()
        sources, targets, tags = [], [], []
        for p, d in zip(chosen, draws):
            name = self.names[p]
            if split == "train":
                source, target = self.train[name][d % len(self.train[name])]
            else:
                held = self.sets[name]
                i = d % len(held)
                source, target = _unpadded(held.source[i]), _unpadded(held.target_out[i])
            sources.append(source)
            targets.append(target)
            tags.append(self.tags[name])
        return _translation_batch(sources, targets, tags)

    def held_out(self) -> dict[str, HeldOut]:
        return dict(self.sets)

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if EOS in ids:
            ids = ids[: ids.index(EOS)]
        return self.vocab_model.decode(ids)


def _unpadded(row: Tensor) -> list[int]:
    ids: list[int] = row.tolist()
    return ids[: ids.index(EOS) + 1] if EOS in ids else [i for i in ids if i != PAD]


class TextPairs(_Translation):
    """Pairs of sentences from a tab-separated file, tokenized on white space: one language pair,
    named after the file (``pairs.tsv``: ``pairs``), the decoder starting with BOS. A seeded tenth
    of the lines (at least one, at most ``held_out``) is held out for evaluation (loss and BLEU)."""

    def __init__(self, path: str | os.PathLike[str], *, length: int = 32, held_out: int = 100, seed: int = 0) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the data file {str(path)!r}: {exc}") from None
        bad = [i + 1 for i, parts in enumerate(lines) if len(parts) != 2]
        if not lines or bad:
            where = f"line {bad[0]} has no single tab" if bad else "it is empty"
            raise ValueError(f"{str(path)!r} is not a file of source<TAB>target lines: {where}")
        if len(lines) < 2:
            raise ValueError(f"{str(path)!r} has one line: at least 2 are needed (train and eval)")
        words = sorted({w for pair in lines for side in pair for w in side.split()})
        self.index = {w: i + 3 for i, w in enumerate(words)}
        self.words = {i: w for w, i in self.index.items()}
        self.length, self.seed = length, seed
        self.name = Path(path).stem
        order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0))).tolist()
        held = sorted(order[: min(held_out, max(len(lines) // 10, 1))])
        kept = sorted(order[len(held) :])
        encoded = [(self._encode(s, length), self._encode(t, length)) for s, t in lines]
        self.pairs = [encoded[i] for i in kept]
        batch = self._batch([encoded[i] for i in held])
        references = tuple(" ".join(lines[i][1].split()) for i in held)
        self.held = HeldOut(self.name, batch.source, batch.target_in, batch.target_out, references)

    @property
    def vocab(self) -> int:
        return len(self.index) + 3

    @property
    def pair_sizes(self) -> dict[str, int]:
        return {self.name: len(self.pairs)}

    def _encode(self, text: str, length: int) -> list[int]:
        ids = [*[self.index[w] for w in text.split()][: length - 1], EOS]
        return ids + [PAD] * (length - len(ids))

    def unigram_entropy(self) -> float:
        """Entropy (nats) of all training targets' unigram distribution."""
        return entropy(Counter(t for _, tgt in self.pairs for t in tgt if t != PAD))

    @staticmethod
    def _batch(rows: Sequence[tuple[list[int], list[int]]]) -> TranslationBatch:
        src = torch.tensor([r[0] for r in rows])
        tgt = torch.tensor([r[1] for r in rows])
        bos = torch.full((len(rows), 1), BOS)
        return TranslationBatch(src, torch.cat([bos, tgt[:, :-1]], dim=1), tgt)

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch:
        g = _generator(self.seed, split, step)
        if split == "train":
            rows = torch.randint(0, len(self.pairs), (size,), generator=g).tolist()
            return self._batch([self.pairs[r] for r in rows])
        picked = torch.randint(0, len(self.held), (size,), generator=g)
        return TranslationBatch(self.held.source[picked], self.held.target_in[picked], self.held.target_out[picked])

    def held_out(self) -> dict[str, HeldOut]:
        return {self.name: self.held}

    def detokenize(self, ids: Sequence[int]) -> str:
        words = []
        for i in ids:
            if i == EOS:
                break
            if i in self.words:
                words.append(self.words[i])
        return " ".join(words)
