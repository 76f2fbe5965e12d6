"""How the translation data sets of many language pairs draw a batch: a fixed number of sentence
pairs (``--batch``), or about a number of tokens (``--batch-tokens``) from one length bucket. Both
are pure functions of (seed, step) and hold, per language pair, only the counts of its sentences by
length: state linear in the pairs and lengths, never in the sentences.

Sentences are kept sorted by their *key*, the longer side's tokens (EOS included), stably (ties in the
order of the files): the sentences of a pair with keys in ``(lo, hi]`` are one range of its indices,
and leaving out the pairs longer than ``--max-length`` keeps a prefix.

A sentence batch draws, for each row, a pair with temperature sampling (p_l ∝ (D_l/ΣD)^(1/T)), then
one of its sentences uniformly. A token batch first draws a bucket, then its rows alike among the
bucket's sentences; bucket b (keys up to ``ub_b``) holds ``N // ub_b`` rows rounded down to a multiple
(at least one), padded at most to ``ub_b`` tokens a side, and is drawn with probability
∝ ``ub_b · Σ_l p_l · D_lb / D_l``, so that over many steps every sentence makes about the same share of the
sentences drawn as with sentence batches (Lingvo's length buckets, fairseq's ``max_tokens``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from gpipe.data.base import (
    HeldOut,
    ReplicaBatch,
    _generator,
    _Translation,
    _translation_batch,
    share_of,
)
from gpipe.microbatch import Share

__all__ = ["BUCKET_RATIO", "DrawnPairs", "Draws", "bucket_bounds"]

BUCKET_RATIO = 1.1
"""Each bucket's upper bound is at most this many times the one before (and at least one more)."""


def bucket_bounds(longest: int, ratio: float = BUCKET_RATIO) -> list[int]:
    """The buckets' upper bounds (tokens of a side, EOS included) up to ``longest``: 2, 3, ...,
    growing by ``ratio``, the last ``longest``."""
    bounds = [2]
    while bounds[-1] < longest:
        bounds.append(min(max(bounds[-1] + 1, math.ceil(bounds[-1] * ratio)), longest))
    return bounds


