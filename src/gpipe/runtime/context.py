"""What a step hands its stages and what a forward keeps for backward: :class:`StepContext` (the
caller's autocast, grad mode, targets, ... captured once per step), :class:`Saved`, and
:func:`loss_scale` (what each micro-batch's loss is multiplied by).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from gpipe.checkpoint import Selective
from gpipe.microbatch import Batch

__all__ = [
    "AUTOCAST_DEVICE_TYPES", "Grads", "LossFn", "Saved", "StepContext", "leaf", "loss_scale", "pairs", "settled",
]  # fmt: skip

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")

LossFn = Callable[[Any, Any], Tensor]


@dataclass(frozen=True)
class StepContext:
    """What every stage of one step needs to know, captured from the caller's thread."""

    seed: int
    num_microbatches: int
    checkpoint_stop: int
    grad_enabled: bool
    training: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]
    targets: Sequence[Any] | None = None
    loss_scale: Sequence[float] | None = None
    selective: Selective | None = None
    """How micro-batches ``0 .. checkpoint_stop-1`` are re-materialized, when selectively."""
    shares: Sequence[float] | None = None
    """Each micro-batch's share of the mini-batch (its rows over the mini-batch's, every replica's):
    what an auxiliary loss is weighted by (:mod:`gpipe.auxiliary`)."""
    first_microbatch: int = 0
    """The index, among the mini-batch's micro-batches (every replica's), of this replica's first one:
    replica r of a pipeline of M chunks has micro-batches r*M .. r*M+M-1, each seeded by its index, so
    that replicas draw different numbers (and a run of D replicas draws as one process with D*M chunks)."""

    @staticmethod
    def capture(
        *,
        num_microbatches: int,
        checkpoint_stop: int,
        training: bool,
        seed: int,
        targets: Sequence[Any] | None = None,
        loss_scale: Sequence[float] | None = None,
        selective: Selective | None = None,
        shares: Sequence[float] | None = None,
        first_microbatch: int = 0,
    ) -> StepContext:
        grad = torch.is_grad_enabled()
        autocast = tuple(
            (dt, torch.get_autocast_dtype(dt), torch.is_autocast_enabled(dt)) for dt in AUTOCAST_DEVICE_TYPES
        )
        stop = checkpoint_stop if grad and training else 0
        policy = selective if stop else None
        return StepContext(
            seed, num_microbatches, stop, grad, training, autocast, targets, loss_scale, policy, shares,
            first_microbatch,
        )  # fmt: skip

    @contextmanager
    def applied(self, device: torch.device) -> Iterator[None]:
        """Enter the caller's autocast state (and the stage's CUDA device) on a worker thread."""
        with ExitStack() as stack:
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            for device_type, dtype, enabled in self.autocast:
                if enabled or torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield


Grads = tuple[Tensor | None, ...]


def leaf(t: Tensor) -> Tensor:
    """A fresh autograd leaf with ``t``'s values, requiring grad where ``t`` does (a tape's layer input)."""
    return t.detach().requires_grad_(t.requires_grad)


def settled(batch: Batch) -> Batch:
    """``batch``, its collectives waited for: a tensor-parallel layer's all-reduce (DTensor's
    functional collectives) hands back its output before it is done, and is waited for when the
    output is next read. A recomputed output is never read, only differentiated (a backward's
    root), so its all-reduce would stay registered, holding its buffers, to the end of the process
    (which warns of "unwaited collective calls"); every stage output is waited for here instead."""
    for t in batch.tensors():
        if isinstance(t, AsyncCollectiveTensor):
            t.trigger_wait()  # type: ignore[no-untyped-call]  # (untyped in torch)
    return batch


def pairs(outputs: Batch, grads: Grads) -> tuple[list[Tensor], list[Tensor]]:
    """The outputs that need a gradient and have one, with their gradients."""
    outs, gs = [], []
    for o, g in zip(outputs.values, grads):
        if isinstance(o, Tensor) and o.requires_grad and g is not None:
            outs.append(o)
            gs.append(g)
    return outs, gs


@dataclass
class Saved:
    """What a forward keeps for its backward.

    ``inputs``: the stage's input leaves. ``outputs``: the outputs with their autograd graph, unless
    re-materialized. ``tape``: for a split backward, each layer's (input leaves, outputs).
    ``output_grads``: after I, each taped layer's output gradients, for W; ``weight_grads``: the
    weight gradients I already computed, for layers whose backward cannot be split (compiled ones).
    ``recompute``: under a selective policy, the taped layers whose graph the forward dropped, each
    with the context its recomputation runs in (``None``: plainly), and ``layers`` the functions
    the forward called (the recomputation calls them again).
    """

    inputs: Batch
    outputs: Batch | None
    tape: list[tuple[Batch, Batch]] | None = None
    output_grads: list[Grads] = field(default_factory=list)
    weight_grads: dict[int, Grads] = field(default_factory=dict)
    recompute: dict[int, AbstractContextManager[Any] | None] = field(default_factory=dict)
    layers: list[Callable[[Any], Any]] | None = None


def loss_scale(
    loss_count: Callable[[Any], int | Tensor] | None, target: Any, sizes: Sequence[int], total: int
) -> list[float]:
    """What each micro-batch's loss is multiplied by: its share of the mini-batch's ``total``
    samples, or with ``loss_count`` one over the items the whole mini-batch counts (every replica's)."""
    if loss_count is None:
        return [n / total for n in sizes]
    found = loss_count(target)
    if isinstance(found, Tensor) and found.numel() != 1:
        raise ValueError(f"loss_count must return a number, got a tensor of shape {tuple(found.shape)}")
    count = found.item() if isinstance(found, Tensor) else found
    if not isinstance(count, (int, float)) or count < 0:
        raise ValueError(f"loss_count must return a number >= 0 (loss_count(target): {count!r})")
    return [1.0 / count if count else 0.0] * len(sizes)
