"""Data for ``gpipe train``, nothing to download.

Every data set has ``batch(size, step, split=...)`` returning a batch with ``inputs``, ``target``
and ``count`` (tokens or images, for the throughput), a ``unit`` naming what ``count`` counts, and
``baseline()``: the loss of a model that ignores its input.

:class:`SyntheticTranslation` is a small multilingual "translation" corpus made up on the spot:
several language pairs of very different sizes; in pair p a sentence of content tokens translates
token by token through the pair's own permutation of the vocabulary, and the target starts with the
pair's tag. Pairs are drawn with temperature-based sampling (:func:`gpipe.recipe.temperature_sampling`,
T=5 by default), so the small pairs are seen far more often than their share; :meth:`~SyntheticTranslation.write`
writes it as text files.

:class:`ParallelCorpus` reads every language pair of a folder of parallel files, encoded with one
shared SentencePiece vocabulary (:mod:`gpipe.data.vocab`), sampled the same way. :class:`TextPairs` reads
one pair from a tab-separated file (source<TAB>target per line), with a whitespace vocabulary built
from the file. All three are :class:`TranslationDataset` s: held-out sentences per pair, for BLEU.

:class:`SyntheticImages` are class-structured images for AmoebaNet: every class has its own smooth
random pattern; an image is its class's pattern, shifted, scaled in contrast and buried in noise.
:class:`ImageFiles` reads real images from a ``.npz`` file (arrays ``x`` and ``y``) or a folder with
one sub-folder of images per class.

Batches are a pure function of (seed, step): a run resumed at step N sees exactly the batches an
uninterrupted run sees.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from gpipe.data.vocab import Vocab, read_pairs
from gpipe.recipe import temperature_sampling
from gpipe.rng import derive_seed


class DataBatch(Protocol):
    """A batch of a :class:`Dataset`: the model's inputs, the loss's target, and how many items
    (tokens, images) it holds."""

    @property
    def inputs(self) -> Any: ...

    @property
    def target(self) -> Tensor: ...

    @property
    def count(self) -> int: ...


class Dataset(Protocol):
    """What ``gpipe train`` reads from a data set."""

    unit: str  # what a batch's count counts: 'tokens' or 'images'
    baseline_name: str

    def batch(self, size: int, step: int, *, split: str = "train") -> DataBatch: ...

    def baseline(self) -> float: ...


@runtime_checkable
class TokenDataset(Dataset, Protocol):
    """A data set of token sequences: what a language model is sized from."""

    @property
    def vocab(self) -> int: ...

    @property
    def length(self) -> int: ...


@runtime_checkable
class ImageDataset(Dataset, Protocol):
    """A data set of labelled images: what a classifier is sized from."""

    classes: int
    channels: int


__all__ = [
    "DataBatch",
    "Dataset",
    "ImageBatch",
    "ImageDataset",
    "ImageFiles",
    "SyntheticImages",
    "SyntheticTranslation",
    "TextPairs",
    "TokenDataset",
    "TranslationBatch",
]

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
    def target(self) -> Tensor:
        return self.target_out

    @property
    def tokens(self) -> int:
        return int((self.target_out != PAD).sum())

    count = tokens


def entropy(counts: Counter[int]) -> float:
    """The entropy (nats) of the distribution ``counts`` of tokens."""
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


class _Translation:
    unit = "tokens"
    baseline_name = "unigram entropy"
    baseline_split = "train"  # the batches the unigram distribution is counted on

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch:
        raise NotImplementedError

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the target tokens' unigram distribution, counted on 20 batches of 64:
        the loss of a model that ignores its input."""
        counts = Counter[int]()
        for step in range(20):
            target = self.batch(64, step, split=self.baseline_split).target_out
            counts.update(target[target != PAD].tolist())
        return entropy(counts)

    def baseline(self) -> float:
        """The unigram entropy of the targets (nats)."""
        return self.unigram_entropy()


