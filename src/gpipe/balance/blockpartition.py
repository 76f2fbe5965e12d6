"""torchgpipe's ``torchgpipe.balance.blockpartition.solve``, with the exact partitioner behind it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from gpipe.balance.solver import solve as _solve

__all__ = ["solve"]

T = TypeVar("T", int, float)


def solve(sequence: Sequence[T], partitions: int = 1) -> list[list[T]]:
    """Split ``sequence`` (costs) into ``partitions`` contiguous blocks whose largest sum is as small
    as possible; the blocks themselves, where :func:`gpipe.balance.solve` gives their lengths."""
    blocks, start = [], 0
    for length in _solve(sequence, partitions):
        blocks.append(list(sequence[start : start + length]))
        start += length
    return blocks
