"""Micro-batching: split a mini-batch into M micro-batches along dim 0 and gather them back.

A mini-batch is either a single tensor or a tuple of values. In a tuple, every tensor is split along
dim 0 (they must agree on that size); any other value (an int, a string, ``None``) is handed unchanged
to every micro-batch. As with :func:`torch.chunk`, an uneven batch gives smaller last micro-batches
and a batch smaller than M gives fewer than M micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Batch", "gather", "scatter"]


@dataclass(frozen=True, slots=True)
class Batch:
    """One micro-batch: a single tensor (``atomic``) or a tuple of values.

    Between stages a batch also carries the skip connections stashed and not yet popped
    (:mod:`gpipe.skip`): their tensors are the last ``len(skips)`` values, ``skips`` their names;
    and ``needs_grad``, per value, whether it depends on something that requires grad (only those
    get a gradient back; ``None`` where not known, as for a mini-batch's own micro-batches, whose
    tensors say it themselves).
    """

    values: tuple[Any, ...]
    atomic: bool
    skips: tuple[str, ...] = ()
    needs_grad: tuple[bool, ...] | None = None

    @staticmethod
    def of(value: Any) -> Batch:
        if isinstance(value, Tensor):
            return Batch((value,), atomic=True)
        if isinstance(value, tuple):
            return Batch(value, atomic=False)
        raise TypeError(f"a stage must return a tensor or a tuple of values, not {type(value).__name__}")

    @property
    def value(self) -> Any:
        """What a layer receives: the tensor itself, or the tuple (without the skips)."""
        if self.atomic:
            return self.values[0]
        return self.values[: len(self.values) - len(self.skips)] if self.skips else self.values

    def skip_items(self) -> dict[str, Any]:
        """The skip connections this batch carries, by name."""
        return dict(zip(self.skips, self.values[len(self.values) - len(self.skips) :])) if self.skips else {}

    def with_skips(self, skips: dict[str, Any]) -> Batch:
        """The same values, carrying ``skips`` (in name order) instead of any it carried."""
        names = tuple(sorted(skips))
        own = self.values[: len(self.values) - len(self.skips)]
        return Batch(own + tuple(skips[n] for n in names), self.atomic, names)

    def tensors(self) -> Iterator[Tensor]:
        return (v for v in self.values if isinstance(v, Tensor))

    def map(self, fn: Callable[[Tensor], Any]) -> Batch:
        """Apply ``fn`` to every tensor, keeping the other values."""
        values = tuple(fn(v) if isinstance(v, Tensor) else v for v in self.values)
        return Batch(values, self.atomic, self.skips, self.needs_grad)

    def grad_flags(self) -> tuple[bool, ...]:
        """Per value, whether it needs a gradient: ``needs_grad``, or what the tensors say."""
        if self.needs_grad is not None:
            return self.needs_grad
        return tuple(isinstance(v, Tensor) and v.requires_grad for v in self.values)

    def flagged(self, needs_grad: tuple[bool, ...]) -> Batch:
        return Batch(self.values, self.atomic, self.skips, needs_grad)

    def __len__(self) -> int:
        return len(self.values)


def _as_values(inputs: Any) -> tuple[tuple[Any, ...], bool]:
    if isinstance(inputs, Tensor):
        return (inputs,), True
    if isinstance(inputs, tuple):
        if not any(isinstance(v, Tensor) for v in inputs):
            kinds = ", ".join(type(v).__name__ for v in inputs) or "empty tuple"
            raise TypeError(f"expected a tuple with at least one tensor to split, got ({kinds})")
        return inputs, False
    raise TypeError(
        f"expected a tensor or a tuple of tensors, got {type(inputs).__name__}; wrap several inputs in a tuple"
    )


def scatter(inputs: Any, chunks: int) -> list[Batch]:
    """Split ``inputs`` into at most ``chunks`` micro-batches along dim 0."""
    if chunks <= 0:
        raise ValueError(f"chunks must be a positive integer (chunks: {chunks})")
    values, atomic = _as_values(inputs)
    tensors = [v for v in values if isinstance(v, Tensor)]
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("cannot split a 0-dimensional tensor into micro-batches; give a batch dimension")
    sizes = sorted({t.size(0) for t in tensors})
    if len(sizes) != 1:
        raise ValueError(f"all tensors of a batch must have the same size in dim 0, got sizes {sizes}")
    (size,) = sizes
    if size == 0:
        raise ValueError("cannot split an empty batch (size 0 in dim 0) into micro-batches")
    split = [v.chunk(chunks) if isinstance(v, Tensor) else None for v in values]
    count = len(next(s for s in split if s is not None))
    return [Batch(tuple(v if s is None else s[m] for v, s in zip(values, split)), atomic) for m in range(count)]


def gather(batches: Sequence[Batch]) -> Any:
    """Concatenate micro-batches back into one batch, in order.

    Tensors are concatenated along dim 0 (0-dimensional ones, such as a per-micro-batch loss, are
    stacked); any other value is taken from the first micro-batch.
    """
    if not batches:
        raise ValueError("nothing to gather: no micro-batches")
    first = batches[0]
    out: list[Any] = []
    for i, v in enumerate(first.values):
        if isinstance(v, Tensor):
            parts = [b.values[i] for b in batches]
            out.append(torch.stack(parts) if v.dim() == 0 else torch.cat(parts))
        else:
            out.append(v)
    return out[0] if first.atomic else tuple(out)