@dataclass(frozen=True)
class HeldOut:
    """One language pair's held-out sentences: what the model decodes and what BLEU compares with."""

    name: str  # the pair, "en-de"
    source: Tensor  # (n, S) token ids, padded
    target_in: Tensor  # (n, T) the target shifted right, starting with the pair's tag
    target_out: Tensor  # (n, T) the target, ending with EOS, padded
    references: tuple[str, ...]  # the target sentences as text

    @property
    def start(self) -> Tensor:
        """(n,) the decoder's first token of each sentence: the target language's tag."""
        return self.target_in[:, 0]

    def __len__(self) -> int:
        return self.source.size(0)


@runtime_checkable
class TranslationDataset(TokenDataset, Protocol):
    """Several language pairs, each with held-out sentences to translate and score."""

    @property
    def pair_sizes(self) -> dict[str, int]:
        """Training sentence pairs of each language pair, by name (sorted)."""
        ...

    def held_out(self) -> dict[str, HeldOut]:
        """Each pair's held-out sentences (the same on every call and in every process)."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of a decoded sentence's ids (its EOS and padding dropped)."""
        ...


def _padded(rows: Sequence[Sequence[int]]) -> Tensor:
    """Rows of ids as one (n, longest) tensor, padded with PAD."""
    longest = max(len(r) for r in rows)
    return torch.tensor([[*r, *[PAD] * (longest - len(r))] for r in rows], dtype=torch.long)


def _translation_batch(
    sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], tags: Sequence[int]
) -> TranslationBatch:
    """A batch of encoded sentence pairs (each side ending with EOS), padded to its longest."""
    return TranslationBatch(
        source=_padded(sources),
        target_in=_padded([[tag, *t[:-1]] for t, tag in zip(targets, tags)]),
        target_out=_padded(targets),
    )


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


@dataclass(frozen=True)
class ImageBatch:
    images: Tensor  # (B, C, H, W) float
    labels: Tensor  # (B,) class indices

    @property
    def inputs(self) -> Tensor:
        return self.images

    @property
    def target(self) -> Tensor:
        return self.labels

    @property
    def count(self) -> int:
        return self.images.size(0)


class _Images:
    unit = "images"
    baseline_name = "chance"
    classes: int
    channels: int

    def baseline(self) -> float:
        """The loss of a uniform guess over the classes: log(classes) nats."""
        return math.log(self.classes)


class SyntheticImages(_Images):
    """``classes`` classes of ``channels``x``size``x``size`` images: class c's pattern is smooth
    noise (a random ``detail``x``detail`` grid, upsampled), and an image of class c is that pattern
    shifted by up to ``size/8`` pixels, scaled by a contrast in [0.5, 1.5], plus Gaussian ``noise``."""

    def __init__(
        self,
        *,
        classes: int = 10,
        size: int = 32,
        channels: int = 3,
        detail: int = 4,
        noise: float = 3.0,
        seed: int = 0,
    ) -> None:
        if classes < 2 or size < 4 or channels < 1 or detail < 1 or noise < 0:
            raise ValueError(
                f"SyntheticImages needs classes >= 2, size >= 4, channels >= 1, detail >= 1, noise >= 0 "
                f"(classes: {classes}, size: {size}, channels: {channels}, detail: {detail}, noise: {noise})"
            )
        self.classes, self.size, self.channels, self.noise, self.seed = classes, size, channels, noise, seed
        g = torch.Generator().manual_seed(derive_seed(seed, 7, 0))
        grid = torch.randn(classes, channels, detail, detail, generator=g)
        patterns = F.interpolate(grid, size=(size, size), mode="bicubic", align_corners=False)
        self.patterns = (patterns - patterns.mean(dim=(1, 2, 3), keepdim=True)) / patterns.std(
            dim=(1, 2, 3), keepdim=True
        )

    def batch(self, size: int, step: int, *, split: str = "train") -> ImageBatch:
        g = _generator(self.seed, split, step)
        labels = torch.randint(0, self.classes, (size,), generator=g)
        reach = max(self.size // 8, 1)
        shifts = torch.randint(-reach, reach + 1, (size, 2), generator=g).tolist()
        contrast = 0.5 + torch.rand(size, 1, 1, 1, generator=g)
        noise = torch.randn(size, self.channels, self.size, self.size, generator=g)
        shifted = torch.stack([self.patterns[c].roll(tuple(s), dims=(1, 2)) for c, s in zip(labels.tolist(), shifts)])
        return ImageBatch(shifted * contrast + self.noise * noise, labels)


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}


