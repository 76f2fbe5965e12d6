"""Re-materialization (activation checkpointing) of a stage, per micro-batch.

In a re-materialized forward a stage keeps only its input; in backward it runs its forward again
(with the same random numbers, see :mod:`gpipe.rng`) and back-propagates through that. The mode picks
which micro-batches are re-materialized:

=============  =====================================================================
'always'       every micro-batch
'except_last'  all but the last one, whose backward comes right after its forward
'never'        none: every micro-batch keeps its activations until its backward
=============  =====================================================================

Nothing is re-materialized in eval mode or when autograd is off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

__all__ = ["CHECKPOINT_MODES", "checkpoint_stop", "is_checkpointing", "is_recomputing"]

CHECKPOINT_MODES = ("always", "except_last", "never")

_local = threading.local()


def check_mode(mode: object) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never' (checkpoint: {mode!r})")
    return str(mode)


def checkpoint_stop(mode: str, chunks: int) -> int:
    """Micro-batches ``0 .. stop-1`` are re-materialized."""
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[check_mode(mode)]


def is_checkpointing() -> bool:
    """True inside a forward whose activations are dropped, to be recomputed in backward."""
    return bool(getattr(_local, "checkpointing", False))


def is_recomputing() -> bool:
    """True inside the recomputation of a forward during backward.

    A layer with side effects in forward (a running-statistics update, say) skips them here, so
    that they happen once per micro-batch::

        if not gpipe.is_recomputing():
            self.counter += 1
    """
    return bool(getattr(_local, "recomputing", False))


@contextmanager
def _flag(name: str) -> Iterator[None]:
    before = getattr(_local, name, False)
    setattr(_local, name, True)
    try:
        yield
    finally:
        setattr(_local, name, before)


def checkpointing() -> AbstractContextManager[None]:
    return _flag("checkpointing")


def recomputing() -> AbstractContextManager[None]:
    return _flag("recomputing")
