"""Protecting a stage's inputs from its layers' in-place changes: :class:`_InPlace` learns which
inputs the layers modify in place and feeds them copies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from gpipe.microbatch import Batch

__all__ = ["_InPlace"]


def _clone(t: Tensor) -> Tensor:
    return t.clone()


class _InPlace:
    """Which stage inputs a stage's layers modify in place, learned per *entry* (the stage's own
    input, or under a split backward each layer's input) and per training mode.

    A stage input is an autograd leaf (autograd refuses in-place changes to a leaf that requires
    grad) and, when the micro-batch is re-materialized, the very tensor the recomputation starts
    from. So the first time an entry is met, every tensor entering there is cloned and the clones'
    version counters tell which ones a layer modified; from then on exactly those are cloned. A
    change in place that appears later is still caught: by autograd, or by the inputs' version
    counters, with a message naming the stage and the way out.
    """

    def __init__(self) -> None:
        self.known: dict[tuple[int, bool], tuple[int, ...]] = {}

    def feed(self, entry: int, training: bool, state: Batch) -> tuple[Batch, Any]:
        """What to hand the layers at ``entry``, and a token for :meth:`check`."""
        cloned = self.known.get((entry, training))
        if cloned is None:  # first time here: clone everything, find out
            return state.map(_clone), None
        versions = tuple(v._version if isinstance(v, Tensor) else 0 for v in state.values)
        if cloned:
            values = tuple(_clone(v) if i in cloned else v for i, v in enumerate(state.values))
            state = Batch(values, state.spec, state.skips, state.needs_grad)
        return state, versions

    def check(self, entry: int, training: bool, given: Batch, fed: Batch, token: Any, where: Callable[[], str]) -> None:
        """After the layers ran: learn (first time) or verify that no un-cloned input changed
        (``where()`` names the place, for the error)."""
        if token is None:
            changed = tuple(i for i, v in enumerate(fed.values) if isinstance(v, Tensor) and v._version)
            self.known[(entry, training)] = changed
            return
        for i, (v, before) in enumerate(zip(given.values, token)):
            if isinstance(v, Tensor) and v._version != before and i not in self.known[(entry, training)]:
                raise RuntimeError(
                    f"{where()} modified its input {i} in place, which it did not do on its first run "
                    "(so gpipe did not protect it): the input a re-materialized micro-batch is recomputed "
                    "from is now lost. Make the in-place operation unconditional or out of place "
                    "(e.g. inplace=False)"
                )
