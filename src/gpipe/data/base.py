"""What every data set of ``gpipe train`` shares: the protocols (:class:`Dataset`, ...), the special token
ids, the seeded generator of a batch, :class:`TranslationBatch`, :class:`HeldOut` and the translation
data sets' common base."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from gpipe.microbatch import Share
from gpipe.rng import derive_seed

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "DataBatch",
    "Dataset",
    "HeldOut",
    "ImageDataset",
    "ReplicaBatch",
    "TokenDataset",
    "TranslationBatch",
    "TranslationDataset",
    "entropy",
    "ignore_index",
]


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

    @property
    def padding(self) -> float:
        """The fraction of the batch's positions (source and target) that are padding."""
        positions = self.source.numel() + self.target_out.numel()
        real = int((self.source != PAD).sum()) + self.tokens
        return 1.0 - real / positions if positions else 0.0


@dataclass(frozen=True)
class ReplicaBatch:
    """One data-parallel replica's share of a mini-batch, read alone: ``batch`` holds its rows (those
    :func:`torch.chunk` gives it, padded as the whole mini-batch would be), ``share`` what
    :meth:`gpipe.Pipeline.step` needs of the whole, ``count`` and ``padding`` the whole's items and
    share of padded positions (for the metrics)."""

    batch: Any
    share: Share
    count: int
    padding: float | None = None

    @property
    def inputs(self) -> Any:
        return self.batch.inputs

    @property
    def target(self) -> Tensor:
        return self.batch.target  # type: ignore[no-any-return]


def share_of(rows: Sequence[Any], share: tuple[int, int]) -> Sequence[Any]:
    """Replica r's rows of a batch ``rows``, ``share`` = (r, replicas), as :func:`torch.chunk` cuts it
    (:meth:`gpipe.microbatch.Share.span`); a ``ValueError`` if it gets none."""
    replica, replicas = share
    mine = rows[Share(len(rows)).span(replicas, replica)]
    if not mine:
        raise ValueError(f"a batch of {len(rows)} rows cannot be shared by {replicas} replicas")
    return mine


def ignore_index(data: Dataset) -> int:
    """The target the losses of ``data`` leave out: its own ``ignore_index`` (instruction records'
    -100), else PAD for tokens, -100 (F.cross_entropy's default, no class index) for images."""
    return int(getattr(data, "ignore_index", PAD if data.unit != "images" else -100))


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

    def row(self, draw: int) -> tuple[list[int], list[int]]:
        """Held-out sentence ``draw % len(self)``: its source and target ids, each ending with EOS."""
        i = draw % len(self)
        return _unpadded(self.source[i]), _unpadded(self.target_out[i])


def _unpadded(row: Tensor) -> list[int]:
    ids: list[int] = row.tolist()
    return ids[: ids.index(EOS) + 1] if EOS in ids else [i for i in ids if i != PAD]


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


def _padded(rows: Sequence[Sequence[int]], width: int | None = None) -> Tensor:
    """Rows of ids as one (n, width) tensor (default: the longest row's), padded with PAD."""
    longest = max(len(r) for r in rows) if width is None else width
    return torch.tensor([[*r, *[PAD] * (longest - len(r))] for r in rows], dtype=torch.long)


def _translation_batch(
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    tags: Sequence[int],
    widths: tuple[int, int] | None = None,
) -> TranslationBatch:
    """A batch of encoded sentence pairs (each side ending with EOS), padded to its longest (or to
    ``widths``, the source's and the target's)."""
    source, target = widths if widths is not None else (None, None)
    return TranslationBatch(
        source=_padded(sources, source),
        target_in=_padded([[tag, *t[:-1]] for t, tag in zip(targets, tags)], target),
        target_out=_padded(targets, target),
    )
