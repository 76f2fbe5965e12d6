"""Translation data read from files: :class:`ParallelCorpus` (a folder of language pairs, one shared
SentencePiece vocabulary) and :class:`TextPairs` (one tab-separated file, a whitespace vocabulary)."""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

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
from gpipe.data.batches import DrawnPairs, Draws
from gpipe.data.files import check_eval, read_pairs
from gpipe.data.vocab import Vocab
from gpipe.recipe import temperature_sampling
from gpipe.rng import derive_seed

__all__ = ["ParallelCorpus", "TextPairs"]


class ParallelCorpus(DrawnPairs):
    """Every language pair of a data directory (see :func:`gpipe.data.files.find_pairs` for the file
    names), read into memory and encoded with one shared SentencePiece :class:`~gpipe.data.vocab.Vocab`:
    each side's pieces and EOS, the target starting with its language's tag ``<2xx>``. For corpora
    larger than memory, ``gpipe prepare`` writes the same sentences to memory-mapped arrays that
    :class:`~gpipe.data.prepared.PreparedCorpus` reads with the same batches.

    Training batches draw a pair per sentence with temperature T (p_l ∝ (D_l/ΣD)^(1/T)), then one
    of its sentences uniformly (:mod:`gpipe.data.batches`; :meth:`token_batch`: by length buckets);
    pairs with a side longer than ``length`` tokens are left out of training (:attr:`skipped` counts
    them). Held-out sentences per pair: the pair's file in ``DIR/eval/`` if there is one (same naming),
    else a seeded ``min(held_out, D_l // 10)`` (at least one) of its sentences, taken out of training;
    they are cut to ``length`` tokens for the model, and their references stay whole."""

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
        check_eval(root, given, pairs)
        self.vocab_model, self.length_cap, self.seed = vocab, length, seed
        self.tags = {name: pair_tag(vocab, name, pair.tgt, root) for name, pair in pairs.items()}
        self.train: dict[str, list[tuple[list[int], list[int]]]] = {}
        self.sets: dict[str, HeldOut] = {}
        self.skipped: dict[str, int] = {}
        for index, (name, pair) in enumerate(pairs.items()):
            sources, targets = self._encode(pair.sources), self._encode(pair.targets)
            if name in given:
                held: list[int] = []
                held_pair = given[name]
                held_sources, held_targets = self._encode(held_pair.sources), self._encode(held_pair.targets)
                references = held_pair.targets
            else:
                held = held_out_rows(name, len(pair), held_out, seed, index, root)
                held_sources, held_targets = [sources[i] for i in held], [targets[i] for i in held]
                references = tuple(pair.targets[i] for i in held)
            chosen = set(held)
            rows = [i for i in range(len(pair)) if i not in chosen]
            kept = sorted(
                ((sources[i], targets[i]) for i in rows if len(sources[i]) <= length and len(targets[i]) <= length),
                key=lambda st: max(len(st[0]), len(st[1])),
            )  # (stable: by key, then in the file's order)
            self.skipped[name] = len(rows) - len(kept)
            if not kept:
                raise ValueError(
                    f"pair {name}: every training sentence pair has a side longer than {length} tokens; raise the "
                    "length (--max-length)"
                )
            self.train[name] = kept
            self.sets[name] = held_out_set(name, held_sources, held_targets, references, self.tags[name], length)
        self.names = sorted(self.train)
        histograms = []
        for name in self.names:
            histogram = [0] * (length + 1)
            for source, target in self.train[name]:
                histogram[max(len(source), len(target))] += 1
            histograms.append(histogram)
        self.draws = Draws(
            temperature_sampling([len(self.train[n]) for n in self.names], temperature), histograms, length
        )

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [[*ids, EOS] for ids in self.vocab_model.encode_lines(texts)]

    @property
    def vocab(self) -> int:
        return self.vocab_model.size

    @property
    def length(self) -> int:
        """The most tokens of a side (EOS included)."""
        return self.length_cap

    def sentence(self, pair: int, index: int) -> tuple[list[int], list[int]]:
        return self.train[self.names[pair]][index]

    def detokenize(self, ids: Sequence[int]) -> str:
        return detokenize(self.vocab_model, ids)


def pair_tag(vocab: Vocab, name: str, lang: str, data: Path) -> int:
    """The id of the tag ``<2lang>`` asking for pair ``name``'s target language, or a ``ValueError``."""
    try:
        return vocab.tag(lang)
    except KeyError:
        raise ValueError(
            f"the vocabulary {str(vocab.path)!r} has no tag <2{lang}> for pair {name}: train it on this data "
            f"(gpipe vocab --data {str(data)!r}, or leave --vocab out)"
        ) from None


def held_out_rows(name: str, size: int, most: int, seed: int, index: int, data: Path) -> list[int]:
    """The sentences of pair ``name`` (the ``index``-th, of ``size`` sentences) held out for
    evaluation: a seeded ``min(most, size // 10)``, at least one, sorted."""
    if size < 2:
        raise ValueError(
            f"pair {name} has {size} sentence pair: too few to hold some out for evaluation; give more, or its "
            f"held-out sentences in {str(data / 'eval' / (name + '.tsv'))!r}"
        )
    count = min(most, max(size // 10, 1))
    return sorted(random.Random(derive_seed(seed, 9, index)).sample(range(size), count))


def held_out_set(
    name: str,
    sources: Sequence[list[int]],
    targets: Sequence[list[int]],
    references: Sequence[str],
    tag: int,
    length: int,
) -> HeldOut:
    """A pair's held-out sentences (ids ending with EOS) cut to ``length`` tokens for the model."""

    def cut(ids: list[int]) -> list[int]:
        return ids if len(ids) <= length else [*ids[: length - 1], EOS]

    batch = _translation_batch([cut(s) for s in sources], [cut(t) for t in targets], [tag] * len(sources))
    return HeldOut(name, batch.source, batch.target_in, batch.target_out, tuple(references))


def detokenize(vocab: Vocab, ids: Sequence[int]) -> str:
    """The text of a decoded sentence's ids, up to its EOS."""
    ids = list(ids)
    if EOS in ids:
        ids = ids[: ids.index(EOS)]
    return vocab.decode(ids)


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
