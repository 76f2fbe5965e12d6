"""Caches for decoding: what a layer keeps of the sequences it has already seen.

Generating a sequence one token at a time, a model need not see the whole prefix again at every step:
attention keeps the keys and values of the earlier positions, an encoder-decoder keeps the encoder's
output (or the cross-attention's keys and values of it), an embedding keeps how far it has got. In a
pipeline these caches live in the stages: each layer's on the device (or rank) that holds the layer,
one :class:`Cache` per stage and *group* of sequences in flight, so that a decoding step sends only
the new positions through the stages.

A layer finds its own cache with :func:`layer_cache` — ``None`` outside decoding, where it computes
as always::

    def forward(self, x):
        cache = gpipe.layer_cache(self)
        if cache is None:                          # training, evaluation: the whole sequence
            return attend(x, x)
        keys = cache.extend("keys", self.k(x), dim=2)   # the earlier positions' and the new ones
        ...

Every tensor a cache holds has the group's sequences (rows) in dim 0, so that the decoder can
reorder all of them at once (:meth:`Cache.reorder`): beam search continues some hypotheses and drops
others, and finished sequences leave the group. Other state (how many positions were seen) is kept
in :attr:`LayerCache.values` and is the same for every row.

The decoder (:mod:`gpipe.runtime.decoding`) makes a stage's cache current around the stage's
layers (:func:`using`); the current cache is per thread, as every worker of a pipeline runs in a
thread of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Cache", "LayerCache", "decoding", "layer_cache", "using"]


class LayerCache:
    """What one layer keeps for one group of sequences: tensors with the rows in dim 0, and other
    values (the same for every row)."""

    __slots__ = ("tensors", "values")

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.values: dict[str, Any] = {}

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def set(self, name: str, value: Tensor) -> Tensor:
        """Keep ``value`` (rows in dim 0) as ``name``; returns it."""
        self.tensors[name] = value
        return value

    def extend(self, name: str, value: Tensor, dim: int) -> Tensor:
        """Append ``value`` to the tensor kept as ``name`` along ``dim`` (keep it, the first time);
        returns the whole."""
        kept = self.tensors.get(name)
        whole = value if kept is None else torch.cat([kept, value], dim=dim)
        self.tensors[name] = whole
        return whole

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Cache:
    """The layer caches of one stage for one group of sequences, by layer."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[nn.Module, LayerCache]] = {}

    def of(self, module: nn.Module) -> LayerCache:
        """``module``'s cache (empty the first time it asks)."""
        found = self._layers.get(id(module))
        if found is None:
            found = self._layers[id(module)] = (module, LayerCache())  # (the module: its id stays its own)
        return found[1]

    def reorder(self, rows: Tensor) -> None:
        """Keep the rows ``rows`` (indices into the current rows, in their new order, repeats
        allowed) of every cached tensor."""
        for _, cache in self._layers.values():
            for name, t in cache.tensors.items():
                cache.tensors[name] = t.index_select(0, rows.to(t.device))

    def clear(self) -> None:
        """Forget everything: the group starts new sequences."""
        self._layers.clear()

    @property
    def nbytes(self) -> int:
        """The bytes of the cached tensors."""
        return sum(cache.nbytes for _, cache in self._layers.values())

    def __len__(self) -> int:
        return len(self._layers)


_state = threading.local()


@contextmanager
def using(cache: Cache | None) -> Iterator[None]:
    """Make ``cache`` current in this thread (None: no decoding) while the block runs."""
    before = getattr(_state, "cache", None)
    _state.cache = cache
    try:
        yield
    finally:
        _state.cache = before


def layer_cache(module: nn.Module) -> LayerCache | None:
    """``module``'s cache for the group being decoded in this thread, or ``None`` when no decoding
    is under way (the layer then computes on the whole sequence, as in training)."""
    cache: Cache | None = getattr(_state, "cache", None)
    return None if cache is None else cache.of(module)


def decoding() -> bool:
    """Whether a cache is current in this thread: a decoding step, not a whole sequence."""
    return getattr(_state, "cache", None) is not None