class Draws:
    """Which sentence of which pair each row of a batch holds. ``histograms[l][k]``: the training
    sentences of pair ``l`` whose key is ``k`` (the sentences sorted by key), for keys up to
    ``longest`` (``--max-length``), which sets the buckets."""

    def __init__(self, probabilities: Sequence[float], histograms: Sequence[Sequence[int]], longest: int) -> None:
        self.probabilities = torch.tensor(list(probabilities), dtype=torch.float64)
        self.sizes = [sum(h) for h in histograms]
        if any(len(h) > longest + 1 for h in histograms):
            raise ValueError(f"a histogram goes past the longest key {longest}")
        self.bounds = bucket_bounds(max(longest, 2))  # (the same whatever keys the pairs hold)
        # starts[l][b]: the index of pair l's first sentence of bucket b; counts[l][b]: how many
        self.starts: list[list[int]] = []
        self.counts: list[list[int]] = []
        for histogram in histograms:
            cumulative = [0]
            for count in histogram:
                cumulative.append(cumulative[-1] + count)
            top = len(histogram) - 1
            edges = [0, *(cumulative[min(b, top) + 1] for b in self.bounds)]
            self.starts.append(edges[:-1])
            self.counts.append([hi - lo for lo, hi in itertools.pairwise(edges)])
        # within bucket b, pair l with probability ∝ p_l D_lb / D_l
        share = torch.tensor([[c / size for c in counts] for counts, size in zip(self.counts, self.sizes)],
                             dtype=torch.float64) * self.probabilities[:, None]  # fmt: skip
        self.within = share.T  # (buckets, pairs)
        mass = share.sum(0)
        self.bucket_weights = mass * torch.tensor(self.bounds, dtype=torch.float64)

    def sentences(self, g: torch.Generator, size: int) -> list[tuple[int, int]]:
        """``size`` (pair, draw) of a sentence batch: the pair's sentence ``draw % D_l`` (or held-out
        sentence ``draw % n``)."""
        chosen = torch.multinomial(self.probabilities, size, replacement=True, generator=g).tolist()
        draws = torch.randint(0, 2**31 - 1, (size,), generator=g).tolist()
        return list(zip(chosen, draws))

    def bucket_rows(self, bucket: int, tokens: int, multiple: int) -> int:
        """The rows of a batch of bucket ``bucket``: as many as ``tokens`` holds, rounded down to a
        ``multiple`` (at least one multiple)."""
        return max(tokens // self.bounds[bucket] // multiple, 1) * multiple

    def tokens(self, g: torch.Generator, tokens: int, multiple: int) -> list[tuple[int, int]]:
        """The (pair, index) draws of a batch of about ``tokens`` tokens a side, in a ``multiple`` of rows."""
        bucket = int(torch.multinomial(self.bucket_weights, 1, generator=g))
        rows = self.bucket_rows(bucket, tokens, multiple)
        chosen = torch.multinomial(self.within[bucket], rows, replacement=True, generator=g).tolist()
        draws = torch.randint(0, 2**31 - 1, (rows,), generator=g).tolist()
        return [(p, self.starts[p][bucket] + d % self.counts[p][bucket]) for p, d in zip(chosen, draws)]


class DrawnPairs(_Translation):
    """The batches of a data set of language pairs (``names``, sorted) whose training sentences are
    sorted by key; a subclass sets :attr:`draws`, :attr:`tags`, :attr:`sets` (held out), :attr:`seed`
    and gives :meth:`sentence` (the ids of a pair's sentence, each side ending with EOS)."""

    names: list[str]
    tags: dict[str, int]
    sets: dict[str, HeldOut]
    draws: Draws
    seed: int

    def sentence(self, pair: int, index: int) -> tuple[Sequence[int], Sequence[int]]:
        raise NotImplementedError

    def lengths(self, pair: int, index: int) -> tuple[int, int]:
        """The tokens of a training sentence's source and target, each with EOS (without reading them)."""
        source, target = self.sentence(pair, index)
        return len(source), len(target)

    @property
    def pair_sizes(self) -> dict[str, int]:
        return dict(zip(self.names, self.draws.sizes))

    def _batch(self, rows: Sequence[tuple[int, int]], share: tuple[int, int] | None = None) -> Any:
        """The batch of training sentences ``rows``; with ``share`` = (replica, replicas), only that
        replica's rows, padded as the whole batch (a :class:`ReplicaBatch`)."""
        if share is None:
            sources, targets = zip(*(self.sentence(p, i) for p, i in rows))
            return _translation_batch(sources, targets, [self.tags[self.names[p]] for p, _ in rows])
        lengths = [self.lengths(p, i) for p, i in rows]
        widths = (max(s for s, _ in lengths), max(t for _, t in lengths))
        mine = share_of(rows, share)
        sources, targets = zip(*(self.sentence(p, i) for p, i in mine))
        batch = _translation_batch(sources, targets, [self.tags[self.names[p]] for p, _ in mine], widths)
        count = sum(t for _, t in lengths)
        real = sum(s for s, _ in lengths) + count
        padding = 1.0 - real / (len(rows) * (widths[0] + widths[1]))
        return ReplicaBatch(batch, Share(len(rows), count), count, padding)

    def batch(self, size: int, step: int, *, split: str = "train", share: tuple[int, int] | None = None) -> Any:
        """``size`` sentence pairs, each of a pair drawn with temperature sampling (``share``: a
        replica's, as :meth:`_batch`; training only)."""
        g = _generator(self.seed, split, step)
        rows = self.draws.sentences(g, size)
        if split == "train":
            return self._batch([(p, d % self.draws.sizes[p]) for p, d in rows], share)
        if share is not None:
            raise ValueError("a share of a batch is for training batches (split: 'train')")
        held = [self.sets[self.names[p]] for p, _ in rows]  # (the same draws, among the held-out sentences)
        picked = [h.row(d) for h, (_, d) in zip(held, rows)]
        return _translation_batch([s for s, _ in picked], [t for _, t in picked], [self.tags[h.name] for h in held])

    def token_batch(self, tokens: int, step: int, *, multiple: int = 1, share: tuple[int, int] | None = None) -> Any:
        """A training batch of about ``tokens`` tokens a side, padding included, from one length bucket,
        its rows a ``multiple`` (``gpipe train``: 8, which 1, 2, 4 and 8 replicas share alike); with
        ``share`` = (replica, replicas), that replica's rows alone (a :class:`ReplicaBatch`)."""
        return self._batch(self.draws.tokens(_generator(self.seed, "train", step), tokens, multiple), share)

    def held_out(self) -> dict[str, HeldOut]:
        return dict(self.sets)
