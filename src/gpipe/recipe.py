"""The paper's training recipe, piece by piece (§5 and the supplementary material).

- :func:`temperature_sampling`: data set l drawn with probability ∝ p_l^(1/T), p_l = D_l / ΣD.
- :func:`inverse_sqrt_schedule`: linear warm-up to a peak, then decay with the inverse square root of
  the step — the paper's "(3.0, 40K)" is ``inverse_sqrt_schedule(optimizer, 3.0, 40_000)``.
- :func:`label_smoothing_loss`: cross entropy against smoothed targets; :class:`count_tokens` makes a
  pipeline's loss the mini-batch's token mean whatever the padding.
- :func:`clip_logits`: logit clipping of the softmax pre-activations.
- :func:`rmsprop`: the image-classification optimizer settings (decay 0.9, ε 0.1, L2 4e-5).
- :func:`adafactor`: ``torch.optim.Adafactor``, as for the translation models.
- :func:`clip_grad_norm_per_parameter`: every parameter's gradient norm clipped on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe.health import grad_norms  # (the library's: the health metrics' global norm is made of them too)

__all__ = [
    "adafactor",
    "clip_grad_norm_per_parameter",
    "clip_logits",
    "count_tokens",
    "grad_norms",
    "inverse_sqrt_lr",
    "inverse_sqrt_schedule",
    "label_smoothing_loss",
    "rmsprop",
    "temperature_sampling",
]


def temperature_sampling(sizes: Sequence[float], temperature: float) -> list[float]:
    """Sampling probabilities of data sets of ``sizes`` at ``temperature`` T: p_l^(1/T), normalized.
    T=1 keeps the true distribution, large T tends to uniform."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive (temperature: {temperature})")
    if not sizes or any(s < 0 for s in sizes) or sum(sizes) <= 0:
        raise ValueError(f"sizes must be non-negative with a positive sum (sizes: {list(sizes)})")
    total = sum(sizes)
    weights = [(s / total) ** (1.0 / temperature) if s else 0.0 for s in sizes]
    norm = sum(weights)
    return [w / norm for w in weights]


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """The learning rate at ``step`` (counted from 1): ``peak * step / warmup`` during warm-up, then
    ``peak * sqrt(warmup / step)``."""
    if warmup <= 0:
        raise ValueError(f"warmup must be positive (warmup: {warmup})")
    step = max(step, 1)
    return peak * step / warmup if step <= warmup else peak * math.sqrt(warmup / step)


def inverse_sqrt_schedule(
    optimizer: torch.optim.Optimizer, peak: float, warmup: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler giving :func:`inverse_sqrt_lr`; set the optimizer's lr to 1.0 (it is a factor),
    and call ``scheduler.step()`` after each optimizer step."""
    for group in optimizer.param_groups:
        group["lr"] = 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: inverse_sqrt_lr(i + 1, peak, warmup))


def label_smoothing_loss(
    logits: Tensor, target: Tensor, smoothing: float = 0.1, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """Cross entropy against targets smoothed by ``smoothing`` (1 - ε on the label, ε spread
    uniformly over all classes), over the last dimension of ``logits``; tokens whose target is
    ``ignore_index`` do not count. ``reduction``: 'mean' over the counted tokens, or 'sum' (with
    ``Pipeline(loss_count=count_tokens(ignore_index))``, the mini-batch's token mean).

    Computed in float32 at least: logits of a lower precision (bf16 or fp16, of a model run under
    autocast) are cast to float32 first, so that the softmax, the loss and its gradient keep its precision."""
    if logits.is_floating_point() and torch.finfo(logits.dtype).bits < 32:
        logits = logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        target.reshape(-1),
        label_smoothing=smoothing,
        ignore_index=ignore_index,
        reduction=reduction,
    )


class count_tokens:  # noqa: N801 - used like a function: Pipeline(loss_count=count_tokens(pad))
    """``count_tokens(ignore_index)(target)``: how many targets are not ``ignore_index`` — the
    ``loss_count`` of a token loss summed over its tokens, so that a pipeline step's loss is the
    mini-batch's token mean however padding falls into micro-batches."""

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index

    def __call__(self, target: Tensor) -> Tensor:
        return (target != self.ignore_index).sum()

    def __repr__(self) -> str:
        return f"count_tokens(ignore_index={self.ignore_index})"


def clip_logits(logits: Tensor, threshold: float | None) -> Tensor:
    """Clip the softmax pre-activations to [-threshold, threshold] (no clipping with ``None``)."""
    return logits if threshold is None else logits.clamp(-threshold, threshold)


def rmsprop(params: Iterable[nn.Parameter], lr: float, *, weight_decay: float = 4e-5) -> torch.optim.RMSprop:
    """RMSProp as in the paper's image classification: decay 0.9, ε = 0.1, L2 ``weight_decay``."""
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9, eps=0.1, weight_decay=weight_decay)


def adafactor(params: Iterable[nn.Parameter], lr: float = 1e-2, **kwargs: Any) -> torch.optim.Adafactor:
    """torch's Adafactor (factored second moments), for the Transformer recipe."""
    return torch.optim.Adafactor(params, lr=lr, **kwargs)


def clip_grad_norm_per_parameter(
    params: Iterable[nn.Parameter], max_norm: float = 1.0, *, norms: list[tuple[nn.Parameter, float]] | None = None
) -> int:
    """Clip every parameter's gradient to norm ``max_norm`` on its own (the paper's per-parameter
    clipping); returns how many were clipped. A sharded parameter's gradient is clipped by the norm of
    the whole gradient, not by its own shard's. ``norms``: :func:`grad_norms` of ``params``, if
    already computed (``gpipe train`` checks them for NaN and Inf first)."""
    clipped = 0
    for p, norm in grad_norms(params) if norms is None else norms:
        if norm > max_norm:
            p.grad.mul_(max_norm / (norm + 1e-6))  # type: ignore[union-attr]
            clipped += 1
    return clipped