class ImageFiles(_Images):
    """Labelled images read into memory from ``path``: a ``.npz`` file with ``x`` (N, H, W, C) or
    (N, C, H, W), uint8 or float, and ``y`` (N,) integer labels; or a folder with one sub-folder
    per class (named as the class; sorted, they give the label order) of image files, all resized to
    ``size``x``size``. Pixels are standardized per channel; a seeded tenth (at least one image) is
    held out for the ``eval`` split."""

    def __init__(self, path: str | os.PathLike[str], *, size: int = 32, seed: int = 0) -> None:
        self.path, self.seed = Path(path), seed
        if self.path.is_dir():
            images, labels, self.names = self._read_folder(size)
        elif self.path.suffix == ".npz":
            images, labels = self._read_npz()
            self.names = [str(c) for c in range(int(labels.max()) + 1)]
        else:
            raise ValueError(
                f"cannot read the image data {str(path)!r}: give a .npz file (arrays x and y) or a folder "
                f"with one sub-folder of images per class"
            )
        if len(images) < 2:
            raise ValueError(f"{str(path)!r} holds {len(images)} image(s); at least 2 are needed (train and eval)")
        mean = images.mean(dim=(0, 2, 3), keepdim=True)
        std = images.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
        images = (images - mean) / std
        self.classes, self.channels = max(len(self.names), 2), images.size(1)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0)))
        held = max(len(images) // 10, 1)
        self.splits = {
            "eval": (images[order[:held]], labels[order[:held]]),
            "train": (images[order[held:]], labels[order[held:]]),
        }

    def _read_npz(self) -> tuple[Tensor, Tensor]:
        import numpy as np

        try:
            with np.load(self.path) as archive:
                x, y = archive["x"], archive["y"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot read {str(self.path)!r} as a .npz of arrays x and y: {exc!r}") from None
        if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(
                f"{str(self.path)!r}: x must be (N, H, W, C) or (N, C, H, W) and y (N,) integers "
                f"(x: {x.shape} {x.dtype}, y: {y.shape} {y.dtype})"
            )
        if len(y) and y.min() < 0:
            raise ValueError(f"{str(self.path)!r}: labels must be non-negative (smallest: {int(y.min())})")
        images = torch.from_numpy(np.ascontiguousarray(x)).float()
        if x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            images = images.permute(0, 3, 1, 2)
        if x.dtype == np.uint8:
            images = images / 255.0
        return images.contiguous(), torch.from_numpy(y.astype(np.int64))

    def _read_folder(self, size: int) -> tuple[Tensor, Tensor, list[str]]:
        import numpy as np
        from PIL import Image, UnidentifiedImageError

        names = sorted(d.name for d in self.path.iterdir() if d.is_dir())
        images, labels = [], []
        for label, name in enumerate(names):
            for file in sorted((self.path / name).iterdir()):
                if file.suffix.lower() not in _IMAGE_SUFFIXES:
                    continue
                try:
                    with Image.open(file) as image:
                        pixels = np.asarray(image.convert("RGB").resize((size, size)), dtype=np.float32) / 255.0
                except (OSError, UnidentifiedImageError) as exc:
                    raise ValueError(f"cannot read the image {str(file)!r}: {exc}") from None
                images.append(torch.from_numpy(pixels).permute(2, 0, 1))
                labels.append(label)
        if not images:
            raise ValueError(
                f"{str(self.path)!r} has no class sub-folders with images ({', '.join(sorted(_IMAGE_SUFFIXES))})"
            )
        return torch.stack(images), torch.tensor(labels), names

    def batch(self, size: int, step: int, *, split: str = "train") -> ImageBatch:
        g = _generator(self.seed, split, step)
        images, labels = self.splits[split]
        rows = torch.randint(0, len(images), (size,), generator=g)
        return ImageBatch(images[rows], labels[rows])
