"""Auxiliary losses of layers (a mixture of experts' load-balancing loss), added to the training
objective through autograd, whatever the cut into stages and the schedule.

A layer returns ``with_auxiliary_loss(x, loss)`` instead of ``x``: the value is ``x``'s; in
backward, ``loss`` gets the gradient ``share``, the micro-batch's share of the mini-batch (its rows
over the mini-batch's, every replica's), which a pipeline step sets around each micro-batch's layers
(:func:`micro_batch_share`; 1 outside a step: one call is the whole batch). The objective a step
minimizes is then the main loss plus the mini-batch's row-weighted mean of each micro-batch's
auxiliary losses, computed where the layer runs: nothing travels between stages, and a stage
recomputed in backward adds its gradient once, as a plain run does. The value is not part of the
loss a step returns.

Part of the library: imports torch alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

__all__ = ["micro_batch_share", "share", "with_auxiliary_loss"]

_SHARE: ContextVar[float] = ContextVar("gpipe_micro_batch_share", default=1.0)


@contextmanager
def micro_batch_share(value: float) -> Iterator[None]:
    """Within: the running micro-batch is ``value`` of the mini-batch (its rows over the mini-batch's)."""
    token = _SHARE.set(value)
    try:
        yield
    finally:
        _SHARE.reset(token)


def share() -> float:
    """The running micro-batch's share of the mini-batch (1 outside a pipeline step)."""
    return _SHARE.get()


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, loss: Tensor, weight: float) -> Tensor:
        ctx.weight = weight
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.weight), None


def with_auxiliary_loss(x: Tensor, loss: Tensor) -> Tensor:
    """``x``, with ``loss`` (a scalar) added to the objective of the running step, weighted by the
    micro-batch's :func:`share`. Without autograd (evaluation), ``x`` itself."""
    if not (torch.is_grad_enabled() and loss.requires_grad and x.requires_grad):
        return x
    out: Tensor = _Attach.apply(x, loss, _SHARE.get())  # type: ignore[no-untyped-call]  # (untyped in torch)
    return out
